"""The statistics pipeline on a real capture against brute-force float64 numpy on the same states."""
import math

import numpy as np
import pytest
import torch

from wavesurf.capture import CaptureBatch
from wavesurf.errors import StatsError, WavesurfError
from wavesurf.stats.layer_sets import all_subsets
from wavesurf.stats.analysis import AnalysisSettings, _Accumulator, analysis_key, analyze_batches
from wavesurf.stats.store import load_stats
from wavesurf.stats.filtering import FilterError

PAIR_LAYERS = [0, 1, 2, 5, 15, 27, 30]


def _states(batches, mask_fn):
    """float64 numpy rows per layer id of the positions mask_fn selects."""
    out = {}
    for b in batches:
        m = mask_fn(b)
        for i, h in b.hidden.items():
            out.setdefault(i, []).append(h[m].double().numpy())
    return {i: np.concatenate(v) for i, v in out.items()}


def _entropy(cov, alpha):
    lam = np.linalg.eigvalsh(cov)
    lam = lam[lam >= lam.max() * 1e-12]
    p = lam / lam.sum()
    return float(-(p * np.log(p)).sum()) if alpha == 1 else float(np.log((p**alpha).sum()) / (1 - alpha))


def _cka(x, y):
    x, y = x - x.mean(0), y - y.mean(0)
    return np.linalg.norm(x.T @ y) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))


@pytest.fixture(scope="module")
def exact_stats(small_batches):
    # 4 groups as the smoke profile: leave-one-group-out is checked per group, and each group costs
    # one more eigendecomposition per layer
    return analyze_batches(small_batches, 30, 576, AnalysisSettings(estimator="exact", resample_groups=4))


def test_streaming_equals_bruteforce_on_real_states(small_batches, exact_stats):
    X = _states(small_batches, lambda b: b.stat_mask())
    n = len(X[0])
    assert exact_stats.main.n_tokens == n == 1500 - sum(b.input_ids.shape[0] for b in small_batches)
    for i in range(31):
        cov = np.cov(X[i], rowvar=False)
        assert exact_stats.entropy[i] == pytest.approx(_entropy(cov, 1), rel=1e-8), i
        assert exact_stats.entropy2[i] == pytest.approx(_entropy(cov, 2), rel=1e-8), i
        assert exact_stats.trace[i] == pytest.approx(np.trace(cov), rel=1e-8)
        assert exact_stats.normalized_entropy[i] == pytest.approx(_entropy(cov, 1) / math.log(min(n - 1, 576)), rel=1e-8)
    for a in PAIR_LAYERS:
        for b in PAIR_LAYERS:
            assert exact_stats.cka[a, b] == pytest.approx(_cka(X[a], X[b]), rel=1e-8), (a, b)
    assert np.allclose(np.diag(exact_stats.cka), 1.0, rtol=1e-12)
    assert np.allclose(exact_stats.cka, exact_stats.cka.T, rtol=1e-12)


def test_aggregate_entropy_from_kept_blocks(small_batches, exact_stats):
    X = _states(small_batches, lambda b: b.stat_mask())
    ids = [2, 15, 27]
    covs = {(a, b): np.cov(X[a], X[b], rowvar=False)[:576, 576:] for a in ids for b in ids}
    tr = {a: np.trace(np.cov(X[a], rowvar=False)) for a in ids}
    A = np.block([[covs[a, b] / math.sqrt(tr[a] * tr[b]) / 3 for b in ids] for a in ids])
    for alpha in (1, 2):
        # the kept blocks are float32: ~1e-7 relative
        assert exact_stats.aggregate_entropy(ids, alpha) == pytest.approx(_entropy(A, alpha), rel=1e-6)
    single = [exact_stats.entropy[i] for i in ids]
    agg = exact_stats.aggregate_entropy(ids, 1)
    assert np.mean(single) <= agg <= np.mean(single) + math.log(3)
    assert exact_stats.redundancy(ids) >= 0


def test_filter_and_random_control_on_real_states(small_batches):
    # the per-layer moments the entropies read are exact with either CKA estimator; no intervals here
    stats = analyze_batches(small_batches, 30, 576, AnalysisSettings(filter="q0.5", pilot_tokens=400, min_tokens=100,
                                                                     estimator="minibatch", minibatch_size=64,
                                                                     resample_groups=0))
    f = stats.meta["filter"]
    thr = f["threshold_nats"]
    assert stats.main.name == "filtered" and stats.control.name == "random"
    assert stats.main.n_tokens == stats.control.n_tokens == f["kept_tokens"]
    assert 0.3 < f["kept_fraction"] < 0.7
    X = _states(small_batches, lambda b: b.stat_mask() & (b.token_entropy >= thr))
    for i in (2, 15, 30):
        assert stats.entropy[i] == pytest.approx(_entropy(np.cov(X[i], rowvar=False), 1), rel=1e-8)
    # filtering is not the same as subsampling: the two subsets differ
    assert not np.allclose(stats.main.entropy, stats.control.entropy, rtol=1e-3)


