"""Layer sets of the speed table, from a small real analysis."""
from __future__ import annotations

import pytest

from wavesurf.errors import WavesurfError
from wavesurf.speed_table import evenly_spaced, layer_sets, random_sets


def test_evenly_spaced_and_random_sets():
    assert evenly_spaced(30, 3) == [10, 20, 30]
    assert evenly_spaced(18, 3) == [6, 12, 18]
    a = random_sets(30, 3, 5, seed=1, avoid=[[1, 2, 3]])
    assert a == random_sets(30, 3, 5, seed=1, avoid=[[1, 2, 3]])  # seeded
    assert len({tuple(s) for s in a}) == 5 and all(len(s) == 3 and 1 <= min(s) and max(s) <= 30 for s in a)
    with pytest.raises(WavesurfError, match="cannot draw 5 distinct"):
        random_sets(4, 3, 5, seed=0)


def test_layer_sets_cover_default_methods_and_controls(small_stats):
    sets = layer_sets(small_stats, k=3, n_random=2, seed=0)
    names = {s.name for s in sets} | {a for s in sets for a in s.aliases}
    assert {"default", "entropy", "aggregate", "cka", "combined", "last-3", "even-3", "last-1",
            "random-1", "random-2"} <= names
    by_name = {s.name: s for s in sets}
    assert by_name["default"].layer_ids == [2, 15, 27]
    assert by_name["last-1"].layer_ids == [30] and by_name["last-3"].layer_ids == [28, 29, 30]
    ids = [tuple(s.layer_ids) for s in sets]
    assert len(ids) == len(set(ids))  # duplicates merged into aliases
    assert all(s.group in ("default", "selected", "control") for s in sets)


def test_run_speed_table_trains_each_set_and_seed_once(smollm):
    """The smoke profile end to end: distilled corpora, one head per set and seed, offline tau with
    paired intervals, a bigram floor, timed runs and the curve; a re-run only reads the cache."""
    from wavesurf.profiles import get_profile
    from wavesurf.speed_table import LayerSet, SpeedTableSettings, run_speed_table

    settings = SpeedTableSettings.from_profile(get_profile("smoke").drafter)
    settings.seeds = (0, 1)
    sets = [LayerSet("default", "default", [2, 15, 27], "rule"), LayerSet("last-1", "control", [30], "top")]
    table = run_speed_table(smollm, sets, settings, progress=False)
    assert [(r["layer_set"], r["seed"]) for r in table.rows] == [("default", 0), ("default", 1), ("last-1", 0), ("last-1", 1)]
    assert len({r["drafter"] for r in table.rows}) == 4  # one drafter per set and seed
    assert len({r["train_tokens"] for r in table.rows}) == 1  # one budget for every set and seed
    assert table.rows[0]["train_tokens"] >= 0.5 * settings.train["train_tokens"]
    assert all(1.0 <= r["tau_1"] <= r["tau_3"] <= 4.0 for r in table.rows)  # a longer chain never commits less
    summary = {s["layer_set"]: s for s in table.summary}
    assert set(summary) == {"default", "last-1", "bigram", "lookup"}
    assert summary["bigram"]["group"] == summary["lookup"]["group"] == "floor"
    assert summary["lookup"]["tau"] >= 1.0
    d = summary["default"]
    assert d["seeds"] == 2 and d["tau_lo"] <= d["tau"] <= d["tau_hi"] and d["verdict"] == "reference"
    assert d["diff"] == 0.0  # the default paired with itself
    # every head is also scored drafting with n-gram lookup first (the smoke profile sets lookup_ngram)
    assert table.info["lookup_ngram"] == 3 and d["lookup_diff"] == 0.0
    assert d["lookup_tau_lo"] <= d["lookup_tau"] <= d["lookup_tau_hi"]
    assert all(r["lookup_tau_1"] <= r["lookup_tau_3"] for r in table.rows)
    view = table.lookup_rows()  # the figure's rows: each set after lookup, then lookup alone
    assert [r["layer_set"] for r in view] == ["default", "last-1", "lookup"]
    assert view[0]["verdict"] == "reference" and view[0]["tau"] == d["lookup_tau"]
    assert view[-1]["diff"] == -table.info["head_over_lookup"]["diff"]
    assert "over lookup alone" in table.lookup_verdict
    last = summary["last-1"]
    assert last["diff_lo"] <= last["diff"] <= last["diff_hi"] and last["verdict"] in ("better", "worse", "within noise")
    assert "the default [2 15 27]" in table.verdict or "the default" in table.verdict
    assert table.selection_verdict == ""  # no selected set in this table: nothing to pair with the control
    assert {r["role"] for r in table.timed} == {"default", "best control"}
    assert all(r["lossless_prompts"] == r["prompts"] == 1 for r in table.timed)
    assert [c["fraction"] for c in table.curve if c["layer_set"] == "default"] == [0.5, 1.0]
    assert table.info["heldout_positions"] > 0 and table.info["corpus"].startswith("sharegpt@smollm2-135m")
    again = run_speed_table(smollm, sets, settings, progress=False)  # everything comes from the cache
    assert again.rows == table.rows and again.summary == table.summary


