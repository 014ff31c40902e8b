"""Matrix (Rényi) entropy of layer covariances, in nats (natural log).

Why: the trace-normalised covariance of centred token vectors has the same non-zero spectrum as the
trace-normalised token Gram matrix, so its Rényi entropy measures how many directions the layer spreads
tokens over (``exp(S_1)`` is the effective rank, ``exp(S_2)`` the participation ratio) at a cost
independent of the number of tokens. The aggregate entropy of a layer set is the same entropy of the
concatenated features after scaling each layer to unit trace; for alpha=2 it has a closed form in the
layers' purities and pairwise linear CKA, cheap enough to score every k-subset of layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from wavesurf.errors import StatsError
from wavesurf.stats.moments import LayerMoments

# Eigenvalues below this fraction of the largest are treated as round-off zeros.
EIG_RELATIVE_CUTOFF = 1e-12


def _check_alpha(alpha: Any) -> float:
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise StatsError(f"alpha must be a number > 0 (or inf), got {alpha!r}") from None
    if not a > 0:  # also rejects NaN
        raise StatsError(f"alpha must be > 0, got {alpha!r}")
    return a


def _as_numpy64(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _as_square_torch(cov: Any, what: str = "cov") -> torch.Tensor:
    C = cov.detach().to(torch.float64) if isinstance(cov, torch.Tensor) else torch.as_tensor(np.asarray(cov, dtype=np.float64))
    if C.dim() != 2 or C.shape[0] != C.shape[1] or C.shape[0] == 0:
        raise StatsError(f"{what} must be a non-empty square matrix, got shape {tuple(C.shape)}")
    if not bool(torch.isfinite(C).all()):
        raise StatsError(f"{what} has {int((~torch.isfinite(C)).sum())} non-finite entries")
    return C


def _eigvalsh(C: torch.Tensor) -> np.ndarray:
    """Eigenvalues of the symmetric part of ``C`` in float64."""
    return torch.linalg.eigvalsh(0.5 * (C + C.T)).cpu().numpy()


def renyi_entropy(eigenvalues: Any, alpha: float = 1.0) -> float:
    """Rényi entropy (nats) of the trace-normalised spectrum of a PSD matrix.

    Eigenvalues below ``max * 1e-12`` (including round-off negatives) are set to 0, the rest are
    normalised to sum 1: alpha=1 gives von Neumann ``-sum p log p``, alpha=inf gives ``-log max p``,
    other alpha > 0 give ``log(sum p^alpha) / (1 - alpha)``. An all-zero spectrum has entropy 0.
    """
    a = _check_alpha(alpha)
    lam = _as_numpy64(eigenvalues).ravel()
    if lam.size == 0:
        raise StatsError("eigenvalues is empty")
    if not np.all(np.isfinite(lam)):
        raise StatsError(f"eigenvalues contain {int((~np.isfinite(lam)).sum())} non-finite values")
    lmax = float(lam.max())
    if lmax <= 0.0:
        return 0.0
    lam = lam[lam >= lmax * EIG_RELATIVE_CUTOFF]
    p = lam / lam.sum()
    if a == 1.0:
        return float(-(p * np.log(p)).sum())
    pmax = float(p.max())
    if math.isinf(a):
        return float(-math.log(pmax))
    # log sum p^a = a log pmax + log sum (p/pmax)^a : no underflow for large alpha
    log_sum = a * math.log(pmax) + math.log(float(np.sum((p / pmax) ** a)))
    return float(log_sum / (1.0 - a))


def max_entropy(n_tokens: int | None, dim: int) -> float:
    """Largest possible matrix entropy (nats): ``log r`` with the rank bound ``r = min(n - 1, d)``
    (centred n x d data), or ``log d`` without ``n``; 0 when r <= 1."""
    r = dim if n_tokens is None else min(int(n_tokens) - 1, dim)
    return math.log(r) if r > 1 else 0.0


def matrix_entropy(cov: Any, alpha: float = 1.0, normalize: bool = False, n_tokens: int | None = None) -> float:
    """Rényi entropy (nats) of ``cov / tr(cov)`` from a float64 ``eigvalsh``.

    ``normalize=True`` divides by the largest possible value ``log(r)``, with the rank bound
    ``r = min(n_tokens - 1, d)`` when ``n_tokens`` is given (centred data has rank <= n-1), else ``d``;
    the result is then in [0, 1] (0 when r <= 1).
    """
    _check_alpha(alpha)
    C = _as_square_torch(cov)
    S = renyi_entropy(_eigvalsh(C), alpha)
    if not normalize:
        return S
    top = max_entropy(n_tokens, C.shape[0])
    return S / top if top > 0 else 0.0


def effective_rank(entropy: float | np.ndarray) -> float | np.ndarray:
    """``exp(entropy)``: the number of equally-weighted directions with the same entropy."""
    return np.exp(entropy)


def layer_entropies(moments: LayerMoments, alpha: float = 1.0, normalize: bool = False) -> dict[int, float]:
    """Matrix entropy (nats, or normalised to [0, 1]) of every accumulated layer, keyed by layer id."""
    _check_alpha(alpha)
    return {
        lid: matrix_entropy(moments.covariance(lid), alpha, normalize=normalize, n_tokens=moments.n)
        for lid in moments.layer_ids
    }


def purity(cov: Any) -> float:
    """``||C / tr C||_F^2 = sum_i p_i^2`` (``exp(-S_2)``); 1 for rank one, 1/d for isotropic."""
    C = _as_square_torch(cov)
    tr = float(torch.trace(C))
    if not tr > 0:
        raise StatsError(f"purity needs a covariance with positive trace, got trace {tr}")
    return float((C * C).sum()) / tr**2


def _check_layer_set(moments: LayerMoments, layer_ids: Sequence[int]) -> list[int]:
    ids = [int(x) for x in layer_ids]
    if not ids:
        raise StatsError("layer_ids is empty; give at least one layer")
    for lid in ids:
        moments._index(lid)  # raises for unknown ids
    if len(ids) > 1 and not moments.pairs:
        raise StatsError(f"aggregate statistics of layers {ids} need a LayerMoments with pairs=True")
    return ids


def _traces(moments: LayerMoments, ids: list[int]) -> dict[int, float]:
    out = {}
    for lid in set(ids):
        t = float(torch.trace(moments.covariance(lid)))
        if not t > 0:
            raise StatsError(f"layer {lid} has zero variance (trace {t}); its unit-trace scaling is undefined")
        out[lid] = t
    return out


def aggregate_covariance(moments: LayerMoments, layer_ids: Sequence[int]) -> torch.Tensor:
    """Covariance of the concatenated features of ``layer_ids``, each layer scaled to trace 1/k.

    Block (a, b) is ``C_ab / sqrt(tr C_aa tr C_bb) / k``, so the total trace is 1. Float64
    ``[k*d, k*d]``.
    """
    ids = _check_layer_set(moments, layer_ids)
    k, d = len(ids), moments.dim
    tr = _traces(moments, ids)
    A = torch.empty(k * d, k * d, dtype=torch.float64, device=moments.device)
    for a, la in enumerate(ids):
        for b in range(a, k):
            lb = ids[b]
            blk = moments.covariance(la, lb) / (math.sqrt(tr[la] * tr[lb]) * k)
            A[a * d : (a + 1) * d, b * d : (b + 1) * d] = blk
            if b != a:
                A[b * d : (b + 1) * d, a * d : (a + 1) * d] = blk.T
    return A


def aggregate_entropy(moments: LayerMoments, layer_ids: Sequence[int], alpha: float = 1.0) -> float:
    """Rényi entropy (nats) of ``aggregate_covariance`` (exact, via ``eigvalsh`` of the ``k*d`` matrix)."""
    _check_alpha(alpha)
    return renyi_entropy(_eigvalsh(aggregate_covariance(moments, layer_ids)), alpha)


def redundancy(moments: LayerMoments, layer_ids: Sequence[int], alpha: float = 1.0) -> float:
    """Entropy (nats) lost to linear correlation between layers: ``S(pinched) - S(joint) >= 0``.

    The pinched matrix keeps only the diagonal blocks ``C_ii / (k tr C_ii)`` of the aggregate matrix;
    its spectrum is the union of the blocks' spectra (for alpha=1 its entropy is
    ``log k + mean_i S(rho_i)``). Zero iff all cross-covariances vanish. For alpha=1 it is the
    relative entropy ``D(C || pinch(C))``; for any alpha it is >= 0 by majorisation.
    Round-off negatives above -1e-10 are returned as 0.
    """
    a = _check_alpha(alpha)
    ids = _check_layer_set(moments, layer_ids)
    k = len(ids)
    tr = _traces(moments, ids)
    eigs = [_eigvalsh(moments.covariance(lid) / (k * tr[lid])) for lid in ids]
    pinched = renyi_entropy(np.concatenate(eigs), a)
    joint = aggregate_entropy(moments, ids, a)
    r = pinched - joint
    if -1e-10 < r < 0.0:
        r = 0.0
    return float(r)


def aggregate_entropy2_closed_form(purities: Any, cka: Any, subsets: Any) -> np.ndarray:
    """Alpha=2 aggregate entropy (nats) of many layer subsets at once, without eigendecompositions.

    For the unit-trace-scaled concatenation A (blocks ``C_ab / sqrt(t_a t_b) / k``, trace 1),
    ``S_2 = -log ||A||_F^2`` and ``||C_ab||_F^2 / (t_a t_b) = CKA_ab sqrt(P_a P_b)`` with purity
    ``P_a = ||C_aa||_F^2 / t_a^2``, hence
    ``S_2 = 2 log k - log(sum_a P_a + sum_{a != b} CKA_ab sqrt(P_a P_b))``.

    ``purities``: ``[L]``; ``cka``: ``[L, L]`` linear CKA; ``subsets``: ``[m, k]`` integer indices into
    ``0..L-1`` (a 1-D array is one subset). Returns ``[m]``.
    """
    P = np.asarray(purities, dtype=np.float64).ravel()
    K = np.asarray(cka, dtype=np.float64)
    L = P.size
    if K.shape != (L, L):
        raise StatsError(f"cka must be [{L}, {L}] to match {L} purities, got shape {K.shape}")
    if not (np.all(np.isfinite(P)) and np.all(P > 0)):
        raise StatsError("purities must be finite and > 0")
    sub = np.asarray(subsets)
    if sub.ndim == 1:
        sub = sub[None, :]
    if sub.ndim != 2 or sub.shape[1] == 0:
        raise StatsError(f"subsets must be [m, k] with k >= 1, got shape {sub.shape}")
    if not np.issubdtype(sub.dtype, np.integer):
        raise StatsError(f"subsets must hold integer indices, got dtype {sub.dtype}")
    if sub.size and (sub.min() < 0 or sub.max() >= L):
        raise StatsError(f"subset indices must lie in 0..{L - 1}, got range {sub.min()}..{sub.max()}")
    m, k = sub.shape
    Q = K * np.sqrt(np.outer(P, P))
    np.fill_diagonal(Q, P)
    total = np.empty(m, dtype=np.float64)
    step = max(1, 2**22 // (k * k))
    for s in range(0, m, step):
        blk = sub[s : s + step]
        total[s : s + step] = Q[blk[:, :, None], blk[:, None, :]].sum(axis=(1, 2))
    return 2.0 * math.log(k) - np.log(total)


def redundancy2_closed_form(purities: Any, cka: Any, subsets: Any) -> np.ndarray:
    """Alpha=2 redundancy (nats, >= 0) of many layer subsets at once: the block-diagonal alpha=2
    aggregate entropy (no cross terms) minus the joint one, both from
    :func:`aggregate_entropy2_closed_form` (same arguments); ``[m]``."""
    P = _as_numpy64(purities).ravel()
    return (aggregate_entropy2_closed_form(P, np.eye(len(P)), subsets)
            - aggregate_entropy2_closed_form(P, cka, subsets))
