"""The EAGLE-3 draft head: fuse k residual streams of the target, read the next token's embedding,
run one Llama-style decoder layer and predict over a reduced draft vocabulary.

Graph (as in SafeAILab/EAGLE ``eagle/traineagle3/cnets.py`` and SpecForge
``specforge/modeling/draft/llama3_eagle.py``; the book's Methods page)::

    f      = fc(concat(h_1..h_k))                       # [B, T, k*H_t] -> [B, T, H]
    a_in   = concat(input_layernorm(e), hidden_norm(f)) # embedding first, 2H wide
    h1     = f + o_proj(attn(q/k/v_proj(a_in)))         # residual around attention is un-normalised f
    h2     = h1 + mlp(post_attention_layernorm(h1))
    logits = lm_head(norm(h2))                          # draft vocabulary
    h2 is fed back (pre-norm) as the next draft step's feature, skipping ``fc``.

The embedding is the target's own (frozen, not a parameter of the head, not saved). Attention is
computed from explicit key/value tensors and a boolean mask, so the same code serves
training-time test (keys of earlier unrolled steps), chain drafting and tree drafting (a tree mask
over cached keys).

Over ~450 lines because the graph, its config (what every export reads) and saving/loading with the
fingerprint that names a head are one format.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import DrafterError, LayerIdError

if TYPE_CHECKING:
    from ..models import Target



INPUT_NORMS = ("none", "rms")


@dataclass
class DraftConfig:
    """Everything needed to rebuild a head and to check it belongs to a target.

    ``layer_ids`` are vLLM ids (0 = embedding output, i = output of block i before the final norm),
    in the order their streams are concatenated (ascending).
    """

    target_name: str
    target_n_layers: int
    target_hidden_size: int
    target_vocab_size: int
    layer_ids: list[int]
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    #: "none" (EAGLE-3) or "rms": each of the k target streams is divided by its own root mean
    #: square before ``fc`` (no weights). Residual streams differ in scale by orders of magnitude
    #: across depth; "rms" lets ``fc`` start from comparable inputs. Exports must declare it.
    input_norm: str = "none"
    #: the embedding-only control: ``fuse`` gives zeros whatever the target streams hold, so the
    #: head drafts from the token embedding and its own attention alone. A diagnostic (does a head
    #: use its layers?), never exported
    embedding_only: bool = False
    #: a local-directory target's resolved ``target_path`` and ``target_fingerprint`` (exports use
    #: the path as the verifier); empty for embedded models and HF ids, whose configs feed cache keys
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.embedding_only:  # added later: left out at its default, so earlier heads keep their identity
            d.pop("embedding_only")
        return d

    @classmethod
    def from_dict(cls, data: dict) -> DraftConfig:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def for_target(cls, target: Target, layer_ids: list[int], draft_vocab_size: int) -> DraftConfig:
        """Size the head like one block of the target (the EAGLE-3 choice)."""
        layer_ids = check_draft_layer_ids(layer_ids, target.n_layers)
        if not 1 <= draft_vocab_size <= target.vocab_size:
            raise DrafterError(
                f"draft_vocab_size={draft_vocab_size} must be between 1 and the target's vocabulary "
                f"size {target.vocab_size}"
            )
        cfg = target.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        return cls(
            target_name=target.name,
            target_n_layers=target.n_layers,
            target_hidden_size=target.hidden_size,
            target_vocab_size=target.vocab_size,
            layer_ids=layer_ids,
            hidden_size=target.hidden_size,
            intermediate_size=int(cfg.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            draft_vocab_size=int(draft_vocab_size),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(cfg)),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 8192)),
            extra=target_extra(target),
        )

    def check_target(self, target: Target) -> None:
        """Refuse a head trained for another target: name and shapes must match, and a head trained
        on a local directory refuses a checkpoint with another fingerprint."""
        mine = (self.target_name, self.target_n_layers, self.target_hidden_size, self.target_vocab_size)
        theirs = (target.name, target.n_layers, target.hidden_size, target.vocab_size)
        if mine != theirs:
            raise DrafterError(
                f"this drafter was trained for target {self.target_name!r} (N={self.target_n_layers}, "
                f"d={self.target_hidden_size}, V={self.target_vocab_size}) but the target is {target.name!r} "
                f"(N={target.n_layers}, d={target.hidden_size}, V={target.vocab_size}); train a drafter "
                "for this target"
            )
        recorded = self.extra.get("target_fingerprint")
        if recorded is not None and recorded != getattr(target, "fingerprint", None):
            where = getattr(target, "path", None) or target.source
            raise DrafterError(
                f"this drafter was trained for the checkpoint in {self.extra.get('target_path')} (fingerprint "
                f"{recorded[:16]}) but the target {where} has fingerprint {str(getattr(target, 'fingerprint', None))[:16]}: "
                "its config or weights differ; train a drafter for this checkpoint"
            )


def target_extra(target: Target) -> dict:
    """What a head records of a local-directory target (``DraftConfig.extra``): its resolved path
    and checkpoint fingerprint, so the head is refused by a changed checkpoint and an export can
    name the directory as the verifier. Empty for other targets (their head configs stay as they were)."""
    path = getattr(target, "path", None)
    if path is None:
        return {}
    return {"target_path": str(path), "target_fingerprint": target.fingerprint}


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(params, dict):
        if "rope_theta" in params:
            return params["rope_theta"]
        for sub in params.values():  # gemma-3: {"full_attention": {...}, "sliding_attention": {...}}
            if isinstance(sub, dict) and "rope_theta" in sub:
                return sub["rope_theta"]
    return getattr(cfg, "rope_theta", 10000.0)


def check_draft_layer_ids(layer_ids: Any, n_layers: int) -> list[int]:
    """Layer ids a drafter reads: at least one, each in 0..N, no duplicates; returned ascending."""
    try:
        ids = [int(i) for i in layer_ids]
    except (TypeError, ValueError):
        raise LayerIdError(f"layer_ids must be a list of integers, got {layer_ids!r}") from None
    if not ids:
        raise LayerIdError("a drafter needs at least one layer id")
    if len(ids) > n_layers + 1:
        raise LayerIdError(f"k={len(ids)} layer ids is more than the N+1={n_layers + 1} ids the target has")
    bad = [i for i in ids if not 0 <= i <= n_layers]
    if bad:
        raise LayerIdError(f"layer ids {bad} are out of range; allowed 0..{n_layers} (vLLM convention)")
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise LayerIdError(f"layer ids {dup} are repeated in {ids}; each layer may be read once")
    return sorted(ids)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(head_dim: int, theta: float, device: Any = None, dtype: Any = torch.float32) -> torch.Tensor:
    """Angle per position of each rotate-half pair i < head_dim/2: ``theta ** (-2i / head_dim)``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim))


