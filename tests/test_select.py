import itertools
import json

import numpy as np
import pytest

from wavesurf import select as sel
from wavesurf.book import paper
from wavesurf.consumers import ConsumerError
from wavesurf.select import (METHODS, SelectionError, cross_model_rows, select_layers, selection_rows,
                             sweep_rows)
from wavesurf.stats.results import control_view
from wavesurf.stats.entropy import aggregate_entropy2_closed_form
from wavesurf.stats.layer_sets import all_subsets


@pytest.fixture(scope="module")
def small_probe(small_batches):
    """Probe scores of every 3-set of ids 0..30 from the small capture (few components: fast)."""
    from wavesurf.stats.probe import ProbeAccumulator, ProbeResult, ProbeSettings, probe_sets, score_layer_sets

    acc = ProbeAccumulator(30, 576, ProbeSettings(dims=2, embedding_dims=8, pilot_tokens=300, heldout_every=3))
    for b in small_batches:
        acc.update(b)
    sets, over = probe_sets(30, 3)
    scores = score_layer_sets(acc.result(), sets, 0.1)
    return ProbeResult("test", 30, 3, 0.1, sets, scores["r2"], scores["r2_raw"], over)


def _options(method, probe=None):
    """Options that keep each method fast on the small statistics (alpha=1 greedy takes ~40 s)."""
    return {"greedy-aggregate": {"alpha": 2}, "probe": {"probe": probe}}.get(method, {})


def _subsets(n=30, k=3, lo=1):
    return np.array(list(itertools.combinations(range(lo, n + 1), k)))


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_returns_valid_ids(small_stats, small_probe, method):
    s = select_layers(small_stats, k=3, method=method, **_options(method, small_probe))
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


def test_entropy_is_the_exhaustive_best_mean_s1(small_stats):
    subsets = _subsets()
    mean_s1 = small_stats.entropy[subsets].mean(axis=1)
    s = select_layers(small_stats, 3, "entropy")
    assert s.layer_ids == list(subsets[np.argmax(mean_s1)])
    assert s.scores["mean_entropy_nats"] == pytest.approx(mean_s1.max(), abs=1e-4)
    assert min(np.diff(s.layer_ids)) == 1  # on SmolLM2 the top three are neighbours: no spacing rule


def test_entropy_spaced_heuristic_and_its_gap(small_stats):
    s = select_layers(small_stats, 3, "entropy-spaced", min_spacing=4)
    assert min(np.diff(s.layer_ids)) >= 4 and "heuristic" in s.reason
    best = int(np.argmax(small_stats.entropy[1:])) + 1
    assert best in s.layer_ids
    subsets = _subsets()
    spaced = subsets[(np.diff(subsets, axis=1) >= 4).all(axis=1)]
    optimum = small_stats.entropy[spaced].mean(axis=1).max()
    gap = s.scores["mean_entropy_gap_to_spaced_optimum_nats"]
    assert gap >= 0 and gap == pytest.approx(optimum - small_stats.entropy[s.layer_ids].mean(), abs=1e-6)
    assert select_layers(small_stats, 3, "entropy-spaced").scores["min_spacing"] == 5  # N // (2k)
    with pytest.raises(SelectionError, match="lower min_spacing"):
        select_layers(small_stats, 10, "entropy-spaced", min_spacing=10)
    with pytest.raises(SelectionError, match=r"min_spacing=0 must be an integer >= 1"):
        select_layers(small_stats, 3, "entropy-spaced", min_spacing=0)


def test_cka_picks_from_the_compartments_the_analysis_found(small_stats):
    s = select_layers(small_stats, 3, "cka")
    blocks = [b for b in small_stats.compartments if b[1] >= 1]
    assert s.scores["compartments"] == [list(b) for b in blocks] and len(blocks) != 3  # not re-segmented into k
    label = {i: n for n, (lo, hi) in enumerate(blocks) for i in range(max(lo, 1), hi + 1)}
    informative = {i for lo, hi in blocks for i in range(max(lo, 1), hi + 1)
                   if small_stats.entropy[i] >= np.median(small_stats.entropy[max(lo, 1):hi + 1])}
    # brute force: every 3-set of informative layers from 3 different compartments, least mean CKA
    subsets = _subsets()
    ok = np.array([set(r) <= informative and len({label[i] for i in r}) == 3 for r in subsets])
    cka = small_stats.cka
    pair = (cka[subsets[:, 0], subsets[:, 1]] + cka[subsets[:, 0], subsets[:, 2]] + cka[subsets[:, 1], subsets[:, 2]]) / 3
    pair[~ok] = np.inf
    assert s.layer_ids == list(subsets[np.argmin(pair)])
    assert len({label[i] for i in s.layer_ids}) == 3
    # more picks than compartments: every compartment gets one
    many = select_layers(small_stats.alpha2_view(), 7, "cka")  # the same compartments, no alpha=1 score of 7 layers
    assert {label[i] for i in many.layer_ids} == set(range(len(blocks)))


