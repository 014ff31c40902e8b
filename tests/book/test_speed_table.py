"""The speed-table experiment: settings, one head per set and seed, floors, intervals, the summary."""
from __future__ import annotations

import pytest

from wavesurf.errors import WavesurfError


def test_run_speed_table_trains_each_set_and_seed_once(smollm):
    """The smoke profile end to end: distilled corpora, one head per set and seed, offline tau with
    paired intervals, a bigram floor, timed runs and the curve; a re-run only reads the cache."""
    from wavesurf.book.profiles import get_profile
    from wavesurf.book.speed_table import SpeedTableSettings, run_speed_table
    from wavesurf.book.table_sets import LayerSet

    settings = SpeedTableSettings.from_profile(get_profile("smoke").drafter)
    settings.seeds = (0, 1)
    settings.primary = "last-1"  # the one comparison named before the run
    sets = [LayerSet("default", "default", [2, 15, 27], "rule"), LayerSet("last-1", "control", [30], "top")]
    table = run_speed_table(smollm, sets, settings, progress=False)
    assert [(r["layer_set"], r["seed"]) for r in table.rows] == [("default", 0), ("default", 1), ("last-1", 0), ("last-1", 1)]
    assert len({r["drafter"] for r in table.rows}) == 4  # one drafter per set and seed
    assert len({r["train_tokens"] for r in table.rows}) == 1  # one budget for every set and seed
    assert table.rows[0]["train_tokens"] >= 0.5 * settings.train.train_tokens
    assert all(1.0 <= r["tau_1"] <= r["tau_3"] <= 4.0 for r in table.rows)  # a longer chain never commits less
    summary = {s["layer_set"]: s for s in table.summary}
    assert set(summary) == {"default", "last-1", "bigram", "lookup", "embedding-only"}
    assert summary["bigram"]["group"] == summary["lookup"]["group"] == summary["embedding-only"]["group"] == "floor"
    # the embedding-only control: trained (2 seeds, varies with the seed), compared with the default unadjusted
    control = summary["embedding-only"]
    assert control["seeds"] == 2 and control["diff_lo"] <= control["diff"] <= control["diff_hi"]
    rank = table.info["can_rank"]
    assert set(rank) == {"bigram", "embedding-only", "ok"}
    assert rank["ok"] == (rank["bigram"]["beaten"] and rank["embedding-only"]["beaten"])
    if not rank["ok"]:  # tiny smoke heads: the verdict says first that the table cannot rank sets
        assert table.verdict.startswith("At this training budget") and "cannot rank layer sets" in table.verdict
    # where the bigram floor misses: a rate with its interval per set and for the control
    for name in ("default", "last-1", "embedding-only"):
        r = summary[name]
        assert 0.0 <= r["rescue_lo"] <= r["rescue"] <= r["rescue_hi"] <= 1.0 and r["floor_misses"] > 0
    # which layer each head listens to: shares sum to one per set; the default set's ablations
    shares = {}
    for r in table.streams:
        shares.setdefault(r["layer_set"], []).append(r["share"])
    assert set(shares) == {"default", "last-1"} and all(abs(sum(v) - 1) < 1e-3 for v in shares.values())
    ablated = [r for r in table.streams if r["layer_set"] == "default"]
    assert [r["layer_id"] for r in ablated] == [2, 15, 27]
    assert all(r["drop_lo"] <= r["drop"] <= r["drop_hi"] for r in ablated)
    assert summary["lookup"]["tau"] >= 1.0
    d = summary["default"]
    assert d["seeds"] == 2 and d["tau_lo"] <= d["tau"] <= d["tau_hi"] and d["verdict"] == "reference"
    assert d["diff"] == 0.0  # the default paired with itself
    # what each interval rests on: both seeds and every held-out sequence, resampled together
    n_seq = table.info["heldout_sequences"]
    assert all(r["seeds"] == 2 and r["sequences"] == n_seq and r["interval"] == f"2 seeds x {n_seq} sequences"
               for r in table.summary)
    assert d["diff_interval"] == "reference" and table.info["interval"] == d["interval"]
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
    # one layer set against the default is a family of one: the per-comparison interval
    assert last["diff_interval"] == "per-comparison 95%" and table.info["family"]["comparisons"] == 1
    assert (last["diff_lo"], last["diff_hi"]) == (last["diff_unadj_lo"], last["diff_unadj_hi"])
    assert last["diff_se"] > 0 and last["diff_df"] >= 1 and summary["bigram"]["tau_seed_std"] == 0.0
    assert "the default [2 15 27]" in table.verdict or "the default" in table.verdict
    assert table.info["null"]["random_sets"] == 0 and "too few to rank" in table.selection_verdict
    prim = table.info["primary"]
    assert prim["layer_set"] == "last-1" and (prim["diff_lo"], prim["diff_hi"]) == (last["diff_unadj_lo"], last["diff_unadj_hi"])
    assert "Primary comparison (named before the run): last-1 [30]" in table.verdict
    assert {r["role"] for r in table.timed} == {"default", "best control"}
    assert all(r["lossless_prompts"] == r["prompts"] == 1 for r in table.timed)
    assert [c["fraction"] for c in table.curve if c["layer_set"] == "default"] == [0.5, 1.0]
    assert table.info["heldout_positions"] > 0 and table.info["corpus"].startswith("sharegpt@smollm2-135m")
    again = run_speed_table(smollm, sets, settings, progress=False)  # everything comes from the cache
    assert again.rows == table.rows and again.summary == table.summary


