import itertools
import json

import numpy as np
import pytest

from wavesurf import paper
from wavesurf import select as sel
from wavesurf.consumers import ConsumerError
from wavesurf.select import (METHODS, SelectionError, all_subsets, cross_model_rows, select_layers, selection_rows,
                             sweep_rows)
from wavesurf.stats import variants as stats_variants
from wavesurf.stats.entropy import aggregate_entropy2_closed_form


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_returns_valid_ids(small_stats, method):
    s = select_layers(small_stats, k=3, method=method)
    assert len(s.layer_ids) == 3 and s.layer_ids == sorted(set(s.layer_ids))
    assert all(1 <= i <= 30 for i in s.layer_ids)
    assert s.sglang_layer_ids == [i - 1 for i in s.layer_ids] and s.convention == "vllm"
    assert s.method == method and s.reason and {"mean_entropy_nats", "mean_pairwise_cka"} <= set(s.scores)
    json.dumps(s.to_dict())  # JSON-able for the CLI


def test_default_rule(small_stats):
    assert select_layers(small_stats, 3, "default").layer_ids == [2, 15, 27]
    with pytest.raises(SelectionError, match="needs k=3"):
        select_layers(small_stats, 4, "default")


def test_aggregate_is_the_exhaustive_alpha2_optimum_then_alpha1(small_stats):
    s = select_layers(small_stats, 3, "aggregate")
    subsets = np.array(list(itertools.combinations(range(1, 31), 3)))
    s2 = aggregate_entropy2_closed_form(small_stats.purity, small_stats.cka, subsets)
    top = subsets[np.argsort(-s2)[: sel.SHORTLIST]]
    assert [a["layer_ids"] for a in s.alternatives] == [list(t) for t in top]
    s1 = [small_stats.aggregate_entropy(list(t), 1.0) for t in top]
    assert s.layer_ids == list(top[int(np.argmax(s1))])
    # the closed form agrees with the eigendecomposition on the chosen set
    assert s.scores["aggregate_entropy2_nats"] == pytest.approx(small_stats.aggregate_entropy(s.layer_ids, 2.0), rel=1e-5)


def test_entropy_method_spacing(small_stats):
    s = select_layers(small_stats, 3, "entropy", min_spacing=4)
    assert min(np.diff(s.layer_ids)) >= 4
    best = int(np.argmax(small_stats.entropy[1:])) + 1
    assert best in s.layer_ids
    with pytest.raises(SelectionError, match="lower min_spacing"):
        select_layers(small_stats, 10, "entropy", min_spacing=10)


def test_cka_method_one_layer_per_compartment(small_stats):
    s = select_layers(small_stats, 3, "cka")
    blocks = s.scores["compartments"]
    assert len(blocks) == 3 and blocks[0][0] == 1 and blocks[-1][1] == 30
    assert [sum(lo <= i <= hi for i in s.layer_ids) for lo, hi in blocks] == [1, 1, 1]


def test_combined_trade_off_extremes(small_stats):
    only_entropy = select_layers(small_stats, 2, "combined", trade_off=0.0)
    top2 = sorted(np.argsort(-small_stats.normalized_entropy[1:])[:2] + 1)
    assert only_entropy.layer_ids == [int(i) for i in top2]
    only_div = select_layers(small_stats, 2, "combined", trade_off=1.0)
    sub = small_stats.cka[1:, 1:]
    a, b = np.unravel_index(np.argmin(sub), sub.shape)
    assert only_div.layer_ids == sorted([int(a) + 1, int(b) + 1])
    with pytest.raises(SelectionError, match=r"\[0, 1\]"):
        select_layers(small_stats, 3, "combined", trade_off=2)


def test_greedy_path_for_large_searches(small_stats, monkeypatch):
    monkeypatch.setattr(sel, "EXHAUSTIVE_LIMIT", 10)
    s = select_layers(small_stats, 4, "aggregate")
    assert len(s.layer_ids) == 4 and "greedy" in s.reason


@pytest.mark.parametrize("k", [0, 32, -1])
def test_bad_k(small_stats, k):
    with pytest.raises(SelectionError, match=r"allowed are 1\.\.31"):
        select_layers(small_stats, k, "aggregate")


def test_k_edges(small_stats):
    assert len(select_layers(small_stats, 1, "aggregate").layer_ids) == 1
    assert select_layers(small_stats, 31, "combined", candidates=range(31)).layer_ids == list(range(31))
    with pytest.raises(SelectionError, match="more than the 30 candidate"):
        select_layers(small_stats, 31, "combined")


def test_unknown_method_lists_methods(small_stats):
    with pytest.raises(SelectionError, match="default, entropy, aggregate, cka, combined"):
        select_layers(small_stats, 3, "pca")


