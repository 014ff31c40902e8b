"""Start an EAGLE-3 head as an induction (copy) head, so that a CPU-sized budget starts from a
drafter that already drafts.

Why: the target's greedy answers repeat themselves (a small model loops, and a later turn often
repeats an earlier answer), so "the token that followed the last occurrence of the current token"
is a strong draft: n-gram lookup over the conversation reaches chain tau ~1.9 at draft length 4 on
the held-out answers of SmolLM2-135M, while a randomly initialised head trained on 36k tokens
reaches ~1.1 (its attention never learns to find the earlier occurrence in ~40 optimizer steps).

One decoder layer can copy because of how EAGLE-3 pairs its inputs: at position s the head sees
the target's streams after reading token x_s (``f_s``) and the embedding of x_{s+1}. So:

* ``fc`` passes the lowest selected stream through (plus a small random mix of the others): at a
  low layer that stream still says which token x_s is;
* keys read ``hidden_norm(f_s)`` through ``key_map``, a least-squares map fitted on the training
  store from that normalised feature to the normalised embedding of x_s;
* queries read the embedding of x_{t+1} through the same random orthonormal projection, placed
  in the rotary dimensions that turn by less than ``max_angle`` over ``max_distance`` positions
  (so the match does not depend on how far back the occurrence is);
* values carry the embedding of x_{s+1}, and ``o_proj`` writes it back, large against ``f``;
* ``lm_head``/``norm`` start from the target's unembedding (``init_from_target``), which turns
  the copied embedding into the logit of its token.

Only the initial weights change: the architecture is EAGLE-3's, so export and serving are
unaffected. The README of commit 111d6ab ("Drafter training options") has what it measured.
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import DrafterError
from .head import DraftHead, rope_frequencies


def slow_rotary_dims(head_dim: int, rope_theta: float, max_distance: int = 400, max_angle: float = 0.5) -> list[int]:
    """Dimensions of a rotate-half rotary head whose pair turns by at most ``max_angle`` radians
    over ``max_distance`` positions (both halves of each such pair)."""
    half = head_dim // 2
    inv = rope_frequencies(head_dim, rope_theta, dtype=torch.float64)
    pairs = [i for i in range(half) if float(inv[i]) * max_distance <= max_angle]
    return pairs + [i + half for i in pairs]


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation as the head's norms apply it at initialisation (weights one, the head's eps)."""
    return x * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def fit_key_map(head: DraftHead, batches: Any, embed: Any, max_batches: int = 8, ridge: float = 1e-2) -> tuple[torch.Tensor, float]:
    """Ridge least squares ``M`` [H, H] with ``norm(embed(x_s)) ~ M norm(fc(f_s))`` over the real
    positions of up to ``max_batches`` feature batches. Returns ``M`` and the fraction of the
    embedding's variance it explains (R^2): how well the fused feature still names its token."""
    xs, ys = [], []
    eps = head.config.rms_norm_eps
    with torch.no_grad():
        for i in range(min(max_batches, len(batches))):
            b = batches[i]
            real = b["attention_mask"]
            xs.append(_normalised(head.fuse(b["features"].to(head.fc.weight.device))[real], eps).double())
            ys.append(_normalised(embed(b["input_ids"].to(head.fc.weight.device))[real], eps).double())
    if not xs:
        raise DrafterError("the feature store has no batches to fit the induction key map on")
    x, y = torch.cat(xs), torch.cat(ys)
    gram = x.T @ x + ridge * x.shape[0] * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    m = torch.linalg.solve(gram, x.T @ y).T
    r2 = 1.0 - float(((y - x @ m.T) ** 2).sum() / (y**2).sum())
    return m.float(), r2


def induction_init(
    head: DraftHead,
    batches: Any,
    embed: Any,
    *,
    seed: int = 0,
    query_scale: float = 2.0,
    output_scale: float = 10.0,
    fc_scale: float = 0.02,
    fc_lowest: float = 0.1,
    max_distance: int = 400,
) -> float:
    """Rewrite ``fc`` and the attention of a head (already ``init_head``-ed, vocabulary set) as
    an induction head (module docstring); returns the key map's R^2. ``batches`` are the training
    store's feature batches, ``embed`` the target's input embedding."""
    c = head.config
    if c.hidden_size != c.target_hidden_size:
        raise DrafterError(f"induction init needs the head as wide as the target ({c.hidden_size} != {c.target_hidden_size})")
    hidden, hd, n_heads, n_kv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    dims = slow_rotary_dims(hd, c.rope_theta, max_distance)
    if not dims:
        raise DrafterError(f"no rotary dimension of this head turns slowly enough over {max_distance} positions")
    gen = torch.Generator().manual_seed(10_007 + seed)
    attn = head.midlayer.self_attn
    with torch.no_grad():
        head.fc.weight.mul_(fc_scale)
        head.fc.weight[:, :hidden] += fc_lowest * torch.eye(hidden, device=head.fc.weight.device)  # lowest stream first
        key_map, r2 = fit_key_map(head, batches, embed)
        q, k, v, o = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight)
        q.mul_(0.5)
        k.mul_(0.5)
        v.zero_()
        o.zero_()
        rep = n_heads // n_kv
        for g in range(n_kv):
            match = torch.linalg.qr(torch.randn(hidden, len(dims), generator=gen))[0].T.to(q)  # [d, H]
            carry = torch.linalg.qr(torch.randn(hidden, hd, generator=gen))[0].T.to(q)  # [hd, H]
            k[[g * hd + d for d in dims], hidden:] = query_scale * (match @ key_map.to(q))
            v[g * hd:(g + 1) * hd, :hidden] = carry
            for r in range(rep):
                h = g * rep + r
                q[[h * hd + d for d in dims], :hidden] = query_scale * match
                o[:, h * hd:(h + 1) * hd] = output_scale * carry.T / rep
    return r2


__all__ = ["fit_key_map", "induction_init", "slow_rotary_dims"]