def test_speed_table_settings_reject_unknown_keys():
    from wavesurf.book.speed_table import SpeedTableSettings

    with pytest.raises(WavesurfError, match=r"unknown speed-table settings \['epochs'\]"):
        SpeedTableSettings.from_profile({"epochs": 3})
    for bad in (0, 1, 1.2, -0.1, True):
        with pytest.raises(WavesurfError, match=r"acceptance family_level=.* must be a number in \(0, 1\)"):
            SpeedTableSettings.from_profile({"acceptance": {"family_level": bad}})
    assert SpeedTableSettings.from_profile({"acceptance": {"family_level": 0.9}}).acceptance.family_level == 0.9
    for bad in (0, 1.5, "1"):  # the held-out turns are checked with the rest before anything runs
        with pytest.raises(WavesurfError, match=r"max_turns=.* must be a positive integer"):
            SpeedTableSettings.from_profile({"distill": {"heldout_max_turns": bad}})
    assert SpeedTableSettings.from_profile({"distill": {"heldout_max_turns": 1}}).distill.heldout_max_turns == 1


#: the default profile's head-training fingerprint (seed 0) as computed before the speed table's
#: settings were typed: every cached head's key rests on it, so it must not change
DEFAULT_PROFILE_TRAIN_FINGERPRINT = {
    "batch_tokens": 128, "betas": [0.9, 0.95], "draft_vocab_size": 4096, "grad_clip": 0.5, "init_lm_head": "random",
    "input_norm": "none", "lr": 0.001, "max_steps": None, "precision": "bfloat16", "schedule": "cosine", "seed": 0,
    "step_weight": 0.8, "train_tokens": 36000, "ttt_steps": 3, "vocab_tokens": None, "warmup_steps": 10,
    "weight_decay": 0.0}


def test_default_profile_keeps_its_train_fingerprint_and_store_settings():
    from dataclasses import asdict, replace

    from wavesurf.book.profiles import get_profile
    from wavesurf.book.speed_table import SpeedTableSettings

    st = SpeedTableSettings.from_profile(get_profile("default").drafter)
    # precision "auto" is settled by train_drafter before it fingerprints: on a CPU with native
    # bfloat16 (where the default's pages were made) the heads keep their keys
    assert st.train.precision == "auto"
    native = replace(st.train, seed=0, precision="bfloat16")
    assert native.fingerprint() == DEFAULT_PROFILE_TRAIN_FINGERPRINT
    assert replace(native, embedding_only=True).fingerprint() == {
        **DEFAULT_PROFILE_TRAIN_FINGERPRINT, "embedding_only": True}
    assert asdict(st.features) == {"dataset": "sharegpt", "split": "train", "split_seed": 0, "max_tokens": 200_000,
                                   "max_len": 512, "batch_tokens": 4096, "layer_ids": None, "dtype": "float16"}
    # the held-out answers changed on purpose (issue 31: first answers of ~100 conversations, >= 15k
    # scored tokens, instead of every answer of 15); the training answers, and so every head's store, did not
    assert asdict(st.distill) == {"train_tokens": 24_000, "heldout_tokens": 19_000, "heldout_max_turns": 1,
                                  "max_new_tokens": 256, "max_len": 512, "chunk_examples": 16, "batch_size": 16}


