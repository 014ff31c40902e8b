"""Intervals of offline τ that resample held-out sequences *and* training seeds, and their
simultaneous (max-T) version for a family of comparisons with the default set.

The coverage tests draw synthetic acceptance counts with a known seed and sequence variance: each
cycle of sequence s of drafter g trained with seed k commits ``1 + Binomial(D, p)`` tokens with
``p = p_g + a_gk (seed) + b_s (sequence) + u_gs (drafter x sequence)``, so the true τ of drafter g
(over seeds and sequences) is ``1 + D p_g`` and the true difference ``D (p_g - p_0)``. Seeds vary
as much as they must to matter: there the sequence-only interval (what the table used to print)
under-covers, and the two-level one does not.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from wavesurf.drafter.acceptance import Acceptance, bootstrap_tau
from wavesurf.drafter.intervals import basis, satterthwaite, t_critical, tau_intervals
from wavesurf.errors import AcceptanceError

D = 4  # draft length of the synthetic chains


def synthetic(rng, p, n_seeds, n_sequences, sd_seed=0.02, sd_seq=0.05, sd_set_seq=0.02):
    """committed, cycles ``[G, K, S]`` of drafters with per-cycle acceptance ``p`` (see the module)."""
    p = np.asarray(p, dtype=float)
    g = len(p)
    cycles = np.broadcast_to(rng.integers(10, 60, size=n_sequences), (g, n_seeds, n_sequences))
    prob = (p[:, None, None] + rng.normal(0, sd_seed, (g, n_seeds, 1)) + rng.normal(0, sd_seq, n_sequences)
            + rng.normal(0, sd_set_seq, (g, 1, n_sequences)))
    committed = cycles + rng.binomial(D * cycles, np.clip(prob, 0, 1))
    return committed, cycles.copy()


def _mc_bound(rate, reps):
    """``rate`` plus three Monte-Carlo standard errors of a rate measured over ``reps`` repetitions."""
    return rate + 3 * math.sqrt(rate * (1 - rate) / reps)


# ---- the pieces ----------------------------------------------------------------------------------
def _t_tail_brute(t: float, df: float) -> float:
    """P(T_df > t) by Simpson's rule on the density over [0, t] (float64, 20,000 panels)."""
    import math

    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    m = 20_000
    xs = np.linspace(0.0, t, m + 1)
    f = np.exp(log_c - (df + 1) / 2 * np.log1p(xs * xs / df))
    w = np.ones(m + 1)
    w[1:-1:2], w[2:-1:2] = 4, 2
    return 0.5 - float((w * f).sum() * (t / m) / 3)


def test_t_critical_matches_closed_forms_and_tables():
    alpha = np.array([0.2, 0.05, 0.01, 0.001, 1e-5])
    assert t_critical(alpha, 1) == pytest.approx(np.tan(np.pi / 2 * (1 - alpha)), rel=1e-9)  # Cauchy
    assert t_critical(alpha, 2) == pytest.approx(np.sqrt(2 / (alpha * (2 - alpha)) - 2), rel=1e-9)
    assert float(t_critical(0.05, 10)) == pytest.approx(2.2281, abs=1e-4)
    assert float(t_critical(0.05, np.inf)) == pytest.approx(1.959964, abs=1e-6)
    for df in (1.4, 3.7, 12.5, 250.0):  # non-integer degrees of freedom, as Satterthwaite's
        for a in (0.1, 0.05, 0.01):
            assert _t_tail_brute(float(t_critical(a, df)), df) == pytest.approx(a / 2, rel=1e-6)
    with pytest.raises(AcceptanceError, match="alpha"):
        t_critical(0.0, 5)
    with pytest.raises(AcceptanceError, match="df >= 1"):
        t_critical(0.05, 0.5)


def test_satterthwaite_lies_between_the_parts_degrees_of_freedom():
    assert satterthwaite(1.0, 0.0, 1, 39) == pytest.approx(1.0)  # seeds alone: K - 1
    assert satterthwaite(0.0, 1.0, 1, 39) == pytest.approx(39.0)  # sequences alone: S - 1
    assert 1.0 < float(satterthwaite(1.0, 1.0, 1, 39)) < 39.0
    assert np.isinf(satterthwaite(0.0, 0.0, 1, 39))