def test_cka_on_a_resample_uses_its_own_compartments(interval_stats):
    view = interval_stats.replicate_views()[0]
    s = select_layers(view, 3, "cka")
    from wavesurf.stats.compartments import compartments

    assert s.scores["compartments"][0][0] == compartments(view.cka)[0][0]


def test_combined_trade_off_extremes(small_stats):
    only_entropy = select_layers(small_stats, 2, "combined", trade_off=0.0)
    top2 = sorted(np.argsort(-small_stats.normalized_entropy[1:])[:2] + 1)
    assert only_entropy.layer_ids == [int(i) for i in top2]
    only_div = select_layers(small_stats, 2, "combined", trade_off=1.0)
    sub = small_stats.cka[1:, 1:]
    a, b = np.unravel_index(np.argmin(sub), sub.shape)
    assert only_div.layer_ids == sorted([int(a) + 1, int(b) + 1])
    for bad in (2, -0.1, "0.5", None):
        with pytest.raises(SelectionError, match=r"must be a number in \[0, 1\]"):
            select_layers(small_stats, 3, "combined", trade_off=bad)


def _combined_brute(stats, k=3):
    subsets = _subsets(k=k)
    info = stats.normalized_entropy[subsets].mean(axis=1)
    pairs = list(itertools.combinations(range(k), 2))
    div = 1 - np.mean([stats.cka[subsets[:, a], subsets[:, b]] for a, b in pairs], axis=0)
    return subsets, info, div


@pytest.mark.parametrize("t", [0.25, 0.5, 0.9])
def test_combined_standardises_both_terms_over_every_set(small_stats, t):
    subsets, info, div = _combined_brute(small_stats)
    score = (1 - t) * (info - info.mean()) / info.std() + t * (div - div.mean()) / div.std()
    s = select_layers(small_stats, 3, "combined", trade_off=t)
    assert s.layer_ids == list(subsets[np.argmax(score)])
    assert s.scores["combined_score"] == pytest.approx(score.max(), abs=1e-4)
    assert s.scores["diversity_sd"] == pytest.approx(div.std(), rel=1e-5)


def test_combined_front_is_the_pareto_front(small_stats):
    subsets, info, div = _combined_brute(small_stats)
    dominated = np.array([((info >= i) & (div >= d) & ((info > i) | (div > d))).any() for i, d in zip(info, div)])
    front = sel.combined_front(small_stats, 3, trade_offs=[0, 0.5, 1])
    assert sorted(tuple(f["layer_ids"]) for f in front["front"]) == sorted(tuple(r) for r in subsets[~dominated])
    assert [f["informativeness"] for f in front["front"]] == sorted(f["informativeness"] for f in front["front"])[::-1]
    on_front = {tuple(f["layer_ids"]) for f in front["front"]}
    for p in front["picks"]:
        assert tuple(p["layer_ids"]) in on_front
        assert p["layer_ids"] == select_layers(small_stats, 3, "combined", trade_off=p["trade_off"]).layer_ids
    with pytest.raises(SelectionError, match=r"\[0, 1\]"):
        sel.combined_front(small_stats, 3, trade_offs=[0.5, 1.5])


def test_greedy_aggregate_and_its_gap_to_the_exhaustive_optimum(small_stats):
    subsets = _subsets()
    s2 = aggregate_entropy2_closed_form(small_stats.purity, small_stats.cka, subsets)
    s = select_layers(small_stats, 3, "greedy-aggregate", alpha=2)
    # brute-force greedy: add the layer that maximises the alpha=2 aggregate entropy of the set
    chosen = []
    for _ in range(3):
        rest = [c for c in range(1, 31) if c not in chosen]
        trial = [sorted(chosen + [c]) for c in rest]
        vals = [aggregate_entropy2_closed_form(small_stats.purity, small_stats.cka, np.array([t]))[0] for t in trial]
        chosen = trial[int(np.argmax(vals))]
    assert s.layer_ids == chosen
    assert s.scores["exhaustive_alpha2_optimum_ids"] == list(subsets[np.argmax(s2)])
    mine = aggregate_entropy2_closed_form(small_stats.purity, small_stats.cka, np.array([chosen]))[0]
    assert s.scores["gap_to_exhaustive_nats"] == pytest.approx(s2.max() - mine, abs=1e-6) and s.scores["gap_to_exhaustive_nats"] >= 0
    with pytest.raises(SelectionError, match=r"alpha=3 is not allowed for greedy-aggregate: 1 or 2"):
        select_layers(small_stats, 3, "greedy-aggregate", alpha=3)