def test_a_partial_part_gets_the_same_defaults_as_a_missing_one():
    from wavesurf.book.speed_table import SpeedTableSettings

    whole = SpeedTableSettings()
    assert whole.acceptance.lookup_ngram == 3
    for part, given in (("acceptance", {"draft_len": 4}), ("train", {"ttt_steps": 4}), ("distill", {"max_len": 1024}),
                        ("features", {"batch_tokens": 4096}), ("bench", {"n_prompts": 3})):
        assert getattr(SpeedTableSettings.from_profile({part: given}), part) == getattr(whole, part), part
    assert SpeedTableSettings.from_profile({"train": {"frozen": ["fc"]}}).train.frozen == ("fc",)


def test_sets_with_different_numbers_of_seeds(smollm):
    """The long profile's design in small: the default set, the primary comparison and the
    embedding-only control get more seeds than the other sets, a random set of the null one; every
    summary row says what its interval rests on, and the one-seed set's interval carries the seed
    variance pooled from the others (wider than its sequences alone)."""
    from wavesurf.book.profiles import get_profile
    from wavesurf.book.speed_table import SpeedTableSettings, run_speed_table
    from wavesurf.book.table_sets import LayerSet

    settings = SpeedTableSettings.from_profile({**get_profile("smoke").drafter, "seeds": [0],
                                                "primary_seeds": [0, 1], "primary": "last-1", "curve_fractions": []})
    # layers the test above stored already (2, 15, 27, 30): its stores and heads come from the cache
    sets = [LayerSet("default", "default", [2, 15, 27], "rule"), LayerSet("last-1", "control", [30], "top"),
            LayerSet("random-1", "control", [15], "random")]
    table = run_speed_table(smollm, sets, settings, progress=False)
    assert [(r["layer_set"], r["seed"]) for r in table.rows] == [("default", 0), ("default", 1), ("last-1", 0),
                                                                 ("last-1", 1), ("random-1", 0)]
    summary = {s["layer_set"]: s for s in table.summary}
    assert {n: summary[n]["seeds"] for n in ("default", "last-1", "random-1", "embedding-only")} == {
        "default": 2, "last-1": 2, "random-1": 1, "embedding-only": 2}
    lone = summary["random-1"]
    # its seed part is the pooled between-seed spread of the drafters with two seeds (zero where the
    # smoke heads' seeds accept the same tokens; tested with spread in the synthetic test below)
    assert "pooled" in lone["interval"] and (lone["diff_se_seed"] > 0) == (table.info["pooled_seed_std"] > 0)
    assert lone["tau_hi"] - lone["tau_lo"] > 0 and lone["diff_lo"] <= lone["diff"] <= lone["diff_hi"]
    assert table.info["seed_counts"]["default, primary and control"] == 2
    assert "(2 for the default, primary and control)" in table.verdict
    assert table.compare("random-1", "default")["baseline_seeds"] == 2


def test_seed_lists_are_checked():
    from wavesurf.book.speed_table import SpeedTableSettings
    from wavesurf.book.table_sets import LayerSet

    with pytest.raises(WavesurfError, match=r"primary_seeds=\[1, 2\] must start with seeds=\[0, 1\]"):
        SpeedTableSettings.from_profile({"seeds": [0, 1], "primary_seeds": [1, 2]})
    with pytest.raises(WavesurfError, match=r"null_seeds=\[1\] must be a prefix of seeds=\[0, 1\]"):
        SpeedTableSettings.from_profile({"seeds": [0, 1], "null_seeds": [1]})
    with pytest.raises(WavesurfError, match=r"seeds=\(0, 0\) must be distinct non-negative integer seeds"):
        SpeedTableSettings.from_profile({"seeds": [0, 0]})
    st = SpeedTableSettings.from_profile({"seeds": [0, 1], "primary_seeds": [0, 1, 2], "null_seeds": [0]})
    default, combined = LayerSet("default", "default", [2, 15, 27], "rule"), LayerSet("combined", "selected", [8], "m")
    assert st.seeds_for(default) == (0, 1, 2) and st.seeds_for(combined, combined) == (0, 1, 2)
    assert st.seeds_for(combined) == (0, 1) and st.seeds_for(LayerSet("random-3", "control", [4], "r")) == (0,)


