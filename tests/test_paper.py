"""What the paper-companion notebooks share: closed-form set scores, the selection and sweep tables
with their intervals, interval prose."""
from __future__ import annotations

import numpy as np
import pytest

from wavesurf import paper
from wavesurf.stats import variants as stats_variants


def test_closed_forms_match_exact_entropies(small_stats):
    """alpha=2 aggregate entropy and redundancy from purities + CKA equal the eigenvalue versions."""
    sets = [[2, 15, 27], [1, 2], [5, 20, 29, 30]]
    for s in sets:
        assert paper.aggregate_entropy2(small_stats, [s])[0] == pytest.approx(small_stats.aggregate_entropy(s, alpha=2.0), abs=1e-5)
        assert paper.redundancy2(small_stats, [s])[0] == pytest.approx(small_stats.redundancy(s, alpha=2.0), abs=1e-5)
    m = paper.pair_matrix(small_stats)
    assert m.shape == (31, 31) and np.allclose(m, m.T)
    assert np.allclose(np.diag(m), small_stats.entropy2, atol=1e-8)  # a single layer: its own S2
    assert np.all(paper.redundancy2(small_stats, paper.all_subsets(range(1, 31), 2)) >= -1e-9)
    with pytest.raises(Exception, match="layer id 99"):
        paper.aggregate_entropy2(small_stats, [[1, 99]])


def test_subsets_rank_and_ids():
    assert paper.all_subsets(range(1, 31), 3).shape == (4060, 3)
    assert paper.rank_of(np.array([3.0, 2.0, 1.0]), 2.0) == (2, 1 / 3)
    assert paper.fmt_ids(np.array([2, 15, 27])) == "[2, 15, 27]"


def test_selection_and_sweep_rows(small_stats, tmp_path):
    rows = paper.selection_rows(small_stats, k=3)
    assert [r["method"] for r in rows] == ["default", "entropy", "aggregate", "cka", "combined"]
    assert rows[0]["layer_ids"] == "2 15 27" and rows[0]["sglang_layer_ids"] == "1 14 26"
    assert rows[0]["delta_aggregate_entropy2_vs_default"] == 0
    agg = next(r for r in rows if r["method"] == "aggregate")
    assert agg["aggregate_entropy2_nats"] >= rows[0]["aggregate_entropy2_nats"] - 0.05  # re-ranked by alpha=1
    path = paper.write_csv(rows, tmp_path / "t" / "sel.csv")
    assert path.read_text().splitlines()[0].startswith("method,layer_ids,")
    sweep = paper.sweep_rows({"base": small_stats})
    assert len(sweep) == 1 and sweep[0]["subset"] == "all" and sweep[0]["kept_fraction"] == 1.0
    with pytest.raises(Exception, match="no random control"):
        stats_variants.control_view(small_stats)


def test_selection_and_sweep_rows_carry_intervals(interval_stats):
    import matplotlib

    matplotlib.use("Agg")
    from wavesurf import plots

    rows = paper.selection_rows(interval_stats, k=3)
    for r in rows:
        assert 0.0 <= r["chosen_in_resamples"] <= 1.0
        assert r["delta_aggregate_entropy2_low"] <= r["delta_aggregate_entropy2_vs_default"] <= r["delta_aggregate_entropy2_high"]
    assert rows[0]["chosen_in_resamples"] == 1.0  # the fixed default rule never changes
    for r in rows:
        assert r["redundancy2_low"] <= r["redundancy2_nats"] <= r["redundancy2_high"]
    red = interval_stats.redundancy2([[2, 15, 27]])
    assert float(red.estimate[0]) == pytest.approx(float(paper.redundancy2(interval_stats, [[2, 15, 27]])[0]))
    sweep = paper.sweep_rows({"q0.2": interval_stats})
    filt = next(r for r in sweep if r["subset"] == "filtered")
    assert filt["mean_neighbour_cka_low"] <= filt["mean_neighbour_cka"] <= filt["mean_neighbour_cka_high"]
    diff = interval_stats.control_difference("mean_cka_next")
    assert filt["mean_neighbour_cka_minus_random"] == pytest.approx(float(diff.estimate), abs=1e-4)
    text = paper.fmt_interval(diff, ".4f")
    assert text.startswith(f"{float(diff.estimate):.4f} (95% CI ")
    assert paper.noise_verdict(diff) == ("within noise" if diff.low <= 0 <= diff.high else "beyond noise")
    assert "grouped-jackknife" in paper.interval_note(interval_stats)
    ax = plots.plot_sweep(sweep, "mean_neighbour_cka", "mean CKA(i, i+1)")
    assert len(ax.containers) == 2  # whiskers on both subsets
    curves = paper.depth_curves(interval_stats)
    lo, hi = curves["S1_band"]
    assert np.all(lo <= curves["S1"]) and np.all(curves["S1"] <= hi)