def test_refusals():
    rng = np.random.default_rng(0)
    c, n = synthetic(rng, [0.3, 0.3, 0.3], 2, 10)
    for bad in (0, 1, 1.5, -0.05, True, "0.95"):
        with pytest.raises(AcceptanceError, match="family_level"):
            tau_intervals(c, n, reference=0, family=[1, 2], family_level=bad)
        with pytest.raises(AcceptanceError, match="level"):
            tau_intervals(c, n, level=bad)
    with pytest.raises(AcceptanceError, match="at least 2 held-out sequences"):
        tau_intervals(c[:, :, :1], n[:, :, :1])
    with pytest.raises(AcceptanceError, match="other than the reference"):
        tau_intervals(c, n, reference=0, family=[0, 1])
    with pytest.raises(AcceptanceError, match="needs a reference"):
        tau_intervals(c, n, family=[1])
    with pytest.raises(AcceptanceError, match=r"\[drafters, seeds, sequences\]"):
        tau_intervals(c[0], n[0])
    with pytest.raises(AcceptanceError, match="n_boot"):
        tau_intervals(c, n, n_boot=10)


def _acc(name, committed, cycles):
    c, n = np.asarray(committed, dtype=np.int64)[:, None], np.asarray(cycles, dtype=np.int64)[:, None]
    return Acceptance(name, 1, [str(i) for i in range(len(c))], c, n, np.zeros(1, np.int64), np.ones(1, np.int64),
                      int(c.sum()), 0)


def test_one_seed_keeps_the_sequence_percentile_interval_and_says_so():
    """One training seed: nothing to say about seed variance, so the interval is the percentile
    interval over sequences, with exactly the numbers bootstrap_tau printed before seeds were
    resampled (same draws), and its basis says so."""
    rng = np.random.default_rng(3)
    c, n = synthetic(rng, [0.3, 0.32], 1, 25)
    a, b = _acc("a", c[1, 0], n[1, 0]), _acc("b", c[0, 0], n[0, 0])
    out = bootstrap_tau([a], 1, baseline=[b], n_boot=500)
    # the former computation, verbatim
    w = np.random.default_rng(0).multinomial(25, np.full(25, 1 / 25), size=500).astype(float)
    boot_a = (w @ a.committed[:, 0]) / np.maximum(w @ a.cycles[:, 0], 1)
    boot_b = (w @ b.committed[:, 0]) / np.maximum(w @ b.cycles[:, 0], 1)
    assert out["tau"] == a.tau(1)
    same = lambda x, boot: x == pytest.approx((np.quantile(boot, 0.025), np.quantile(boot, 0.975)), rel=1e-12)  # noqa: E731
    assert same((out["tau_lo"], out["tau_hi"]), boot_a)
    assert same((out["diff_lo"], out["diff_hi"]), boot_a - boot_b)
    assert out["seeds"] == 1 and out["sequences"] == 25 and out["tau_seed_std"] == 0.0 and out["diff_se_seed"] == 0.0
    assert basis(out["seeds"], out["sequences"]).startswith("sequences only (25 sequences; 1 seed")
    assert basis(2, 25) == "2 seeds x 25 sequences"
    assert all(math.isfinite(v) for v in out.values())  # no NaN anywhere for one seed
    # seeds are paired by index; a drafter may have fewer seeds than another (its first ones)
    uneven = bootstrap_tau([a, b], 1, baseline=[b])
    assert uneven["seeds"] == 2 and math.isfinite(uneven["diff_lo"])