def test_a_part_refuses_an_unknown_key_naming_it_and_the_allowed_ones():
    from wavesurf.book.speed_table import SpeedTableSettings

    with pytest.raises(WavesurfError, match=r"unknown acceptance settings \['lookup'\]; allowed: draft_len, "
                                            r"max_draft_len, n_boot, level, family_level, lookup_ngram"):
        SpeedTableSettings.from_profile({"acceptance": {"lookup": 3}})
    with pytest.raises(WavesurfError, match=r"unknown train settings \['epochs'\]; allowed: ttt_steps, .*draft_vocab"):
        SpeedTableSettings.from_profile({"train": {"epochs": 3}})
    with pytest.raises(WavesurfError, match=r"unknown train settings \['seed'\]"):  # the table's seeds set it
        SpeedTableSettings.from_profile({"train": {"seed": 3}})
    with pytest.raises(WavesurfError, match=r"unknown features settings \['dataset'\]; allowed: split_seed, max_len"):
        SpeedTableSettings.from_profile({"features": {"dataset": "sharegpt"}})
    with pytest.raises(WavesurfError, match=r"unknown distill settings \['tokens'\]; allowed: train_tokens"):
        SpeedTableSettings.from_profile({"distill": {"tokens": 5}})
    with pytest.raises(WavesurfError, match=r"unknown bench settings \['prompts'\]; allowed: n_prompts"):
        SpeedTableSettings.from_profile({"bench": {"prompts": 5}})
    with pytest.raises(WavesurfError, match="train=3 must be a TrainSettings or a dict of its fields"):
        SpeedTableSettings(train=3)


def test_primary_comparison_is_checked_before_training():
    from wavesurf.book.speed_table import _primary_set
    from wavesurf.book.table_sets import LayerSet

    sets = [LayerSet("default", "default", [2, 15, 27], "rule"), LayerSet("combined", "selected", [1, 6, 29], "x",
                                                                          aliases=["cka+filter"])]
    assert _primary_set(sets, "cka+filter").name == "combined" and _primary_set(sets, "") is None
    with pytest.raises(WavesurfError, match=r"primary='entropy' names no layer set this table trains; choose one of "
                                            r"cka\+filter, combined, default"):
        _primary_set(sets, "entropy")
    sets[1].aliases.append("x")
    sets[0].aliases.append("aggregate")
    with pytest.raises(WavesurfError, match="chose the default set itself"):
        _primary_set(sets, "aggregate")

def test_a_one_seed_set_gets_the_seed_variance_pooled_from_the_others():
    """Synthetic acceptance counts whose seeds differ: the set trained with one seed carries the
    between-seed variance of the two-seed drafters, so its interval is wider than its sequences
    alone give (the long profile's design)."""
    import numpy as np

    from wavesurf.drafter.acceptance import Acceptance
    from wavesurf.book.speed_table import AcceptanceSettings, _family_intervals, _summary_row
    from wavesurf.book.table_sets import LayerSet

    rng = np.random.default_rng(1)
    cycles = rng.integers(10, 60, size=(30, 1))

    def run(name, p):  # each seed shifts the whole head's rate: a between-seed effect
        committed = cycles + rng.binomial(4 * cycles, p + rng.normal(0, 0.03))
        return Acceptance(name, 1, [str(i) for i in range(30)], committed, cycles.copy(), np.ones(1, np.int64),
                          np.full(1, 2, np.int64), int(committed.sum()), 0)

    sets = [LayerSet("default", "default", [2, 15, 27], "rule"), LayerSet("entropy", "selected", [17, 22, 27], "m"),
            LayerSet("random-1", "control", [16, 19, 24], "r")]
    runs = [[run("default", 0.3), run("default", 0.3)], [run("entropy", 0.32), run("entropy", 0.32)],
            [run("random-1", 0.3)]]
    acc_cfg = AcceptanceSettings(draft_len=1, level=0.95, family_level=0.95, n_boot=400)
    iv = _family_intervals(runs, sets, acc_cfg)
    rows = [_summary_row(s.name, s.group, s.aliases, s.layer_ids, runs[i], iv, i, acc_cfg) for i, s in enumerate(sets)]
    lone, pair = rows[2], rows[1]
    assert iv.pooled_seed_std > 0 and "pooled" in lone["interval"] and lone["seeds"] == 1
    assert lone["diff_se_seed"] > 0 and lone["diff_se"] > lone["diff_se_seq"]
    assert pair["interval"] == "2 seeds x 30 sequences" and pair["diff_se_seed"] >= 0


