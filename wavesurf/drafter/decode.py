"""Lossless speculative decoding with an EAGLE-3 draft head on a target, batch size 1.

One *cycle* = draft a tree (or chain) of candidate tokens with the head, verify all of them in ONE
target forward with a tree attention mask, commit the accepted path plus the target's own next
token (the "bonus" / correction token), as in SafeAILab/EAGLE ``eagle/model/ea_model.py``.

Alignment (EAGLE-3): committed tokens x_0..x_m; the target's KV cache and its features f_t cover
positions 0..m-1 and x_m (the *root*) is not yet processed. The draft at position t reads
(fc(f_t), embedding(x_{t+1})) and predicts x_{t+2}; its pre-norm output is the feature of position
t+1 for the next draft step. The draft KV cache holds one entry per position 0..m-1 computed from
*target* features only ("draft extend" after every verification); tree-expansion KV is discarded.

Counting (eagle3.md 3.3, EAGLE's ``new_token += accept_length + 1`` per cycle):
``tau = tokens committed by cycles / target forwards after the prefill``. The prefill forward
and the first token it yields are excluded; a tie re-check forward (below) counts as a forward.
With every draft rejected each cycle commits exactly one token, so tau = 1.

Losslessness. T = 0: the accepted path is the longest one on which every draft token equals the
target's argmax, and the bonus is the target's argmax after it, so the output is the target's
greedy decoding. T > 0: EAGLE's multi-candidate rule with deterministic drafts: at a node, try the
children in draft-score order, accept child x with probability p(x) under the (renormalised)
target distribution, otherwise set p(x) = 0 and renormalise; when no child is accepted sample
the next token from what is left. Each committed token is therefore an exact sample of the
target distribution at temperature T.

Near ties. A multi-token verify forward (explicit tree mask, several rows) and HF's one-token
decode step run different float32 kernels: the logits differ by up to ~6e-5 on SmolLM2 (measured,
``benchmarks/near_ties.py``), and the KV rows they leave in the cache differ too, so re-running
just the last token alone does not reproduce HF. Where the target's top-2 gap is that small the
greedy argmax can flip. With ``tie_eps > 0`` (default :data:`DEFAULT_TIE_EPS`, ~17x the largest
difference seen), a path position whose top-2 gap is below ``tie_eps`` is decided by a *replay*:
the cache is cut back to the prompt (whose prefill is computed exactly as HF computes it) and every
generated token up to that position is re-run one at a time HF's way; that reproduces HF's logits
bit for bit on SmolLM2 (measured: max difference 0.0), so the decision is HF's. The replay costs
one forward per token generated so far; gaps below 1e-3 occur about once per ~2000 tokens, and
``DecodeResult.tie_rechecks`` counts the extra forwards (they count in tau). Exactness of the
replay holds while the context fits Gemma-3's 512-token sliding window (HF's sliding cache then
holds the same rows as ours).

Target attention: the target is called with an explicit 4D boolean mask (``sdpa``; an additive
float mask for ``eager``), and for models with sliding-window layers (Gemma-3) with a
``{"full_attention", "sliding_attention"}`` dict of masks, the sliding one cut to the window. The
target cache is a ``DynamicCache`` with plain full layers, so rows can be kept or dropped freely.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DecodeError, is_int
from ..taps import ResidualTaps
from .head import DraftHead

#: top-2 logit gap (logit units) below which a T=0 decision is re-made with a one-token forward.
DEFAULT_TIE_EPS = 1e-3



# ---------------------------------------------------------------------------------------------
# settings
@dataclass(frozen=True)
class TreeSpec:
    """Shape of the draft tree.

    ``depth``: most draft tokens on one path (levels below the root); ``top_k``: children tried per
    expanded node and the number of nodes expanded per level; ``total_tokens``: draft tokens kept
    for verification (the verify forward sees ``total_tokens + 1`` tokens: root + drafts). A
    chain of K tokens is ``TreeSpec(K, 1, K)``.
    """

    depth: int
    top_k: int
    total_tokens: int

    def __post_init__(self) -> None:
        check_tree(self.depth, self.top_k, self.total_tokens)

    @classmethod
    def chain(cls, draft_len: int) -> TreeSpec:
        if not is_int(draft_len, 1):
            raise DecodeError(f"draft_len={draft_len!r} must be an integer >= 1")
        return cls(draft_len, 1, draft_len)

    @property
    def max_nodes(self) -> int:
        """Candidates the drafting produces: top_k at level 1, top_k * top_k at each later level."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1

    def describe(self) -> dict:
        return {"mode": "chain" if self.is_chain else "tree", "depth": self.depth, "top_k": self.top_k,
                "total_tokens": self.total_tokens}


