"""Depth compartments: exact DP segmentation, automatic block count, stability."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from wavesurf.errors import StatsError
from wavesurf.stats import (compartment_costs, compartment_label, compartment_of, compartment_stability, compartments,
                            mean_silhouette)


def block_cka(sizes, within=0.9, between=0.2, noise=0.03, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(sizes)), sizes)
    K = np.where(labels[:, None] == labels[None, :], within, between)
    E = rng.uniform(-noise, noise, K.shape)
    K = np.clip(K + (E + E.T) / 2, 0, 1)
    np.fill_diagonal(K, 1.0)
    return K


def cost(D, seg):
    """The stated rule: sum over blocks of (1/|b|) sum_{i,j in b} (1 - CKA_ij)."""
    return sum(D[a : b + 1, a : b + 1].sum() / (b - a + 1) for a, b in seg)


def test_three_clear_blocks_found():
    K = block_cka([4, 7, 5])
    assert compartments(K) == [(0, 3), (4, 10), (11, 15)]
    assert compartments(block_cka([4, 7, 5], noise=0.0, within=1.0)) == [(0, 3), (4, 10), (11, 15)]
    assert compartments(block_cka([10, 3, 8, 10], seed=2)) == [(0, 9), (10, 12), (13, 20), (21, 30)]
    # unequal sizes are not pulled towards balanced blocks
    assert compartments(block_cka([9, 2], seed=4)) == [(0, 8), (9, 10)]
    assert compartments(block_cka([2, 2, 2], seed=5)) == [(0, 1), (2, 3), (4, 5)]
    # a fixed block count
    assert compartments(K, n_blocks=2) in ([(0, 3), (4, 15)], [(0, 10), (11, 15)])
    assert compartments(K, n_blocks=1) == [(0, 15)]
    assert len(compartments(K, n_blocks=16)) == 16
    costs = compartment_costs(K)
    assert costs.shape == (8,) and np.all(np.diff(costs) <= 1e-12)


def test_random_block_structures_are_recovered():
    rng = np.random.default_rng(0)
    for trial in range(60):
        sizes = [int(x) for x in rng.integers(2, 10, rng.integers(2, 7))]
        w = rng.uniform(0.6, 0.95)
        K = block_cka(sizes, within=w, between=w - rng.uniform(0.2, 0.4), noise=0.1, seed=trial)
        edges = np.cumsum([0, *sizes])
        truth = [(int(edges[i]), int(edges[i + 1] - 1)) for i in range(len(sizes))]
        assert compartments(K) == truth, sizes


def test_uniform_matrix_is_one_block():
    assert compartments(np.ones((6, 6))) == [(0, 5)]
    assert compartments(np.eye(1)) == [(0, 0)]
    # silhouette by hand: blocks {0,1},{2}; D01=0.1, D02=0.9, D12=0.7 -> s0=(0.9-0.1)/0.9, s1=(0.7-0.1)/0.7, s2=0
    K3 = 1 - np.array([[0, 0.1, 0.9], [0.1, 0, 0.7], [0.9, 0.7, 0]])
    assert mean_silhouette(K3, [(0, 1), (2, 2)]) == pytest.approx((0.8 / 0.9 + 0.6 / 0.7) / 3)
    flat = np.full((12, 12), 0.5)
    np.fill_diagonal(flat, 1.0)
    assert compartments(flat) == [(0, 11)]  # no K has a positive mean silhouette


def all_segmentations(L, K):
    for cuts in itertools.combinations(range(1, L), K - 1):
        edges = (0, *cuts, L)
        yield [(edges[i], edges[i + 1] - 1) for i in range(K)]


def test_dp_is_exact_against_brute_force():
    rng = np.random.default_rng(3)
    L = 9
    A = rng.uniform(0, 1, (L, L))
    K = (A + A.T) / 2
    np.fill_diagonal(K, 1)
    D = 1 - K
    for nb in range(1, 6):
        best = min(cost(D, s) for s in all_segmentations(L, nb))
        got = compartments(K, n_blocks=nb)
        assert got[0][0] == 0 and got[-1][1] == L - 1 and len(got) == nb
        assert all(got[i][1] + 1 == got[i + 1][0] for i in range(nb - 1))
        assert cost(D, got) == pytest.approx(best, abs=1e-12)
        assert compartment_costs(K, max_blocks=5)[nb - 1] == pytest.approx(best, abs=1e-12)


def test_stability():
    seg = [(0, 3), (4, 10), (11, 15)]
    assert compartment_stability(seg, seg, 16) == 1.0
    # Rand index by hand: n=4, a = {0,1},{2,3}; b = {0},{1,2,3}
    # pairs: 01 s/d x, 02 d/d ok, 03 d/d ok, 12 d/s x, 13 d/s x, 23 s/s ok -> 3/6
    assert compartment_stability([(0, 1), (2, 3)], [(0, 0), (1, 3)], 4) == pytest.approx(0.5)
    assert compartment_stability([(0, 0)], [(0, 0)], 1) == 1.0
    with pytest.raises(StatsError, match="contiguous"):
        compartment_stability([(0, 1), (3, 3)], seg, 4)
    with pytest.raises(StatsError, match="cover"):
        compartment_stability([(0, 1)], [(0, 3)], 4)


def test_bad_input():
    with pytest.raises(StatsError, match="square"):
        compartments(np.ones((3, 4)))
    with pytest.raises(StatsError, match="non-finite"):
        compartments(np.full((3, 3), np.nan))
    with pytest.raises(StatsError, match="n_blocks"):
        compartments(np.ones((3, 3)), n_blocks=4)


def test_compartment_of_a_layer_id():
    blocks = [(0, 3), (4, 10), (11, 15)]
    assert [compartment_of(i, blocks) for i in (0, 3, 4, 15)] == [0, 0, 1, 2]
    assert [compartment_label(i, blocks) for i in (2, 8, 13)] == ["C1", "C2", "C3"]
    with pytest.raises(StatsError, match="layer id 16 is in none"):
        compartment_of(16, blocks)