def test_floors_identical_drafters_and_pooling():
    """A floor repeated once per seed has no seed variance and stays out of the pool; a drafter
    identical to the reference differs by exactly 0; the pooled seed spread estimates the true one."""
    rng = np.random.default_rng(5)
    c, n = synthetic(rng, [0.3] * 7, 3, 60, sd_seed=0.03)
    c[6] = c[6, :1]  # a floor: the same scores for every seed
    c[5] = c[0]  # the reference drafter again
    out = tau_intervals(c, n, reference=0, family=[1, 2, 3, 4, 5], n_boot=400)
    floor, same = out.rows[6], out.rows[5]
    assert floor["tau_seed_std"] == 0.0
    assert floor["tau_hi"] - floor["tau_lo"] < out.rows[1]["tau_hi"] - out.rows[1]["tau_lo"]
    assert same["diff"] == same["diff_lo"] == same["diff_hi"] == same["diff_fw_lo"] == same["diff_fw_hi"] == 0.0
    assert out.seed_df == 6 * 2  # six trained drafters (the reference's copy counts) x (K - 1)
    assert out.pooled_seed_std == pytest.approx(D * 0.03, rel=0.5)
    assert out.family["comparisons"] == 5 and out.family["crit"] > t_critical(0.05, np.inf)
    for r in out.rows[1:5]:  # simultaneous intervals contain the per-comparison ones
        assert r["diff_fw_lo"] <= r["diff_lo"] <= r["diff"] <= r["diff_hi"] <= r["diff_fw_hi"]
        assert r["diff_se"] == pytest.approx(math.hypot(r["diff_se_seed"], r["diff_se_seq"]))


def _drop_seeds(c, n, counts):
    """``c``/``n`` with drafter g's seeds from ``counts[g]`` on removed (NaN), as acceptance_arrays pads them."""
    c, n = c.astype(float), n.astype(float)
    for g, k in enumerate(counts):
        c[g, k:], n[g, k:] = np.nan, np.nan
    return c, n


def test_drafters_with_different_numbers_of_seeds():
    """Three seeds for the reference, two for some sets, one for random sets: every row says how
    many seeds it rests on; a one-seed head's interval carries the pooled seed variance (wider
    than its sequence-only one); dropping a seed never changes another drafter's point tau; a gap
    in a drafter's seeds is refused."""
    rng = np.random.default_rng(6)
    c, n = synthetic(rng, [0.3] * 5, 3, 40, sd_seed=0.04)
    c, n = _drop_seeds(c, n, [3, 3, 2, 1, 1])
    out = tau_intervals(c, n, reference=0, family=[1, 2, 3, 4], n_boot=400)
    assert [r["seeds"] for r in out.rows] == [3, 3, 2, 1, 1] and out.seeds_per_drafter == [3, 3, 2, 1, 1]
    assert out.seed_df == 2 + 2 + 1  # pooled over the drafters with 2+ seeds
    assert out.basis == "1-3 seeds x 40 sequences" and "pooled" in out.row_basis(3)
    for g, k in enumerate([3, 3, 2, 1, 1]):
        tau_k = (c[g, :k].sum(axis=1) / n[g, :k].sum(axis=1)).mean()
        assert out.rows[g]["tau"] == pytest.approx(tau_k)
    one = out.rows[3]
    assert one["tau_hi"] - one["tau_lo"] > one["tau_seq_hi"] - one["tau_seq_lo"]
    assert one["diff_se_seed"] == pytest.approx(out.pooled_seed_std * math.sqrt(1 + 1 / 3))
    # without pooling a one-seed head has no seed variance to add: sequences only, as labelled
    alone = tau_intervals(c, n, reference=0, n_boot=400, pool_seeds=False)
    assert alone.rows[3]["tau_lo"] == alone.rows[3]["tau_seq_lo"]
    gap = c.copy()
    gap[1, 1] = np.nan  # seeds 0 and 2 but not 1
    with pytest.raises(AcceptanceError, match="without gaps"):
        tau_intervals(gap, n, reference=0)


def test_uneven_seed_counts_keep_coverage_and_family_wise_error():
    """The long profile's design (3 seeds for the default and the primary set, 2 for the other
    sets, 1 for the random sets), seed variance large: two-level intervals of a one-seed set's
    difference with the default cover the truth at 90-99%, and the simultaneous intervals hold
    the family-wise error at 5% under the null."""
    reps, counts = 400, [3, 3, 2, 2, 1, 1, 1, 1]
    rng = np.random.default_rng(13)
    cover, fwe = 0, 0
    for r in range(reps):
        c, n = _drop_seeds(*synthetic(rng, [0.3] * len(counts), 3, 40), counts)
        out = tau_intervals(c, n, reference=0, family=range(1, len(counts)), n_boot=300, seed=r)
        cover += out.rows[5]["diff_lo"] <= 0.0 <= out.rows[5]["diff_hi"]
        fwe += any(x["diff_fw_lo"] > 0 or x["diff_fw_hi"] < 0 for x in out.rows[1:])
    print("uneven seeds: coverage", cover / reps, "family-wise error", fwe / reps)
    assert 0.90 <= cover / reps <= 0.99
    assert fwe / reps <= _mc_bound(0.05, reps)