def test_filter_keeping_too_few_tokens_is_an_error(small_batches):
    with pytest.raises(FilterError) as err:
        analyze_batches(small_batches, 30, 576, AnalysisSettings(filter="12nats", estimator="minibatch",
                                                                 resample_groups=0))
    msg = str(err.value)
    assert "kept 0 of" in msg and "at least 577" in msg


def test_nan_states_name_layer(small_batches):
    b0 = small_batches[0]
    hidden = dict(b0.hidden)
    hidden[7] = hidden[7].clone()
    hidden[7][0, 3, :2] = float("nan")
    bad = CaptureBatch(b0.index, hidden, b0.input_ids, b0.attention_mask, b0.positions, b0.roles, b0.token_entropy,
                       b0.example_ids)
    with pytest.raises(StatsError, match="layer 7"):
        analyze_batches([bad], 30, 576, AnalysisSettings(min_tokens=10, estimator="exact", resample_groups=0))


def test_minibatch_estimator_close_to_exact(small_batches, exact_stats):
    mb = analyze_batches(small_batches, 30, 576, AnalysisSettings(estimator="minibatch", minibatch_size=256,
                                                                 resample_groups=0))
    assert mb.meta["estimator_used"] == "minibatch" and not mb.has_cross_covariance
    np.testing.assert_allclose(mb.entropy, exact_stats.entropy, rtol=1e-10)  # entropy is always exact
    # unbiased minibatch CKA estimates the population CKA, not the biased full-data one: close, not equal
    assert np.abs(mb.cka - exact_stats.cka).max() < 0.15
    with pytest.raises(Exception, match="estimator='exact'"):
        mb.aggregate_entropy([2, 15, 27])


def test_accumulators_of_other_settings_refuse_to_merge():
    s = AnalysisSettings()
    a = _Accumulator("all", [0, 1], 4, True, s, {"key": "run-a"})
    b = _Accumulator("all", [0, 1], 4, True, s, {"key": "run-b"})
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    groups = torch.tensor([[0] * 5, [1] * 5])
    a.update({0: x, 1: x}, torch.ones(2, 5, dtype=torch.bool), groups)
    b.update({0: x, 1: x}, torch.ones(2, 5, dtype=torch.bool), groups)
    with pytest.raises(StatsError, match="key"):
        a.moments.merge(b.moments)
    with pytest.raises(StatsError, match="key"):
        a.grouped.merge(b.grouped)


def test_cache_round_trip_and_key(smollm, small_stats, exact_stats):
    from tests.conftest import SMALL

    assert small_stats.path is not None and (small_stats.path / "layers.csv").is_file()
    again = load_stats(small_stats.path)
    np.testing.assert_array_equal(again.cka, small_stats.cka)
    assert again.compartments == small_stats.compartments
    assert again.aggregate_entropy([2, 15, 27]) == pytest.approx(small_stats.aggregate_entropy([2, 15, 27]), rel=1e-12)
    # the cached result is what a fresh pass over the same tokens gives (exact_stats: the same
    # unfiltered tokens, other resampling groups, which the full-sample entropies do not read)
    np.testing.assert_allclose(exact_stats.entropy, small_stats.entropy, rtol=1e-6)
    rows = (small_stats.path / "layers.csv").read_text().splitlines()
    assert len(rows) == 32 and rows[0].startswith("model,subset,filter,layer_id,sglang_layer_id")
    base = AnalysisSettings(**SMALL)
    keys = {analysis_key(smollm, s)[0] for s in (base, AnalysisSettings(**{**SMALL, "seed": 1}),
                                                  AnalysisSettings(**{**SMALL, "filter": "q0.5"}),
                                                  AnalysisSettings(**{**SMALL, "include_position0": True}))}
    assert len(keys) == 4


def test_bad_settings():
    with pytest.raises(Exception, match="estimator='fast' is not one of auto, exact, minibatch"):
        AnalysisSettings(estimator="fast").check()
    with pytest.raises(FilterError, match="allowed"):
        AnalysisSettings(filter="top20").check()


def test_leave_one_group_out_values_equal_bruteforce_on_real_states(small_batches, exact_stats):
    from wavesurf.stats.resampling import GroupAssigner

    G = exact_stats.main.replicates["group_tokens"].shape[0]
    assert G == 4
    assigner = GroupAssigner(G)
    rows, grp = [], []
    for b in small_batches:
        m = b.stat_mask()
        rows.append(b.hidden[15][m].double().numpy())
        g = assigner.row_groups(b.example_ids, tuple(m.shape))
        grp.append(g[m].numpy())
    X, g = np.concatenate(rows), np.concatenate(grp)
    np.testing.assert_array_equal(exact_stats.main.replicates["group_tokens"], np.bincount(g, minlength=G))
    for k in (0, G - 1):
        cov = np.cov(X[g != k], rowvar=False)
        assert exact_stats.main.replicates["entropy"][k, 15] == pytest.approx(_entropy(cov, 1), rel=1e-8)
        assert exact_stats.main.replicates["trace"][k, 15] == pytest.approx(np.trace(cov), rel=1e-8)
    jk = exact_stats.interval("entropy")
    assert np.all(jk.low < exact_stats.entropy) and np.all(exact_stats.entropy < jk.high)
    ck = exact_stats.interval("cka_next")
    assert ck.low.shape == (30,) and np.all(ck.se > 0)
    freq = exact_stats.boundary_frequency()
    assert freq.shape == (31,) and 0 <= freq.min() and freq.max() <= 1
    row = exact_stats.layer_rows()[15]
    assert row["entropy_nats_low"] < row["entropy_nats"] < row["entropy_nats_high"]