def test_eagle_config_snippets(small_stats):
    s = select_layers(small_stats, 3, "default")
    llama = "LlamaForCausalLM"
    assert s.eagle_config("specforge", llama) == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26],
                                                                   "use_aux_hidden_state": True}, "fc_norm": False}
    assert s.eagle_config("vllm", llama) == {"eagle_aux_hidden_state_layer_ids": [2, 15, 27],
                                             "num_aux_hidden_states": 3, "fc_norm": False}
    assert s.eagle_config("sglang", llama)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    with pytest.raises(ConsumerError, match="rule for an unknown target architecture was not read"):
        s.eagle_config("sglang")
    with_embedding = select_layers(small_stats, 31, "combined", candidates=range(31))
    with pytest.raises(ConsumerError, match=r"\[0, 30\] cannot be served"):
        with_embedding.eagle_config("sglang", llama)
    assert with_embedding.eagle_config("vllm", llama)["num_aux_hidden_states"] == 31  # vLLM captures 0..N


def test_selection_recurrence_over_resamples(interval_stats, small_batches):
    from wavesurf.select import selection_recurrence
    from wavesurf.stats.analysis import AnalysisSettings, analyze_batches

    assert selection_recurrence(interval_stats, 3, "default") == 1.0  # the fixed rule never moves
    share = selection_recurrence(interval_stats, 3, "combined")
    assert 0.0 <= share <= 1.0
    # aggregate is compared on its alpha=2 basis on both sides (replicates have no cross-covariances)
    assert 0.0 <= selection_recurrence(interval_stats, 3, "aggregate") <= 1.0
    no_iv = analyze_batches(small_batches, 30, 576, AnalysisSettings(estimator="minibatch", minibatch_size=128,
                                                                      resample_groups=0))
    assert selection_recurrence(no_iv, 3, "combined") is None and not no_iv.has_intervals


# ---------------------------------------------------------------------------------------------
# the selection and filter-sweep tables
def test_selection_and_sweep_rows(small_stats, tmp_path):
    rows = selection_rows(small_stats, k=3)
    assert [r["method"] for r in rows] == ["default", "entropy", "aggregate", "cka", "combined"]
    assert rows[0]["layer_ids"] == [2, 15, 27] and rows[0]["sglang_layer_ids"] == [1, 14, 26]
    assert rows[0]["delta_aggregate_entropy2_vs_default"] == 0
    agg = next(r for r in rows if r["method"] == "aggregate")
    assert agg["aggregate_entropy2_nats"] >= rows[0]["aggregate_entropy2_nats"] - 0.05  # re-ranked by alpha=1
    path = paper.write_csv(rows, tmp_path / "t" / "sel.csv")
    lines = path.read_text().splitlines()
    assert lines[0].startswith("method,layer_ids,") and lines[1].startswith("default,2 15 27,1 14 26,")
    sweep = sweep_rows({"base": small_stats})
    assert len(sweep) == 1 and sweep[0]["subset"] == "all" and sweep[0]["kept_fraction"] == 1.0
    with pytest.raises(Exception, match="no random control"):
        stats_variants.control_view(small_stats)
    assert rows[0]["redundancy2_nats"] == round(float(small_stats.redundancy2([[2, 15, 27]])[0]), 4)


def test_all_subsets_and_cross_model_rows(small_stats):
    assert all_subsets(range(1, 31), 3).shape == (4060, 3)
    assert all_subsets([3, 1, 2], 2).tolist() == [[1, 2], [1, 3], [2, 3]]
    rows = cross_model_rows({"m": small_stats}, {}, methods=("default", "combined"))
    assert list(rows[0]) == ["model", "N", "compartments (no filter)", "default", "combined"]
    assert rows[0]["N"] == 30 and rows[0]["default"] == "[2, 15, 27] → [0.07, 0.50, 0.90]"
    assert rows[0]["compartments (no filter)"] == " ".join(f"{a}-{b}" for a, b in small_stats.compartments)


def test_selection_and_sweep_rows_carry_intervals(interval_stats):
    import matplotlib

    matplotlib.use("Agg")
    from wavesurf import plots

    rows = selection_rows(interval_stats, k=3)
    for r in rows:
        assert 0.0 <= r["chosen_in_resamples"] <= 1.0
        assert r["delta_aggregate_entropy2_low"] <= r["delta_aggregate_entropy2_vs_default"] <= r["delta_aggregate_entropy2_high"]
    assert rows[0]["chosen_in_resamples"] == 1.0  # the fixed default rule never changes
    for r in rows:
        assert r["redundancy2_low"] <= r["redundancy2_nats"] <= r["redundancy2_high"]
    sweep = sweep_rows({"q0.2": interval_stats})
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