# ---- coverage ------------------------------------------------------------------------------------
def test_two_level_intervals_cover_the_true_values_where_sequence_only_ones_do_not():
    """Two training seeds (the long profile's count), seed variance large against the sequence
    part: the two-level 95% intervals of τ and of the paired difference cover the truth at
    90-99%; the sequence-only interval of the difference covers it far less often."""
    reps, p = 500, [0.30, 0.32, 0.30, 0.31]
    rng = np.random.default_rng(11)
    hits = {"tau": 0, "diff": 0, "diff_seq": 0}
    for r in range(reps):
        c, n = synthetic(rng, p, 2, 30)
        out = tau_intervals(c, n, reference=0, family=[1, 2, 3], n_boot=300, seed=r)
        true_tau, true_diff = 1 + D * p[0], D * (p[1] - p[0])
        hits["tau"] += out.rows[0]["tau_lo"] <= true_tau <= out.rows[0]["tau_hi"]
        hits["diff"] += out.rows[1]["diff_lo"] <= true_diff <= out.rows[1]["diff_hi"]
        hits["diff_seq"] += out.rows[1]["diff_seq_lo"] <= true_diff <= out.rows[1]["diff_seq_hi"]
    cover = {k: v / reps for k, v in hits.items()}
    print("coverage at nominal 95%:", cover)
    assert 0.90 <= cover["tau"] <= 0.99 and 0.90 <= cover["diff"] <= 0.99
    assert cover["diff_seq"] < 0.80  # resampling sequences alone ignores the seeds' spread


def test_simultaneous_intervals_hold_the_family_wise_error_under_the_null():
    """Eight layer sets no better than the default, two seeds each: the max-T intervals exclude
    the true difference 0 for at least one set in at most ~5% of experiments (plus Monte-Carlo
    error), where the per-comparison intervals do so several times as often. Estimating each
    comparison's seed variance from its own two seeds (``pool_seeds=False``, one degree of freedom)
    cannot hold the family-wise rate: the shared default's seeds make every comparison's error
    estimate small at once."""
    reps, every = 600, 3  # the unpooled variant on every third experiment
    rng = np.random.default_rng(12)
    errors = {"simultaneous": 0, "per_comparison": 0, "unpooled_simultaneous": 0}
    for r in range(reps):
        c, n = synthetic(rng, [0.3] * 9, 2, 30)
        pooled = tau_intervals(c, n, reference=0, family=range(1, 9), n_boot=300, seed=r)
        errors["simultaneous"] += any(x["diff_fw_lo"] > 0 or x["diff_fw_hi"] < 0 for x in pooled.rows[1:])
        errors["per_comparison"] += any(x["diff_lo"] > 0 or x["diff_hi"] < 0 for x in pooled.rows[1:])
        if r % every == 0:
            alone = tau_intervals(c, n, reference=0, family=range(1, 9), n_boot=300, seed=r, pool_seeds=False)
            errors["unpooled_simultaneous"] += any(x["diff_fw_lo"] > 0 or x["diff_fw_hi"] < 0 for x in alone.rows[1:])
    rate = {"simultaneous": errors["simultaneous"] / reps, "per_comparison": errors["per_comparison"] / reps,
            "unpooled_simultaneous": errors["unpooled_simultaneous"] / (reps // every)}
    print("family-wise error at nominal 5%:", rate)
    assert rate["simultaneous"] <= _mc_bound(0.05, reps)
    assert rate["per_comparison"] > 0.12
    assert rate["unpooled_simultaneous"] > _mc_bound(0.05, reps // every)
