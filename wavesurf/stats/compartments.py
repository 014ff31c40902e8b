"""Contiguous "compartments" of depth: runs of consecutive layers that are similar by CKA.

Rule: with dissimilarity ``D_ij = 1 - CKA_ij``, a segmentation of layers ``0..L-1`` into contiguous
blocks costs ``sum_blocks (1/|b|) sum_{i, j in b} D_ij`` = ``sum_i (1 - mean_{j in b(i)} CKA_ij)``:
every layer pays one minus its mean CKA with its own block (diagonal included). This is the k-means
within-block sum of squares when ``D`` is read as a squared distance; the ``1/|b|`` keeps it from
favouring equal-sized blocks (the plain pairwise sum splits a 9+2 structure as 7+4). For a fixed
number of blocks K, dynamic programming over split points gives the exact minimum.

When K is not given it is chosen by the mean silhouette (Rousseeuw 1987) of the optimal segmentation
for each K = 2..max_blocks: for layer i, ``a`` = mean D to the other layers of its block, ``b`` = the
smallest mean D to another block, ``s_i = (b - a) / max(a, b)`` (0 for one-layer blocks); the K with
the largest mean ``s`` wins (ties: smaller K). One block is returned when all layers are alike
(optimal one-block cost ~0) or when no K reaches a positive mean silhouette.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from wavesurf.errors import StatsError


def _dissimilarity(cka: Any) -> np.ndarray:
    K = np.asarray(cka, dtype=np.float64)
    if K.ndim != 2 or K.shape[0] != K.shape[1] or K.shape[0] == 0:
        raise StatsError(f"cka must be a non-empty square matrix, got shape {K.shape}")
    if not np.all(np.isfinite(K)):
        raise StatsError(f"cka has {int((~np.isfinite(K)).sum())} non-finite entries; compartments need a finite matrix")
    return 1.0 - 0.5 * (K + K.T)


def _block_costs(D: np.ndarray) -> np.ndarray:
    """``W[a, b]`` = sum of D over the square block a..b (inclusive) / its size; inf for a > b."""
    L = D.shape[0]
    P = np.zeros((L + 1, L + 1))
    P[1:, 1:] = D.cumsum(axis=0).cumsum(axis=1)
    a = np.arange(L)[:, None]
    b = np.arange(L)[None, :]
    W = (P[b + 1, b + 1] - P[a, b + 1] - P[b + 1, a] + P[a, a]) / np.maximum(b - a + 1, 1)
    W[a > b] = np.inf
    return W


def _optimal(D: np.ndarray, k_max: int) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """Optimal cost and segmentation for K = 1..k_max (exact DP, O(k_max L^2))."""
    L = D.shape[0]
    W = _block_costs(D)
    F = np.full((k_max + 1, L + 1), np.inf)  # F[K, j]: first j layers in K blocks
    arg = np.zeros((k_max + 1, L + 1), dtype=np.int64)
    F[1, 1:] = W[0, :]
    for K in range(2, k_max + 1):
        for j in range(K, L + 1):
            i = np.arange(K - 1, j)  # last block is i..j-1
            cand = F[K - 1, i] + W[i, j - 1]
            best = int(np.argmin(cand))
            F[K, j] = cand[best]
            arg[K, j] = i[best]
    costs = F[1:, L].copy()
    segs: list[list[tuple[int, int]]] = []
    for K in range(1, k_max + 1):
        blocks: list[tuple[int, int]] = []
        j = L
        for k in range(K, 1, -1):
            i = int(arg[k, j])
            blocks.append((i, j - 1))
            j = i
        blocks.append((0, j - 1))
        segs.append(blocks[::-1])
    return costs, segs


def compartment_costs(cka: Any, max_blocks: int = 8) -> np.ndarray:
    """Optimal segmentation cost ``c_K`` for K = 1..min(max_blocks, L) (see module docstring)."""
    D = _dissimilarity(cka)
    k_max = min(int(max_blocks), D.shape[0])
    if k_max < 1:
        raise StatsError(f"max_blocks must be >= 1, got {max_blocks}")
    return _optimal(D, k_max)[0]


def compartments(cka: Any, n_blocks: int | None = None, max_blocks: int = 8) -> list[tuple[int, int]]:
    """Optimal contiguous segmentation of layers (indices into ``cka``) into blocks of similar layers.

    Returns inclusive ``(first, last)`` index ranges covering ``0..L-1`` in order. ``n_blocks`` fixes
    the number of blocks; otherwise it is chosen in ``1..max_blocks`` by the mean silhouette (module
    docstring).
    """
    D = _dissimilarity(cka)
    L = D.shape[0]
    if n_blocks is not None:
        K = int(n_blocks)
        if not 1 <= K <= L:
            raise StatsError(f"n_blocks must be between 1 and the number of layers {L}, got {n_blocks}")
        return _optimal(D, K)[1][K - 1]
    if int(max_blocks) < 1:
        raise StatsError(f"max_blocks must be >= 1, got {max_blocks}")
    k_max = min(int(max_blocks), L)
    costs, segs = _optimal(D, k_max)
    if k_max == 1 or costs[0] <= 1e-12 * L:
        return segs[0]
    scores = [_silhouette(D, segs[K - 1]) for K in range(2, k_max + 1)]
    best = int(np.argmax(scores))
    if scores[best] <= 0.0:
        return segs[0]
    return segs[best + 1]


def compartment_of(layer_id: int, blocks: Sequence[tuple[int, int]]) -> int:
    """0-based index of the compartment of ``blocks`` (inclusive ``(first, last)`` ranges, as
    :func:`compartments` returns them) that holds ``layer_id``."""
    for k, (lo, hi) in enumerate(blocks):
        if int(lo) <= int(layer_id) <= int(hi):
            return k
    raise StatsError(f"layer id {layer_id!r} is in none of the compartments {list(blocks)}")


def compartment_label(layer_id: int, blocks: Sequence[tuple[int, int]]) -> str:
    """``"C2"``: the book's name of the compartment holding ``layer_id`` (C1 starts at depth 0)."""
    return f"C{compartment_of(layer_id, blocks) + 1}"