def check_tree(depth: Any, top_k: Any, total_tokens: Any) -> None:
    """Refuse tree settings that cannot be built (the message says what is allowed)."""
    for name, v in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
        if not is_int(v, 1):
            raise DecodeError(f"{name}={v!r} must be an integer >= 1")
    if total_tokens < depth:
        raise DecodeError(
            f"total_tokens={total_tokens} is smaller than depth={depth}: a path of depth {depth} needs "
            f"{depth} draft tokens; use total_tokens >= depth or a smaller depth")
    most = top_k + (depth - 1) * top_k * top_k
    if total_tokens > most:
        raise DecodeError(
            f"total_tokens={total_tokens} is more than the {most} candidates a tree with depth={depth}, "
            f"top_k={top_k} drafts (top_k + (depth-1)*top_k^2); use total_tokens <= {most}")


def make_tree(mode: str = "chain", *, draft_len: int = 4, depth: int = 5, top_k: int = 4,
              total_tokens: int = 16) -> TreeSpec:
    """``mode="chain"`` uses ``draft_len``; ``mode="tree"`` uses depth/top_k/total_tokens."""
    if mode == "chain":
        return TreeSpec.chain(draft_len)
    if mode == "tree":
        return TreeSpec(depth, top_k, total_tokens)
    raise DecodeError(f"mode={mode!r} is not one of 'chain', 'tree'")


def check_decode_settings(max_new_tokens: Any, temperature: Any) -> None:
    """Refuse a bad generation length or temperature before any model work."""
    if not is_int(max_new_tokens, 1):
        raise DecodeError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or temperature == float("inf"):
        raise DecodeError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")


