"""Matrix entropy (nats): definitions, streaming vs brute force, aggregate entropy, alpha=2 closed form."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from tests.stats.synthetic import fill
from tests.stats.synthetic import hard_layers as _hard_layers
from wavesurf.errors import StatsError
from wavesurf.stats import (
    LayerMoments,
    aggregate_covariance,
    aggregate_entropy,
    aggregate_entropy2_closed_form,
    effective_rank,
    layer_entropies,
    linear_cka_from_moments,
    matrix_entropy,
    purity,
    redundancy,
    renyi_entropy,
)

LAYERS = [1, 4, 6, 9]
D = 16


def hard_layers(n, layer_ids=LAYERS, seed=0):
    return _hard_layers(n, layer_ids, D, seed)


def ref_entropy(C: np.ndarray, alpha: float) -> float:
    """Independent reference: numpy eigvalsh, relative cut-off, plain Rényi formula."""
    lam = np.linalg.eigvalsh(C)
    lam = lam[lam > lam.max() * 1e-12]
    p = lam / lam.sum()
    if alpha == 1:
        return float(-np.sum(p * np.log(p)))
    if np.isinf(alpha):
        return float(-np.log(p.max()))
    return float(np.log(np.sum(p**alpha)) / (1 - alpha))


def brute_cov(x):
    xc = x - x.mean(0)
    return xc.T @ xc / (len(x) - 1)


# ----------------------------------------------------------------- definitions
def test_renyi_known_values():
    p = [0.5, 0.25, 0.25]
    assert renyi_entropy(p, 1) == pytest.approx(1.5 * math.log(2), rel=1e-14)
    assert renyi_entropy(p, 2) == pytest.approx(-math.log(0.375), rel=1e-14)
    assert renyi_entropy(p, 0.5) == pytest.approx(2 * math.log(sum(math.sqrt(q) for q in p)), rel=1e-14)
    assert renyi_entropy(p, math.inf) == pytest.approx(math.log(2), rel=1e-14)
    # scale-free (trace-normalised), tiny negatives from round-off are clipped
    assert renyi_entropy([2.0, 1.0, 1.0, -1e-17, 1e-20], 1) == pytest.approx(1.5 * math.log(2), rel=1e-14)
    for a in (0.5, 1, 2, 7.0, 1000.0, math.inf):
        assert renyi_entropy(np.ones(10), a) == pytest.approx(math.log(10), rel=1e-12)
    values = [renyi_entropy(np.arange(1.0, 20.0) ** 2, a) for a in (0.25, 0.5, 0.9, 1, 1.1, 2, 5, math.inf)]
    assert all(x >= y - 1e-12 for x, y in zip(values, values[1:]))  # non-increasing in alpha
    assert renyi_entropy(torch.tensor([0.0, 0.0]), 1) == 0.0
    assert effective_rank(math.log(7)) == pytest.approx(7)


@pytest.mark.parametrize("alpha", [0, -1, float("nan")])
def test_bad_alpha(alpha):
    with pytest.raises(StatsError, match="alpha must be > 0"):
        renyi_entropy([1.0, 2.0], alpha)
    with pytest.raises(StatsError, match="alpha must be > 0"):
        matrix_entropy(np.eye(3), alpha)


def test_isotropic_gaussian_entropy_close_to_log_d():
    d, n = 32, 20000
    x = np.random.default_rng(1).standard_normal((n, d))
    acc = LayerMoments([0], d, pairs=False)
    acc.update([torch.tensor(x)])
    S = layer_entropies(acc)[0]
    assert abs(S - math.log(d)) / math.log(d) < 0.01
    assert S < math.log(d)
    Sn = layer_entropies(acc, normalize=True)[0]
    assert Sn == pytest.approx(S / math.log(d)) and 0.99 < Sn <= 1.0
    assert matrix_entropy(acc.covariance(0), normalize=True, n_tokens=11) == pytest.approx(S / math.log(10))


def test_purity_is_exp_minus_s2():
    C = brute_cov(hard_layers(500)[1])
    assert purity(C) == pytest.approx(math.exp(-matrix_entropy(C, 2)), rel=1e-10)
    assert purity(np.eye(5)) == pytest.approx(0.2)


# ----------------------------------------------------------------- streaming vs brute force
@pytest.mark.parametrize("alpha", [1, 2, 0.5, math.inf])
def test_layer_entropies_match_bruteforce(alpha):
    data = hard_layers(3000)
    acc = fill(data)
    got = layer_entropies(acc, alpha)
    for lid, x in data.items():
        assert got[lid] == pytest.approx(ref_entropy(brute_cov(x), alpha), rel=1e-8)


def test_cosine_variant_entropy_matches_bruteforce():
    data = hard_layers(3000, seed=2)
    acc = fill(data, l2_normalize=True)
    for lid, x in data.items():
        xn = x / np.linalg.norm(x, axis=1, keepdims=True)
        assert layer_entropies(acc)[lid] == pytest.approx(ref_entropy(brute_cov(xn), 1), rel=1e-8)


def brute_aggregate(data, ids):
    k = len(ids)
    parts = [data[i] / math.sqrt(np.trace(brute_cov(data[i])) * k) for i in ids]
    return brute_cov(np.concatenate(parts, axis=1))


@pytest.mark.parametrize("alpha", [1, 2, 0.5])
def test_aggregate_entropy_matches_bruteforce(alpha):
    data = hard_layers(3000, seed=3)
    acc = fill(data)
    for ids in ([1], [4, 9], [1, 6, 9], LAYERS):
        A = brute_aggregate(data, ids)
        assert np.trace(A) == pytest.approx(1.0)
        got = aggregate_covariance(acc, ids).numpy()
        assert np.max(np.abs(got - A)) / np.max(np.abs(A)) < 1e-8
        assert aggregate_entropy(acc, ids, alpha) == pytest.approx(ref_entropy(A, alpha), rel=1e-8)


def test_aggregate_bounds_and_redundancy():
    data = hard_layers(3000, seed=4)
    acc = fill(data)
    single = layer_entropies(acc)
    for ids in ([1, 4], [1, 6, 9], LAYERS):
        k = len(ids)
        mean = np.mean([single[i] for i in ids])
        S = aggregate_entropy(acc, ids)
        assert mean <= S <= mean + math.log(k)
        R = redundancy(acc, ids)
        assert R > 0.01  # these layers are strongly correlated
        # alpha=1 pinched entropy = log k + mean S(rho_i)
        assert R + S == pytest.approx(math.log(k) + mean, rel=1e-10)
        for alpha in (0.5, 2):
            assert redundancy(acc, ids, alpha) >= 0
    with pytest.raises(StatsError, match="pairs=True"):
        aggregate_entropy(fill(data, pairs=False), [1, 4])


def test_redundancy_of_independent_layers_is_near_zero():
    rng = np.random.default_rng(5)
    n, d = 40000, 8
    data = {i: rng.standard_normal((n, d)) * np.linspace(0.5, 1.5, d) + 1e3 for i in range(3)}
    acc = fill(data, sizes=(10000, 30000))
    R = redundancy(acc, [0, 1, 2])
    assert 0 <= R < 1e-3
    single = layer_entropies(acc)
    S = aggregate_entropy(acc, [0, 1, 2])
    assert S == pytest.approx(np.mean(list(single.values())) + math.log(3), abs=1e-3)


# ----------------------------------------------------------------- alpha=2 closed form
def test_alpha2_closed_form_equals_direct():
    data = hard_layers(3000, seed=6)
    acc = fill(data)
    P = np.array([purity(acc.covariance(i)) for i in LAYERS])
    cka = linear_cka_from_moments(acc)
    subsets = [(0,), (1, 3), (0, 2, 3), (0, 1, 2, 3), (3, 1)]
    for sub in subsets:
        direct = aggregate_entropy(acc, [LAYERS[i] for i in sub], alpha=2)
        closed = aggregate_entropy2_closed_form(P, cka, np.array([sub]))[0]
        assert closed == pytest.approx(direct, abs=1e-10, rel=1e-10)
    many = aggregate_entropy2_closed_form(P, cka, np.array(list(itertools.combinations(range(4), 2))))
    assert many.shape == (6,)
    with pytest.raises(StatsError, match="indices"):
        aggregate_entropy2_closed_form(P, cka, np.array([[0, 4]]))


def test_alpha2_closed_form_scores_all_subsets():
    rng = np.random.default_rng(7)
    L = 31
    P = rng.uniform(0.01, 0.5, L)
    F = rng.standard_normal((L, 5))
    cka = np.abs(np.corrcoef(F))
    subs3 = np.array(list(itertools.combinations(range(L), 3)))
    assert len(subs3) == 4495
    s3 = aggregate_entropy2_closed_form(P, cka, subs3)  # its speed is measured in benchmarks/stats_cost.py
    s31 = aggregate_entropy2_closed_form(P, cka, np.arange(L))
    assert s3.shape == (4495,) and s31.shape == (1,)
    # spot-check one subset against the formula written out
    i, j, k = subs3[1234]
    tot = P[i] + P[j] + P[k] + 2 * sum(cka[a, b] * math.sqrt(P[a] * P[b]) for a, b in ((i, j), (i, k), (j, k)))
    assert s3[1234] == pytest.approx(2 * math.log(3) - math.log(tot), rel=1e-12)