def mean_silhouette(cka: Any, seg: Sequence[tuple[int, int]]) -> float:
    """Mean silhouette (in [-1, 1]) of a segmentation under ``1 - CKA``; one-layer blocks score 0."""
    return _silhouette(_dissimilarity(cka), seg)


def _silhouette(D: np.ndarray, seg: Sequence[tuple[int, int]]) -> float:
    L = D.shape[0]
    labels = _labels(seg, L, "segmentation")
    K = len(seg)
    if K < 2:
        return 0.0
    sizes = np.array([b - a + 1 for a, b in seg], dtype=np.float64)
    sums = np.stack([D[:, a : b + 1].sum(axis=1) for a, b in seg], axis=1)  # [L, K]
    own = sizes[labels]
    a = np.where(own > 1, (sums[np.arange(L), labels] - np.diag(D)) / np.maximum(own - 1, 1), 0.0)
    mean_to = sums / sizes[None, :]
    mean_to[np.arange(L), labels] = np.inf
    b = mean_to.min(axis=1)
    denom = np.maximum(a, b)
    s = np.where((own > 1) & (denom > 0), (b - a) / np.where(denom > 0, denom, 1.0), 0.0)
    return float(s.mean())


def _labels(seg: Sequence[tuple[int, int]], n: int, name: str) -> np.ndarray:
    labels = np.full(n, -1, dtype=np.int64)
    expect = 0
    for k, blk in enumerate(seg):
        try:
            a, b = int(blk[0]), int(blk[1])
        except (TypeError, ValueError, IndexError):
            raise StatsError(f"{name}: blocks must be (first, last) pairs, got {blk!r}") from None
        if a != expect or b < a or b >= n:
            raise StatsError(
                f"{name}: blocks must be contiguous inclusive ranges covering 0..{n - 1} in order, got {list(seg)}"
            )
        labels[a : b + 1] = k
        expect = b + 1
    if expect != n:
        raise StatsError(f"{name}: blocks cover 0..{expect - 1}, expected 0..{n - 1}")
    return labels


def compartment_stability(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]], n: int) -> float:
    """Rand index of two segmentations of ``n`` layers: the fraction of layer pairs (i < j) on which
    both agree whether i and j are in the same block. 1 = identical; 1.0 when n < 2."""
    la, lb = _labels(a, n, "a"), _labels(b, n, "b")
    if n < 2:
        return 1.0
    same_a = la[:, None] == la[None, :]
    same_b = lb[:, None] == lb[None, :]
    iu = np.triu_indices(n, k=1)
    return float(np.mean(same_a[iu] == same_b[iu]))