# ---------------------------------------------------------------------------------------------
# result
@dataclass
class DecodeResult:
    """What one generation produced and cost. ``tokens`` excludes the prompt and includes a final EOS."""

    method: str
    tokens: list[int]
    seconds: float  # wall time of the whole generation, prefill included
    n_target_forwards: int  # every target forward, prefill included
    cycle_tokens: list[int] = field(default_factory=list)  # tokens committed by each forward after the prefill
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per cycle (speculative only)
    draft_steps: int = 0  # draft-head forwards (extend + expansion levels)
    tie_rechecks: int = 0  # extra one-token target forwards spent on near-tie replays
    prompt_tokens: int = 0
    stopped: str = ""  # "eos" or "max_new_tokens"

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward after the prefill (EAGLE's acceptance length)."""
        n = len(self.cycle_tokens)
        return sum(self.cycle_tokens) / n if n else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> dict:
        return {"method": self.method, "new_tokens": self.new_tokens, "tau": round(self.tau, 4),
                "n_target_forwards": self.n_target_forwards, "tie_rechecks": self.tie_rechecks,
                "draft_steps": self.draft_steps, "seconds": round(self.seconds, 4),
                "tokens_per_second": round(self.tokens_per_second, 3), "stopped": self.stopped}


# ---------------------------------------------------------------------------------------------
# helpers shared by all decoders
def eos_ids(target: Any) -> set[int]:
    """Token ids that end a generation: the generation config's ``eos_token_id`` (int or list),
    else the tokenizer's."""
    gc = getattr(target.model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = target.tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _as_ids(input_ids: Any, device: str) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise DecodeError(f"batch size {ids.shape[0]}: speculative decoding here is batch size 1")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() < 1:
        raise DecodeError(f"input_ids must be a non-empty 1D sequence of token ids, got shape {tuple(ids.shape)}")
    return ids.to(device)


def _finish(new: list[int], produced: list[int], eos: set[int], budget: int) -> tuple[list[int], bool]:
    """Append ``new`` to ``produced`` up to the first EOS (kept) and the budget; True when done."""
    for t in new:
        if len(produced) >= budget:
            return produced, True
        produced.append(int(t))
        if int(t) in eos:
            return produced, True
    return produced, len(produced) >= budget


def _sample(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    if temperature == 0:
        return int(torch.argmax(logits))
    p = torch.softmax(logits.double() / temperature, dim=-1)
    return int(torch.multinomial(p, 1, generator=gen))


class _TargetRunner:
    """Target forwards with explicit (tree) masks over a plain ``DynamicCache``, reading the
    drafter's feature layers through forward hooks."""

    def __init__(self, target: Any, layer_ids: Sequence[int]):
        from transformers import DynamicCache

        self.target, self.model = target, target.model
        self.layer_ids = list(layer_ids)
        cfg = self.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.impl = getattr(cfg, "_attn_implementation", "sdpa") or "sdpa"
        if self.impl not in ("sdpa", "eager"):
            raise DecodeError(
                f"attention implementation {self.impl!r} does not take a tree mask; load the target with "
                "attn_implementation='sdpa' or 'eager'")
        types = list(getattr(cfg, "layer_types", None) or [])
        self.sliding = int(getattr(cfg, "sliding_window", 0) or 0) if "sliding_attention" in types else 0
        self.dict_mask = bool(types) and self.sliding > 0
        self.cache = DynamicCache()
        self.key_positions = torch.zeros(0, dtype=torch.long, device=target.device)
        self.hooks = ResidualTaps(self.model, self.layer_ids) if self.layer_ids else None
        self.forwards = 0

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None

    @property
    def length(self) -> int:
        return int(self.key_positions.numel())

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        m = allowed[None, None]
        if self.impl == "eager":
            dtype = next(self.model.parameters()).dtype
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
        return m

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None = None,
                logits_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``ids`` [T] at ``positions`` [T]; ``tree`` bool [T, T] says which new token sees
        which (all cached rows are visible); ``tree=None`` means plain causal order right after the
        cache and lets HF build its own masks, the exact computation of HF's prefill / decode step.
        Returns logits [T, V] (float32; only the last ``logits_rows`` rows if > 0) and features
        [T, k*d] (ascending layer ids) or None."""
        past = self.length
        dev = ids.device
        if tree is None:
            mask: Any = None
        else:
            allowed = torch.cat([torch.ones(len(ids), past, dtype=torch.bool, device=dev), tree], dim=1)
            if self.dict_mask:
                kpos = torch.cat([self.key_positions, positions])
                near = (positions[:, None] - kpos[None, :]) < self.sliding
                mask = {"full_attention": self._mask(allowed), "sliding_attention": self._mask(allowed & near)}
            else:
                mask = self._mask(allowed)
        if self.hooks is not None:
            self.hooks.states = {}
        out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                         cache=self.cache, use_cache=True, logits_to_keep=logits_rows)
        self.forwards += 1
        self.key_positions = torch.cat([self.key_positions, positions])
        feats = None
        if self.hooks is not None:
            feats = torch.cat([self.hooks.states[i][0] for i in self.layer_ids], dim=-1)
            self.hooks.states = {}
        return out.logits[0].float(), feats

    def keep(self, past: int, rows: torch.Tensor) -> None:
        """Keep the first ``past`` cached rows plus new rows ``past + rows`` (in that order)."""
        n = len(rows)
        contiguous = n == 0 or bool((rows == torch.arange(n, device=rows.device)).all())
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            if contiguous:
                layer.keys, layer.values = layer.keys[:, :, : past + n], layer.values[:, :, : past + n]
            else:
                idx = torch.cat([torch.arange(past, device=rows.device), past + rows])
                layer.keys, layer.values = layer.keys[:, :, idx], layer.values[:, :, idx]
        kp = self.key_positions
        self.key_positions = kp[: past + n] if contiguous else torch.cat([kp[:past], kp[past + rows]])


# ---------------------------------------------------------------------------------------------
# plain loops (baselines)
@torch.inference_mode()
def greedy_generate(target: Any, input_ids: Any, max_new_tokens: int, temperature: float = 0.0,
                    seed: int = 0) -> DecodeResult:
    """Our own KV-cached loop, one target forward per token, HF's default cache and masks (the
    baseline that shows what generate's bookkeeping costs). T > 0 samples."""
    from transformers import DynamicCache

    check_decode_settings(max_new_tokens, temperature)
    t0 = time.perf_counter()
    ids = _as_ids(input_ids, target.device)
    eos, model = eos_ids(target), target.model
    gen = torch.Generator(device="cpu").manual_seed(seed) if temperature > 0 else None
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids[None], cache=cache, use_cache=True, logits_to_keep=1)
    produced: list[int] = []
    produced, done = _finish([_sample(out.logits[0, -1].float().cpu(), temperature, gen)], produced, eos, max_new_tokens)
    forwards, cycles = 1, []
    while not done:
        nxt = torch.tensor([[produced[-1]]], device=ids.device)
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        forwards += 1
        produced, done = _finish([_sample(out.logits[0, -1].float().cpu(), temperature, gen)], produced, eos, max_new_tokens)
        cycles.append(1)
    return DecodeResult("plain", produced, time.perf_counter() - t0, forwards, cycles, prompt_tokens=len(ids),
                        stopped="eos" if produced and produced[-1] in eos else "max_new_tokens")


class _ForwardCounter:
    def __init__(self, model: Any):
        self.n = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def remove(self):
        self.handle.remove()


@torch.inference_mode()
def hf_generate(target: Any, input_ids: Any, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                prompt_lookup_num_tokens: int | None = None) -> DecodeResult:
    """HF ``model.generate`` (greedy at T=0), optionally prompt-lookup decoding; target forwards
    are counted with a hook."""
    check_decode_settings(max_new_tokens, temperature)
    ids = _as_ids(input_ids, target.device)
    eos = eos_ids(target)
    model = target.model
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        kwargs.update(temperature=float(temperature), top_k=None, top_p=None)
        torch.manual_seed(seed)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = int(prompt_lookup_num_tokens)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = next(iter(eos), 0)
    counter = _ForwardCounter(model)
    t0 = time.perf_counter()
    try:
        out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], pad_token_id=pad, **kwargs)
    finally:
        counter.remove()
    seconds = time.perf_counter() - t0
    produced, _ = _finish(out[0, len(ids):].tolist(), [], eos, max_new_tokens)
    method = "hf_prompt_lookup" if prompt_lookup_num_tokens else "hf_generate"
    later = counter.n - 1  # forwards after the prefill; tokens after the first spread evenly over them
    cycles = [(len(produced) - 1) / later] * later if later > 0 else []
    return DecodeResult(method, produced, seconds, counter.n, cycles, prompt_tokens=len(ids),
                        stopped="eos" if produced and produced[-1] in eos else "max_new_tokens")