@pytest.mark.parametrize("n_seeds", [1, 2])
def test_summary_rows_from_synthetic_runs_carry_both_intervals_and_their_basis(n_seeds):
    """The summary's intervals without training a head: three layer sets and a floor against the
    default, from synthetic acceptance counts. ``diff_lo``/``diff_hi`` are simultaneous over the
    three sets (and contain the per-comparison ``diff_unadj_*``); the floor is compared per
    comparison; every row says what its interval rests on; ``compare`` reuses the same replicates."""
    import numpy as np

    from wavesurf.drafter.acceptance import Acceptance
    from wavesurf.book.speed_table import AcceptanceSettings, SpeedTable, _family_intervals, _summary_row
    from wavesurf.book.table_sets import LayerSet

    rng = np.random.default_rng(0)
    cycles = rng.integers(10, 60, size=(30, 1))

    def run(name, p):
        committed = cycles + rng.binomial(4 * cycles, p + rng.normal(0, 0.02))
        return Acceptance(name, 1, [str(i) for i in range(30)], committed, cycles.copy(), np.ones(1, np.int64),
                          np.full(1, 2, np.int64), int(committed.sum()), 0)

    sets = [LayerSet("default", "default", [2, 15, 27], "rule"), LayerSet("entropy", "selected", [17, 22, 27], "m"),
            LayerSet("random-1", "control", [16, 19, 24], "r"), LayerSet("last-1", "control", [30], "top")]
    runs = {s.name: [run(s.name, p) for _ in range(n_seeds)] for s, p in zip(sets, (0.30, 0.33, 0.30, 0.25))}
    floor = [run("bigram", 0.1)] * n_seeds
    acc_cfg = AcceptanceSettings(draft_len=1, level=0.95, family_level=0.95, n_boot=400)
    iv = _family_intervals([runs[s.name] for s in sets] + [floor], sets, acc_cfg)
    rows = [_summary_row(s.name, s.group, s.aliases, s.layer_ids, runs[s.name], iv, i, acc_cfg)
            for i, s in enumerate(sets)] + [_summary_row("bigram", "floor", [], [], floor, iv, len(sets), acc_cfg)]
    want = "2 seeds x 30 sequences" if n_seeds == 2 else "sequences only (30 sequences; 1 seed, seed variance not estimated)"
    assert all(r["seeds"] == n_seeds and r["sequences"] == 30 and r["interval"] == want for r in rows)
    assert iv.family["comparisons"] == 3 and iv.family["level"] == 0.95
    for r in rows[1:4]:
        assert r["diff_interval"] == "simultaneous 95% (max-T over 3 comparisons)"
        assert r["diff_lo"] <= r["diff_unadj_lo"] <= r["diff"] <= r["diff_unadj_hi"] <= r["diff_hi"]
        assert (r["diff_se_seed"] > 0) == (n_seeds == 2)  # one seed: no seed part to estimate
    assert rows[4]["diff_interval"] == "per-comparison 95%" and rows[4]["diff_lo"] == rows[4]["diff_unadj_lo"]
    assert rows[4]["verdict"] == "worse" and rows[0]["diff_interval"] == "reference"
    table = SpeedTable([], rows, [], [], {"draft_len": 1, "level": 0.95, "n_boot": 400}, {**runs, "bigram": floor})
    pair = table.compare("entropy", "default")
    assert round(pair["diff"], 5) == rows[1]["diff"]
    assert (round(pair["diff_lo"], 5), round(pair["diff_hi"], 5)) == (rows[1]["diff_unadj_lo"], rows[1]["diff_unadj_hi"])