def test_set_scores_match_exact_entropies(small_stats):
    """alpha=2 aggregate entropy and redundancy from purities + CKA equal the eigenvalue versions."""
    sets = [[2, 15, 27], [1, 2], [5, 20, 29, 30]]
    for s in sets:
        assert small_stats.aggregate_entropy2([s])[0] == pytest.approx(small_stats.aggregate_entropy(s, alpha=2.0), abs=1e-5)
        assert small_stats.redundancy2([s])[0] == pytest.approx(small_stats.redundancy(s, alpha=2.0), abs=1e-5)
    assert small_stats.aggregate_entropy2([2, 15, 27]) == pytest.approx(small_stats.aggregate_entropy2([[2, 15, 27]]))
    m = small_stats.pair_matrix()
    assert m.shape == (31, 31) and np.allclose(m, m.T)
    assert np.allclose(np.diag(m), small_stats.entropy2, atol=1e-8)  # a single layer: its own S2
    assert np.all(small_stats.redundancy2(all_subsets(range(1, 31), 2)) >= -1e-9)
    with pytest.raises(WavesurfError, match="layer id 99"):
        small_stats.aggregate_entropy2([[1, 99]])
    pc = small_stats.pair_cka([2, 15, 27])
    assert list(pc) == [(2, 15), (2, 27), (15, 27)] and pc[(2, 15)] == small_stats.cka[2, 15]


def test_depth_curves(small_stats, interval_stats):
    curves = small_stats.depth_curves()
    top = math.log(min(small_stats.n_tokens - 1, small_stats.meta["hidden_size"]))
    assert np.allclose(curves["S1_norm"] * top, small_stats.entropy) and np.array_equal(curves["S2"], small_stats.entropy2)
    assert "S1_band" not in curves or small_stats.has_intervals
    curves = interval_stats.depth_curves()
    lo, hi = curves["S1_band"]
    assert np.all(lo <= curves["S1"]) and np.all(curves["S1"] <= hi)


def test_intervals_on_filtered_and_control_subsets(interval_stats):
    stats = interval_stats
    assert stats.has_intervals and stats.control.replicates is not None
    diff = stats.control_difference("mean_normalized_entropy")
    e1 = stats.interval("mean_normalized_entropy").estimate
    e0 = stats.interval("mean_normalized_entropy", subset="control").estimate
    assert float(diff.estimate) == pytest.approx(float(e1 - e0))
    assert float(diff.low) < float(diff.estimate) < float(diff.high)
    agg = stats.aggregate_entropy2_interval([[2, 15, 27], [1, 2, 3]])
    assert np.all(agg.low < agg.estimate) and np.all(agg.estimate < agg.high)
    assert np.array_equal(agg.estimate, stats.aggregate_entropy2([[2, 15, 27], [1, 2, 3]]))
    red = stats.redundancy2_interval([[2, 15, 27]])
    assert float(red.estimate[0]) == pytest.approx(float(stats.redundancy2([[2, 15, 27]])[0]))
    d = stats.aggregate_entropy2_difference([2, 15, 27], [1, 2, 3])
    assert float(d.estimate) == pytest.approx(float(agg.estimate[0] - agg.estimate[1]))


def test_a_run_too_small_for_intervals_says_so(small_batches):
    stats = analyze_batches(small_batches[:1], 30, 576, AnalysisSettings(estimator="minibatch", minibatch_size=64,
                                                                          resample_groups=20, min_tokens=8))
    assert stats.main.replicates is None and "too small" in stats.main.interval_note
    assert "too small" in stats.meta["intervals"]["notes"]["all"]
    with pytest.raises(Exception, match="too small"):
        stats.interval("entropy")
    assert "entropy_nats_low" not in stats.layer_rows()[0]


def test_more_groups_than_conversations_is_refused_before_the_pass(smollm):
    from tests.conftest import SMALL
    from wavesurf.stats.analysis import analyze

    with pytest.raises(Exception, match="resample_groups=100000 is more than the"):
        analyze(smollm, progress=False, use_cache=False, **{**SMALL, "resample_groups": 100000})
    with pytest.raises(StatsError, match="resample_groups=1 is not allowed"):
        AnalysisSettings(resample_groups=1).check()