def test_speed_table_settings_reject_unknown_keys():
    from wavesurf.speed_table import SpeedTableSettings

    with pytest.raises(WavesurfError, match=r"unknown speed-table settings \['epochs'\]"):
        SpeedTableSettings.from_profile({"epochs": 3})


def test_verdict_sentence_names_sets_intervals_and_counts():
    from wavesurf.speed_table import verdict_sentence

    def row(name, group, ids, tau, diff, lo, hi, verdict):
        return {"layer_set": name, "group": group, "layer_ids": ids, "tau": tau, "diff": diff, "diff_lo": lo,
                "diff_hi": hi, "verdict": verdict}

    info = {"draft_len": 4, "level": 0.95, "heldout_sequences": 15, "heldout_positions": 4212, "seeds": 1}
    summary = [row("default", "default", "2 15 27", 1.304, 0, 0, 0, "reference"),
               row("entropy", "selected", "17 22 27", 1.310, 0.006, -0.014, 0.029, "within noise"),
               row("last-1", "control", "30", 1.242, -0.062, -0.086, -0.040, "worse"),
               row("bigram", "floor", "", 1.256, -0.048, -0.081, -0.010, "worse")]
    text = verdict_sentence(summary, info)
    assert text.startswith("No layer set beats the default [2 15 27] (τ = 1.304) beyond its 95% interval")
    assert "entropy [17 22 27] by +0.006 τ (95% CI -0.014 to +0.029)" in text
    # the floor is not a layer set; one worse set and one seed read in the singular
    assert "1 set is worse" in text and "1 training seed per set" in text and "4,212 tokens" in text
    summary[1].update(diff=0.02, diff_lo=0.01, diff_hi=0.03, verdict="better")
    info["seeds"] = 2
    text = verdict_sentence(summary, info)
    assert text.startswith("1 of 2 layer sets beat the default [2 15 27]") and "2 training seeds per set" in text


def test_selection_sentence_pairs_the_best_selected_set_with_the_best_control():
    """The paired difference selected - control decides the verb; the interval is quoted."""
    from wavesurf.speed_table import selection_sentence

    sel = {"layer_set": "entropy", "layer_ids": "17 22 27", "tau": 1.271}
    ctl = {"layer_set": "random-1", "layer_ids": "16 19 24", "tau": 1.270}
    info = {"level": 0.95}
    same = {"diff": 0.001, "diff_lo": -0.011, "diff_hi": 0.013, "diff_seed_min": -0.004, "diff_seed_max": 0.005}
    text = selection_sentence(sel, ctl, same, info)
    assert text == ("The best selected set, entropy [17 22 27] (τ = 1.271), does not differ beyond the interval from "
                    "the best control, random-1 [16 19 24] (τ = 1.270): +0.001 τ (95% CI -0.011 to +0.013).")
    ahead = {"diff": 0.02, "diff_lo": 0.01, "diff_hi": 0.03, "diff_seed_min": 0.015, "diff_seed_max": 0.025}
    assert " beats the best control" in selection_sentence(sel, ctl, ahead, info)
    # an interval that excludes 0 while one seed disagrees is not a win (classify's rule)
    assert "does not differ" in selection_sentence(sel, ctl, {**ahead, "diff_seed_min": -0.001}, info)
    behind = {"diff": -0.02, "diff_lo": -0.03, "diff_hi": -0.01, "diff_seed_min": -0.025, "diff_seed_max": -0.015}
    assert "falls behind the best control" in selection_sentence(sel, ctl, behind, info)