# ---------------------------------------------------------------------------------------------
# speculative decoding
@dataclass
class _Tree:
    tokens: list[int]  # target ids of draft nodes
    parent: list[int]  # node index, -1 = root
    level: list[int]  # 1..depth
    score: list[float]  # cumulative draft log-prob


class SpeculativeDecoder:
    """EAGLE-3 speculative decoding of one sequence with ``head`` on ``target``.

    Build once per (target, head, tree) and call :meth:`generate` per prompt.
    """

    def __init__(self, target: Any, head: DraftHead, tree: TreeSpec | None = None, *,
                 tie_eps: float = DEFAULT_TIE_EPS):
        head.config.check_target(target)
        if not isinstance(tie_eps, (int, float)) or not tie_eps >= 0:
            raise DecodeError(f"tie_eps={tie_eps!r} must be a number >= 0 (0 = no near-tie re-check)")
        self.target, self.head = target, head.to(target.device).eval()
        self.tree = tree or TreeSpec.chain(4)
        if self.tree.top_k > head.config.draft_vocab_size:
            raise DecodeError(f"top_k={self.tree.top_k} is larger than the draft vocabulary "
                              f"({head.config.draft_vocab_size} ids); use top_k <= {head.config.draft_vocab_size}")
        self.tie_eps = float(tie_eps)
        self.embed = target.model.get_input_embeddings()
        self.d2t = head.draft_to_target.to(target.device)
        self.eos = eos_ids(target)

    # ---- draft side ---------------------------------------------------------------------------
    def _draft_extend(self, feats: torch.Tensor, next_tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append draft KV for positions start.. from target features; return (log-probs over the
        draft vocabulary, pre-norm hidden) of the last position."""
        n = len(next_tokens)
        head, s = self.head, self.dk.shape[2] if self.dk is not None else 0
        hidden = head.fuse(feats[None].to(head.fc.weight.dtype))
        emb = self.embed(next_tokens[None])
        pos = torch.arange(start, start + n, device=feats.device)[None]
        mask = torch.cat([torch.ones(n, s, dtype=torch.bool, device=feats.device),
                          torch.ones(n, n, dtype=torch.bool, device=feats.device).tril()], dim=1)[None, None]
        st = head.step(hidden, emb, pos, mask, self.dk, self.dv)
        self.dk = st.k if self.dk is None else torch.cat([self.dk, st.k], dim=2)
        self.dv = st.v if self.dv is None else torch.cat([self.dv, st.v], dim=2)
        self.draft_steps += 1
        return torch.log_softmax(st.logits[0, -1].float(), -1), st.hidden[0, -1]

    def _draft_tree(self, root_logp: torch.Tensor, root_hidden: torch.Tensor, m: int) -> _Tree:
        """EAGLE-2 dynamic tree: expand the top_k best nodes per level, score by cumulative log-prob,
        keep the best ``total_tokens`` nodes (a set closed under parents)."""
        spec, head = self.tree, self.head
        k = spec.top_k
        dev = root_logp.device
        lp, di = root_logp.topk(k)
        tokens = self.d2t[di].tolist()
        parent, level, score = [-1] * k, [1] * k, lp.tolist()
        ancestors: list[set[int]] = [{i} for i in range(k)]
        src_hidden = [root_hidden] * k  # hidden of the step that predicted each node
        draft_id = di.tolist()
        frontier = list(range(k))
        exp_owner: list[int] = []  # node whose expansion produced each expansion key row
        ek = ev = None
        s = self.dk.shape[2]
        for lev in range(2, spec.depth + 1):
            f = len(frontier)
            hid = torch.stack([src_hidden[n] for n in frontier])[None]
            emb = self.embed(torch.tensor([tokens[n] for n in frontier], device=dev)[None])
            pos = torch.full((1, f), m + lev - 2, dtype=torch.long, device=dev)
            seen = torch.zeros(f, len(exp_owner) + f, dtype=torch.bool, device=dev)
            for qi, n in enumerate(frontier):
                for ki, owner in enumerate(exp_owner):
                    if owner in ancestors[n]:
                        seen[qi, ki] = True
                seen[qi, len(exp_owner) + qi] = True
            mask = torch.cat([torch.ones(f, s, dtype=torch.bool, device=dev), seen], dim=1)[None, None]
            pk = self.dk if ek is None else torch.cat([self.dk, ek], dim=2)
            pv = self.dv if ev is None else torch.cat([self.dv, ev], dim=2)
            st = head.step(hid, emb, pos, mask, pk, pv)
            self.draft_steps += 1
            ek = st.k if ek is None else torch.cat([ek, st.k], dim=2)
            ev = st.v if ev is None else torch.cat([ev, st.v], dim=2)
            exp_owner.extend(frontier)
            clp, cdi = torch.log_softmax(st.logits[0].float(), -1).topk(k, dim=-1)  # [f, k]
            children = []
            for qi, n in enumerate(frontier):
                for j in range(k):
                    c = len(tokens)
                    tokens.append(int(self.d2t[cdi[qi, j]]))
                    draft_id.append(int(cdi[qi, j]))
                    parent.append(n)
                    level.append(lev)
                    score.append(score[n] + float(clp[qi, j]))
                    ancestors.append(ancestors[n] | {c})
                    src_hidden.append(st.hidden[0, qi])
                    children.append(c)
            frontier = sorted(children, key=lambda c: (-score[c], c))[:k]
        order = sorted(range(len(tokens)), key=lambda c: (-score[c], level[c], c))
        chosen: list[int] = []
        taken: set[int] = set()
        for c in order:
            if len(chosen) == spec.total_tokens:
                break
            if parent[c] == -1 or parent[c] in taken:
                chosen.append(c)
                taken.add(c)
        chosen.sort(key=lambda c: (level[c], -score[c], c))
        new_index = {c: i for i, c in enumerate(chosen)}
        return _Tree([tokens[c] for c in chosen], [new_index.get(parent[c], -1) for c in chosen],
                     [level[c] for c in chosen], [score[c] for c in chosen])

    # ---- verification -------------------------------------------------------------------------
    @staticmethod
    def _tree_mask(tree: _Tree, dev: Any) -> torch.Tensor:
        n = len(tree.tokens) + 1
        mask = torch.zeros(n, n, dtype=torch.bool, device=dev)
        mask[:, 0] = True
        for i in range(1, n):
            j = i
            while j > 0:
                mask[i, j] = True
                j = tree.parent[j - 1] + 1
        return mask

    def _accept(self, logits: torch.Tensor, tree: _Tree, temperature: float,
                gen: torch.Generator | None) -> tuple[list[int], int]:
        """Rows of the accepted path (0 = root, then tree rows) and the bonus token."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parent):  # rows are i + 1, already in descending score per level
            children.setdefault(p + 1, []).append(i + 1)
        path, row = [0], 0
        while True:
            kids = children.get(row, [])
            if temperature == 0:
                y = int(torch.argmax(logits[row]))
                nxt = next((c for c in kids if tree.tokens[c - 1] == y), None)
                if nxt is None:
                    return path, y
            else:
                p = torch.softmax(logits[row].double().cpu() / temperature, dim=-1)  # the generator is on the CPU
                nxt = None
                for c in sorted(kids, key=lambda c: -tree.score[c - 1]):
                    x = tree.tokens[c - 1]
                    px = float(p[x])
                    if px > 0 and float(torch.rand((), generator=gen, dtype=torch.float64)) < px:
                        nxt = c
                        break
                    p[x] = 0.0
                    total = float(p.sum())
                    if total <= 0:  # cannot happen unless every token was drafted and rejected
                        break
                    p = p / total
                if nxt is None:
                    return path, int(torch.multinomial(p, 1, generator=gen))
            path.append(nxt)
            row = nxt

    # ---- the loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids: Any, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (1D ids, or [1, T])."""
        check_decode_settings(max_new_tokens, temperature)
        t0 = time.perf_counter()
        ids = _as_ids(input_ids, self.target.device)
        dev = ids.device
        gen = torch.Generator(device="cpu").manual_seed(seed) if temperature > 0 else None
        runner = _TargetRunner(self.target, self.head.config.layer_ids)
        self.dk = self.dv = None
        self.draft_steps = 0
        cycles, accepted, rechecks = [], [], 0
        try:
            n = len(ids)
            # the prefill exactly as HF computes it (its own causal masks, logits of the last row only)
            logits, feats = runner.forward(ids, torch.arange(n, device=dev), None, logits_rows=1)
            first = _sample(logits[-1].cpu(), temperature, gen)
            produced, done = _finish([first], [], self.eos, max_new_tokens)
            # target features f_0..f_{n-1} and the tokens that follow them x_1..x_n
            pend_feats, pend_next, start = feats, torch.cat([ids[1:], torch.tensor([first], device=dev)]), 0
            seq = torch.cat([ids, torch.tensor([first], device=dev)])
            while not done:
                m = len(seq) - 1  # root x_m; target cache covers 0..m-1
                root_logp, root_h = self._draft_extend(pend_feats, pend_next, start)
                tree = self._draft_tree(root_logp, root_h, m)
                vids = torch.tensor([int(seq[-1])] + tree.tokens, device=dev)
                vpos = m + torch.tensor([0] + tree.level, device=dev)
                logits, feats = runner.forward(vids, vpos, self._tree_mask(tree, dev))
                path, bonus = self._accept(logits, tree, temperature, gen)
                did, new_feats = 0, None
                if temperature == 0 and self.tie_eps > 0:
                    path, bonus, new_feats, did = self._tie_replay(runner, logits, path, bonus, vids, seq, len(ids))
                    rechecks += did
                if new_feats is None:
                    rows = torch.tensor(path, device=dev)
                    runner.keep(m, rows)
                    new_feats = feats[rows]
                new_tokens = [int(vids[r]) for r in path[1:]] + [bonus]
                before = len(produced)
                produced, done = _finish(new_tokens, produced, self.eos, max_new_tokens)
                cycles.append(len(produced) - before)
                cycles.extend([0] * did)  # a re-check forward commits no extra token but counts as a forward
                accepted.append(len(path) - 1)
                seq = torch.cat([seq, torch.tensor(new_tokens, device=dev)])
                pend_feats, pend_next, start = new_feats, torch.tensor(new_tokens, device=dev), m
            forwards = runner.forwards
        finally:
            runner.close()
            self.dk = self.dv = None
        return DecodeResult(f"eagle3-{'chain' if self.tree.is_chain else 'tree'}", produced,
                            time.perf_counter() - t0, forwards, cycles, accepted, self.draft_steps, rechecks,
                            prompt_tokens=len(ids),
                            stopped="eos" if produced and produced[-1] in self.eos else "max_new_tokens")

    def _tie_replay(self, runner: _TargetRunner, logits: torch.Tensor, path: list[int], bonus: int,
                    vids: torch.Tensor, seq: torch.Tensor, n_prompt: int):
        """At T=0, find the first path row whose top-2 logit gap is below ``tie_eps``. There the
        verify forward's decision is not trusted: every generated token up to that row is re-run
        one at a time the way HF decodes (its own masks, one row), over the prompt's cache rows
        (computed by an HF-identical prefill), and the token after the row is that forward's argmax.
        Returns the path cut at the row, the decided token, the features of the new positions and
        the number of extra forwards (0 and ``None`` features when there is no near tie)."""
        for i, r in enumerate(path):
            top2 = logits[r].topk(2).values
            if float(top2[0] - top2[1]) >= self.tie_eps:
                continue
            dev = vids.device
            replay = torch.cat([seq[n_prompt:], vids[torch.tensor(path[1 : i + 1], dtype=torch.long, device=dev)]])
            runner.keep(n_prompt, torch.zeros(0, dtype=torch.long, device=dev))
            feats = []
            for j, tok in enumerate(replay):
                lg, f = runner.forward(tok.view(1), torch.tensor([n_prompt + j], device=dev), None)
                feats.append(f)
            new_feats = torch.cat(feats[-(i + 1):]) if feats[0] is not None else None
            return path[: i + 1], int(torch.argmax(lg[0])), new_feats, len(replay)
        return path, bonus, None, 0


def speculative_generate(target: Any, head: DraftHead, input_ids: Any, max_new_tokens: int, *,
                         mode: str = "chain", draft_len: int = 4, depth: int = 5, top_k: int = 4,
                         total_tokens: int = 16, temperature: float = 0.0, seed: int = 0,
                         tie_eps: float = DEFAULT_TIE_EPS) -> DecodeResult:
    """One-call form of :class:`SpeculativeDecoder` (see there)."""
    tree = make_tree(mode, draft_len=draft_len, depth=depth, top_k=top_k, total_tokens=total_tokens)
    return SpeculativeDecoder(target, head, tree, tie_eps=tie_eps).generate(input_ids, max_new_tokens, temperature, seed)


__all__ = [
    "DEFAULT_TIE_EPS", "DecodeError", "DecodeResult", "SpeculativeDecoder", "TreeSpec", "check_decode_settings",
    "check_tree", "eos_ids",
    "greedy_generate", "hf_generate", "make_tree", "speculative_generate",
]