#: rotary tables ``(cos, sin)``, float32 [B, 1, T, hd], of some positions (:func:`rope_tables`)
Rotary = tuple[torch.Tensor, torch.Tensor]


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> Rotary:
    """cos and sin of every rotary angle at ``positions`` [B, T]: float32 [B, 1, T, head_dim]
    (rotate-half layout, each half repeated). Computed once, they serve every call of
    :func:`apply_rope` at those positions (training-time test slices one table per unroll)."""
    inv = rope_frequencies(head_dim, theta, positions.device)
    ang = positions.to(torch.float32)[:, None, :, None] * inv  # [B, 1, T, hd/2]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def apply_rope(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x`` [B, h, T, hd] with tables from :func:`rope_tables`."""
    hd = x.shape[-1]
    cos, sin = rotary[0].to(x.dtype), rotary[1].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, h, T, hd], k and v [B, h_kv, T, hd], rotary (tables of x's positions) applied to q and k."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return apply_rope(q, rotary), apply_rope(k, rotary), v

    def _per_head(self, x: torch.Tensor) -> torch.Tensor:
        """k or v [B, h_kv, S, hd] repeated to the query heads (grouped-query attention)."""
        rep = self.c.num_attention_heads // self.c.num_key_value_heads
        return x.repeat_interleave(rep, dim=1) if rep > 1 else x

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.c.num_attention_heads * self.c.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, h, T, hd] over k/v [B, h_kv, S, hd]; ``mask`` bool [B or 1, 1, T, S],
        True where a query may see a key. Returns [B, T, H]."""
        return self._out(F.scaled_dot_product_attention(q, self._per_head(k), self._per_head(v), attn_mask=mask))

    def attend_ttt(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """The attention of training-time-test step j = len(keys) - 1 (EAGLE-3's unrolled draft
        steps): query t sees step 0's keys at positions <= t (causal) and each later step's key at
        t only. ``keys``/``values``: [B, h_kv, T, hd] per step, step 0 first. Equal to :meth:`attend`
        over the concatenated keys with the causal-plus-diagonals mask, without the masked-out
        (j+1)T x T blocks: the diagonal keys are one score per position. Right-padded batches need no
        padding mask (a real query's causal keys are real). Softmax in float32 at least. Returns [B, T, H]."""
        b, h, t, hd = q.shape
        kv = self.c.num_key_value_heads
        rep = h // kv
        # grouped-query attention without repeating keys and values: query head i reads key head
        # i // rep, so the rep query heads of one key head are stacked along T ([B * h_kv, rep * T, hd])
        q = (q * self.c.head_dim ** -0.5).unflatten(1, (kv, rep))  # scaled first: T x hd numbers, not T x T
        # the causal mask as an additive bias of the product (one fused op, none on the gradient)
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        bias = torch.zeros(t, t, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf")).repeat(rep, 1)
        scores = torch.baddbmm(bias, q.reshape(b * kv, rep * t, hd),
                               keys[0].reshape(b * kv, t, hd).transpose(-1, -2)).view(b, h, t, t)
        if len(keys) > 1:  # one score per position for each later step's key: [B, h, T, j]
            diagonal = torch.stack([(q * k[:, :, None]).sum(-1).flatten(1, 2) for k in keys[1:]], dim=-1)
            scores = torch.cat([scores, diagonal.to(scores.dtype)], dim=-1)
        wide = torch.promote_types(scores.dtype, torch.float32)  # at least float32
        # split, not sliced: its backward joins the parts' gradients in one op, where each slice
        # would fill a zero gradient of the whole [B, h, T, T + j]; each part is cast on its own,
        # so the causal block reaches its product contiguous
        causal_probs, diagonal_probs = torch.softmax(scores, dim=-1, dtype=wide).split([t, len(keys) - 1], dim=-1)
        out = (causal_probs.to(q.dtype).reshape(b * kv, rep * t, t) @ values[0].reshape(b * kv, t, hd)).view(b, h, t, hd)
        weights = diagonal_probs.to(q.dtype).unflatten(1, (kv, rep))  # [B, h_kv, rep, T, j]
        for i, v in enumerate(values[1:]):
            out = out + (weights[..., i, None] * v[:, :, None]).flatten(1, 2)
        return self._out(out)


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


@dataclass
class DraftStep:
    """Output of one draft step over T new positions."""

    hidden: torch.Tensor  # [B, T, H], pre-norm: the feature of the next draft step
    logits: torch.Tensor | None  # [B, T, V_d], draft vocabulary (None when not asked for)
    k: torch.Tensor  # [B, h_kv, T, hd], this step's keys (rotary applied): append to a cache
    v: torch.Tensor  # [B, h_kv, T, hd]


class DraftHead(nn.Module):
    """Trainable parts of an EAGLE-3 head; the token embedding is passed in (the target's, frozen).

    Parameter names match the EAGLE/SpecForge checkpoint (``fc``, ``midlayer.*``, ``norm``,
    ``lm_head``; buffers ``d2t``, ``t2d``), so export is a rename-free copy.
    """

    def __init__(self, config: DraftConfig):
        super().__init__()
        if config.input_norm not in INPUT_NORMS:
            raise DrafterError(f"input_norm={config.input_norm!r} is not one of {INPUT_NORMS}")
        c = self.config = config
        k = len(c.layer_ids)
        self.fc = nn.Linear(k * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DecoderLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # identity maps until a vocabulary is set: draft id i = target id i
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.target_vocab_size, dtype=torch.bool))
        self.t2d[: c.draft_vocab_size] = True

    # ---- vocabulary ----------------------------------------------------------------------
    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Install the draft vocabulary: ``draft_to_target[i]`` is the target id of draft id i
        (ascending, unique). Stored as EAGLE's offsets ``d2t`` and mask ``t2d``."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long)
        if ids.shape != (self.config.draft_vocab_size,):
            raise DrafterError(f"draft vocabulary has {ids.numel()} ids, the head expects {self.config.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of each draft id: ``arange + d2t``."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ---- forward -------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor, float32: bool = False) -> torch.Tensor:
        """Concatenated target streams [B, T, k*H_t] (ascending layer ids) -> fused feature [B, T, H].

        ``float32=True`` (``TrainSettings.fc_precision="float32"``) computes ``fc`` and the input
        norm in float32 even under ``torch.autocast``, and returns the result in the dtype the rest
        of the head computes in (autocast's, else the weights'): only the fusion's arithmetic
        changes, the streams of very different scale meet fc without bfloat16 rounding. Without
        autocast and with float32 weights (scoring, decoding) it is the plain path."""
        if self.config.embedding_only:
            return features.new_zeros(*features.shape[:-1], self.config.hidden_size)
        if not float32:
            return self.fc(self.fc_inputs(features))
        device = features.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.fc.weight.dtype
        with torch.autocast(device, enabled=False):
            fused = F.linear(self.fc_inputs(features.float()), self.fc.weight.float())
        return fused.to(dtype)

    def fc_inputs(self, features: torch.Tensor) -> torch.Tensor:
        """The concatenated streams as ``fc`` sees them: divided each by its RMS when ``input_norm="rms"``."""
        if self.config.input_norm != "rms":
            return features
        k, d = len(self.config.layer_ids), self.config.target_hidden_size
        x = features.unflatten(-1, (k, d))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return x.flatten(-2)

    def step(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        past_k: torch.Tensor | None = None,
        past_v: torch.Tensor | None = None,
        with_logits: bool = True,
    ) -> DraftStep:
        """One draft step for T new positions.

        ``hidden`` [B, T, H]: fused target feature (``fuse``) or the previous step's pre-norm output;
        ``embeds`` [B, T, H]: target embedding of the token that follows each position;
        ``positions`` [B, T]: rotary positions; ``mask`` bool [B or 1, 1, T, S + T]: which of the
        ``S`` cached keys (``past_k``/``past_v`` [B, h_kv, S, hd]) and the T new keys each query sees.
        ``with_logits=False`` leaves ``logits`` None: training reads out only the positions its loss
        counts (:meth:`readout` on those rows) and skips the draft-vocabulary product elsewhere.
        """
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = k if past_k is None else torch.cat([past_k, k], dim=2)
            values = v if past_v is None else torch.cat([past_v, v], dim=2)
            return self.midlayer.self_attn.attend(q, keys, values, mask)

        rotary = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        return self._block(hidden, self.midlayer.input_layernorm(embeds), rotary, attend, with_logits)

    def step_ttt(self, hidden: torch.Tensor, normed_embeds: torch.Tensor, rotary: Rotary,
                 keys: list[torch.Tensor], values: list[torch.Tensor], with_logits: bool = True) -> DraftStep:
        """Training-time-test step j = len(keys) over every position at once: :meth:`step` with the
        causal-plus-diagonals mask, computed by :meth:`Attention.attend_ttt`. ``keys``/``values``:
        the keys of steps 0..j-1 (empty for step 0); this step's own are appended. The unroll
        computes what every step shares once: ``normed_embeds`` is ``midlayer.input_layernorm`` of
        the embeddings (a per-position norm, so shifting the normed embeddings equals norming the
        shifted ones) and ``rotary`` the tables of this step's positions (:func:`rope_tables`)."""
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.midlayer.self_attn.attend_ttt(q, [*keys, k], [*values, v])

        return self._block(hidden, normed_embeds, rotary, attend, with_logits)

    def _block(self, hidden: torch.Tensor, normed_embeds: torch.Tensor, rotary: Rotary, attend: Any,
               with_logits: bool) -> DraftStep:
        layer = self.midlayer
        x = _autocast_once(torch.cat([normed_embeds, layer.hidden_norm(hidden)], dim=-1))
        q, k, v = layer.self_attn.project(x, rotary)
        h1 = hidden + attend(q, k, v)
        h2 = h1 + layer.mlp(_autocast_once(layer.post_attention_layernorm(h1)))
        return DraftStep(h2, self.readout(h2) if with_logits else None, k, v)

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of pre-norm hidden states [..., H] -> [..., V_d]."""
        return self.lm_head(self.norm(hidden))

    def n_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def _autocast_once(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype when autocast is on, else as it is. For an input that several
    linears read (q/k/v, gate/up): autocast would cast it once per linear, forward and backward;
    cast once, every linear sees the same values."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def causal_mask(t: int, device: Any = None) -> torch.Tensor:
    """bool [1, 1, t, t], True on and below the diagonal."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()[None, None]


def init_head(head: DraftHead, seed: int = 0, std: float = 0.02) -> DraftHead:
    """Deterministic initialisation (normal(0, std) linears, unit norms) from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return head



def head_fingerprint(head: "DraftHead") -> str:
    """sha256 (16 hex) of the head's config and every tensor (weights, d2t, t2d): the drafter's identity."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(head.config.to_dict(), sort_keys=True).encode())
    for name, t in sorted(head.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


__all__ = [
    "DraftConfig", "DraftHead", "DraftStep", "DrafterError", "check_draft_layer_ids", "causal_mask",
    "head_fingerprint", "init_head", "rope_frequencies", "rope_tables", "apply_rope", "save_head", "load_head",
]


# ---- saving and loading ------------------------------------------------------------------------
HEAD_CONFIG = "wavesurf-drafter.json"
HEAD_WEIGHTS = "drafter.safetensors"


def save_head(head: DraftHead, directory: Any, info: dict | None = None) -> None:
    """Write ``wavesurf-drafter.json`` (config + ``info``, e.g. training facts) and
    ``drafter.safetensors`` (trainable weights, ``d2t``, ``t2d``) into ``directory``."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(directory / HEAD_WEIGHTS))
    payload = {"format": "wavesurf-drafter", "version": 1, "config": head.config.to_dict(), "info": info or {}}
    (directory / HEAD_CONFIG).write_text(json.dumps(payload, indent=2))


def load_head(directory: Any, target: Target | None = None, device: str = "cpu") -> tuple[DraftHead, dict]:
    """Load a head saved by :func:`save_head`; with ``target``, refuse a head trained for another
    target. Returns the head (eval mode) and its ``info``."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path = directory / HEAD_CONFIG
    if not cfg_path.is_file():
        raise DrafterError(f"{directory} is not a wavesurf drafter: {HEAD_CONFIG} is missing")
    payload = json.loads(cfg_path.read_text())
    config = DraftConfig.from_dict(payload["config"])
    if target is not None:
        config.check_target(target)
    head = DraftHead(config)
    head.load_state_dict(load_file(str(directory / HEAD_WEIGHTS)))
    return head.to(device).eval(), payload.get("info", {})
