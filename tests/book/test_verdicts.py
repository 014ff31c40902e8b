"""What the speed table can say, in sentences: winners with simultaneous intervals, floors first,
the null of random sets."""
from __future__ import annotations

import numpy as np
import pytest


def test_verdict_sentence_names_sets_intervals_and_counts():
    from wavesurf.book.verdicts import verdict_sentence

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
    assert "intervals resample held-out sequences only (1 training seed" in text  # said, not silently seed-free
    summary[1].update(diff=0.02, diff_lo=0.01, diff_hi=0.03, verdict="better")
    info["seeds"] = 2
    text = verdict_sentence(summary, info)
    assert text.startswith("1 of 2 layer sets beat the default [2 15 27]") and "2 training seeds per set" in text
    assert "intervals resample held-out sequences and training seeds" in text
    # the table's intervals are simultaneous over its family of comparisons: the sentence says so
    info["family"] = {"comparisons": 11, "level": 0.95, "method": "max-T", "crit": 2.9, "alpha_per_comparison": 0.005}
    text = verdict_sentence(summary, info)
    assert "entropy [17 22 27] by +0.020 τ (simultaneous 95% CI +0.010 to +0.030)" in text
    assert "simultaneous over the 11 comparisons with the default (max-T)" in text
    summary[1].update(verdict="within noise")
    assert verdict_sentence(summary, info).startswith(
        "No layer set beats the default [2 15 27] (τ = 1.304) beyond its simultaneous 95% interval")
    # heads level with a floor: the sentence says first that the table cannot rank layer sets
    info["can_rank"] = {"bigram": {"beaten": False, "margin": -0.046, "margin_lo": -0.07, "margin_hi": -0.02, "tau": 1.152},
                        "embedding-only": {"beaten": True, "margin": 0.03, "margin_lo": 0.01, "margin_hi": 0.05,
                                           "tau": 1.07}, "ok": False}
    text = verdict_sentence(summary, info)
    assert text.startswith("At this training budget the heads of the default [2 15 27] (τ = 1.304) do not beat the "
                           "bigram floor (τ = 1.152; margin -0.046, 95% CI -0.070 to -0.020), so this table cannot rank")
    assert "embedding-only" not in text.split("so this table")[0]
    info["can_rank"]["ok"] = True
    assert verdict_sentence(summary, info).startswith("No layer set beats")


def test_null_percentiles_rank_a_set_among_random_sets():
    """A set better than every random set sits at the top of the null with an interval that stays
    high; one in the middle gets an interval around 50%; the sentence quotes both."""
    from wavesurf.drafter.intervals import null_percentiles
    from wavesurf.book.verdicts import null_sentence

    rng = np.random.default_rng(0)
    G, K, S = 10, 2, 40
    cycles = rng.integers(20, 40, size=(G, K, S))
    rate = np.linspace(1.20, 1.30, 8)  # the null: 8 random sets
    taus = np.concatenate([[1.40, 1.25], rate])
    committed = np.round(cycles * (taus[:, None, None] + rng.normal(0, 0.05, size=(G, K, S)))).astype(int)
    top, mid = null_percentiles(committed, cycles, [0, 1], list(range(2, 10)), n_boot=1000)
    assert top["percentile"] == 1.0 and top["percentile_lo"] >= 0.875 and top["null_sets"] == 8
    assert 0.25 <= mid["percentile"] <= 0.75 and mid["percentile_lo"] < 0.5 < mid["percentile_hi"]
    with pytest.raises(Exception, match="at least 2 random layer sets"):
        null_percentiles(committed, cycles, [0], [2])
    null = {"random_sets": 8, "rows": [{"layer_set": "entropy", "layer_ids": "17 22 27", **top},
                                       {"layer_set": "cka", "layer_ids": "5 9 20", **mid}]}
    text = null_sentence(null, {"level": 0.95})
    assert text.startswith("Against 8 random layer sets") and "entropy [17 22 27] at 100% (95% CI" in text
    assert "1 of 2 rank above the middle of the null beyond the interval" in text and "below it" not in text
    low = dict(mid, percentile=0.25, percentile_lo=0.125, percentile_hi=0.375)  # under every draw of the middle
    text = null_sentence({"random_sets": 8, "rows": [{"layer_set": "cka", "layer_ids": "5 9 20", **low}]},
                         {"level": 0.95})
    assert text.endswith("none ranks above the middle of the null beyond its interval, and 1 of 1 rank below it "
                         "beyond the interval (worse than a typical random set of the same size).")
    assert "too few to rank" in null_sentence({"random_sets": 1, "rows": [], "note": "1 random layer set: too few to rank "
                                                                               "the selected sets against (at least 2)"}, {})
    # heads that do not beat their floors: the ranks are printed, led by a note that they are not evidence
    cannot = {"level": 0.95, "can_rank": {"ok": False, "bigram": {"beaten": False}}}
    assert null_sentence(null, cannot).startswith("Not evidence either way, since the heads do not beat their floors")
    assert null_sentence(null, {"level": 0.95, "can_rank": {"ok": True}}).startswith("Against 8 random layer sets")
    # the introduction's passage: the note once, then the ranks, then the criteria
    from wavesurf.book.verdicts import question_answer

    text = question_answer({**cannot, "null": null}, "Across the 8 trained layer sets, ...")
    assert text.count("Not evidence either way") == 1 and text.startswith("Not evidence either way")
    assert text.index("Against 8 random layer sets") < text.index("Across the 8 trained layer sets")
    assert question_answer({"level": 0.95, "can_rank": {"ok": True}, "null": null}, "C.").startswith("Against 8")