def test_greedy_aggregate_alpha1_where_cross_covariances_are_kept(small_stats, interval_stats):
    cand = [3, 20, 29]  # few candidates: each alpha=1 trial is an eigendecomposition of a 1,152-dim matrix
    s = select_layers(small_stats, 2, "greedy-aggregate", candidates=cand)
    assert s.scores["alpha"] == 1.0 and s.scores["gap_to_exhaustive_nats"] is None
    first = cand[int(np.argmax(small_stats.entropy[cand]))]
    second = max((c for c in cand if c != first), key=lambda c: small_stats.aggregate_entropy(sorted([first, c]), 1.0))
    assert s.layer_ids == sorted([first, second])
    assert select_layers(interval_stats, 2, "greedy-aggregate", candidates=cand).scores["alpha"] == 2.0  # minibatch CKA
    with pytest.raises(SelectionError, match="needs the cross-layer covariances"):
        select_layers(interval_stats, 2, "greedy-aggregate", alpha=1)


@pytest.mark.parametrize("lam", [0.0, 1.0, 3.0])
def test_mrmr_greedy_and_its_gap_to_the_best_ordered_set(small_stats, lam):
    S1, cka = small_stats.entropy, small_stats.cka
    s = select_layers(small_stats, 3, "mrmr", redundancy_weight=lam)
    chosen = []
    for _ in range(3):
        rest = [c for c in range(1, 31) if c not in chosen]
        gain = [S1[c] - lam * max((cka[c, j] for j in chosen), default=0.0) for c in rest]
        chosen.append(rest[int(np.argmax(gain))])
    assert s.scores["pick_order"] == chosen and s.layer_ids == sorted(chosen)

    def objective(order):
        return sum(S1[o] - lam * max((cka[o, p] for p in order[:i]), default=0.0) for i, o in enumerate(order))

    best = max(objective(o) for o in itertools.permutations(range(1, 31), 3))
    assert s.scores["gap_to_exhaustive_nats"] == pytest.approx(best - objective(chosen), abs=1e-6)
    if lam == 0.0:
        assert s.layer_ids == select_layers(small_stats, 3, "entropy").layer_ids  # no redundancy term: top-k S1
    with pytest.raises(SelectionError, match=r"redundancy_weight=-1 must be a finite number >= 0"):
        select_layers(small_stats, 3, "mrmr", redundancy_weight=-1)


def test_probe_method_picks_the_best_probed_set(small_stats, small_probe):
    s = select_layers(small_stats, 3, "probe", probe=small_probe)
    inside = (small_probe.layer_sets >= 1).all(axis=1)  # candidates 1..N: sets with id 0 are left out
    best = small_probe.layer_sets[inside][np.argmax(small_probe.r2[inside])]
    assert s.layer_ids == list(best) and s.scores["probe_r2"] == pytest.approx(small_probe.r2[inside].max(), abs=1e-6)
    assert s.scores["probe_sets_scored"] == 4060
    with_zero = select_layers(small_stats, 3, "probe", probe=small_probe, candidates=range(31))
    assert with_zero.scores["probe_sets_scored"] == 4495
    assert small_probe.rank(with_zero.layer_ids) == 1 and small_probe.best(1) == [with_zero.layer_ids]
    with pytest.raises(SelectionError, match="pass probe=wavesurf.stats.probe.probe_layer_sets"):
        select_layers(small_stats, 3, "probe")
    with pytest.raises(SelectionError, match="scores 3-layer sets, not k=2"):
        select_layers(small_stats, 2, "probe", probe=small_probe)
    assert sel.selection_recurrence(small_stats, 3, "probe", probe=small_probe) is None


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
    with pytest.raises(SelectionError, match="default, entropy, entropy-spaced, aggregate, greedy-aggregate, mrmr, cka, combined, probe"):
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
    rows = selection_rows(small_stats, k=3, **{"greedy-aggregate": {"alpha": 2}})
    assert [r["method"] for r in rows] == ["default", "entropy", "entropy-spaced", "aggregate", "greedy-aggregate", "mrmr",
                                           "cka", "combined"]  # probe needs its probe= result
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
        control_view(small_stats)
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
    from wavesurf.book import plots

    rows = selection_rows(interval_stats, k=3)
    for r in rows:
        assert 0.0 <= r["jackknife_agreement"] <= 1.0
        assert r["delta_aggregate_entropy2_low"] <= r["delta_aggregate_entropy2_vs_default"] <= r["delta_aggregate_entropy2_high"]
    assert rows[0]["jackknife_agreement"] == 1.0  # the fixed default rule never changes
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
