"""Criteria against drafters: Spearman against a pairwise brute force, each criterion against its
definition on real statistics, and the correlation's interval on synthetic acceptance runs whose
relation to the criterion is known."""
from __future__ import annotations

import math

import numpy as np
import pytest

from wavesurf.criteria import CRITERIA, criteria_sentence, criteria_vs_tau, set_criteria, spearman
from wavesurf.drafter.acceptance import Acceptance
from wavesurf.errors import WavesurfError


def _spearman_brute(x, y) -> float:
    """Average ranks by counting (float64), then Pearson."""
    x, y = np.asarray(x, float), np.asarray(y, float)

    def ranks(v):
        return np.array([(v < a).sum() + 0.5 * ((v == a).sum() - 1) for a in v], dtype=np.float64)

    rx, ry = ranks(x), ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1])


@pytest.mark.parametrize("seed", range(5))
def test_spearman_equals_the_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, size=12).astype(float)  # ties
    y = x + rng.normal(0, 2, size=12)
    assert spearman(x, y) == pytest.approx(_spearman_brute(x, y), abs=1e-12)
    assert spearman(x, x * 3 + 1) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert math.isnan(spearman(np.ones(5), np.arange(5)))


def test_set_criteria_follow_their_definitions(small_stats):
    ids = [2, 15, 27]
    got = set_criteria(small_stats, ids)
    pos = [small_stats.layer_ids.index(i) for i in ids]
    cka = np.asarray(small_stats.cka, float)
    assert got["mean_entropy"] == pytest.approx(float(np.mean(np.asarray(small_stats.entropy)[pos])))
    assert got["mean_pairwise_cka"] == pytest.approx(np.mean([cka[pos[0], pos[1]], cka[pos[0], pos[2]], cka[pos[1], pos[2]]]))
    # redundancy by its closed form from purities P and CKA (book: methods-closed-form)
    purity = np.asarray(small_stats.purity, float)[pos]
    mass = purity.sum() + sum(cka[pos[a], pos[b]] * math.sqrt(purity[a] * purity[b])
                              for a in range(3) for b in range(3) if a != b)
    assert got["redundancy2"] == pytest.approx(math.log(mass) - math.log(purity.sum()), rel=1e-9)
    # a single layer's aggregate entropy is that layer's own alpha=2 entropy, its redundancy 0
    alone = set_criteria(small_stats, [15])
    assert alone["aggregate_entropy2"] == pytest.approx(float(np.asarray(small_stats.entropy2)[pos[1]]), rel=1e-6)
    assert alone["redundancy2"] == pytest.approx(0.0, abs=1e-12) and math.isnan(alone["mean_pairwise_cka"])
    assert math.isnan(got["probe_r2"])
    assert set(got) == set(CRITERIA)
    with pytest.raises(WavesurfError, match=r"layer ids \[99\]"):
        set_criteria(small_stats, [2, 99])


def _runs(tau_by_set, sequences=40, seeds=2, seed=0):
    """Acceptance runs of drafters with a given true tau: per sequence 20 cycles and a committed
    count drawn around 20 * tau (sequence noise), plus a per-seed offset (seed noise)."""
    rng = np.random.default_rng(seed)
    ids = [f"s/{i}" for i in range(sequences)]
    out = []
    for tau in tau_by_set:
        group = []
        for k in range(seeds):
            shift = rng.normal(0, 0.01)
            committed = np.maximum(20, np.round(20 * (tau + shift + rng.normal(0, 0.15, sequences)))).astype(np.int64)
            cycles = np.full(sequences, 20, dtype=np.int64)
            group.append(Acceptance("d", 1, ids, committed[:, None], cycles[:, None], np.zeros(1, np.int64),
                                    np.zeros(1, np.int64), 0, 0))
        out.append(group)
    return out


def test_a_criterion_that_orders_the_drafters_is_found_and_a_random_one_is_not():
    true_tau = np.linspace(1.1, 1.5, 12)
    runs = _runs(true_tau)
    rng = np.random.default_rng(1)
    criteria = [{"mean_entropy": t * 2 + 3, "mean_pairwise_cka": -t, "aggregate_entropy2": float(rng.normal()),
                 "redundancy2": float(rng.normal())} for t in true_tau]
    rows = {r["criterion"]: r for r in criteria_vs_tau(criteria, runs, 1, n_boot=400)}
    assert rows["mean_entropy"]["rho"] > 0.9 and rows["mean_entropy"]["rho_lo"] > 0.5
    assert rows["mean_entropy"]["agrees"] == "yes"
    assert rows["mean_pairwise_cka"]["agrees"] == "yes" and rows["mean_pairwise_cka"]["rho"] < -0.9  # expected sign -
    assert rows["aggregate_entropy2"]["rho_lo"] < rows["aggregate_entropy2"]["rho"] < rows["aggregate_entropy2"]["rho_hi"]
    assert rows["probe_r2"]["sets"] == 0 and rows["probe_r2"]["agrees"] == ""  # not given: no correlation
    text = criteria_sentence(list(rows.values()))
    assert "mean_entropy" in text and "12 trained layer sets" in text


def test_random_criteria_keep_their_interval_coverage():
    """A criterion unrelated to tau: the 90% interval covers rho = 0 in most of 30 draws."""
    covered = 0
    for rep in range(30):
        rng = np.random.default_rng(100 + rep)
        runs = _runs(np.linspace(1.1, 1.5, 10), seed=rep)
        criteria = [{"mean_entropy": float(rng.normal())} for _ in range(10)]
        row = next(r for r in criteria_vs_tau(criteria, runs, 1, n_boot=300, level=0.9, seed=rep)
                   if r["criterion"] == "mean_entropy")
        covered += row["rho_lo"] <= 0 <= row["rho_hi"]
    assert covered >= 24  # nominal 27 of 30; a broken interval (too narrow) fails


def test_refusals():
    runs = _runs([1.1, 1.2, 1.3, 1.4])
    with pytest.raises(WavesurfError, match="3 sets of criteria for 4 sets of runs"):
        criteria_vs_tau([{}] * 3, runs, 1)
    with pytest.raises(WavesurfError, match="level"):
        criteria_vs_tau([{}] * 4, runs, 1, level=1.5)
