"""Run profiles: the sizes the notebooks and ``wavesurf reproduce`` use.

``smoke`` is what CI runs through nbval (seconds per notebook), ``default`` is the main job on a
2-core CPU with the embedded default model, ``long`` the same statistics with drafters trained
longer (at most 2 hours there), ``paper`` the sizes a GPU user would pick. The table
:data:`PROFILES` is plain data; :func:`get_profile` returns it checked and typed as a
:class:`Profile` (its ``analysis`` part an :class:`AnalysisBudget`, its ``drafter`` part the keyword
settings of :class:`wavesurf.book.speed_table.SpeedTableSettings`).

The analysis part fixes the token budget, the CKA estimators (``estimator`` for the unfiltered
statistics, ``selection_estimator`` for the filtered ones selection reads, ``sweep_estimator`` for
the filter sweep and the position-0 variant; only ``exact`` keeps the cross-layer covariances that
the alpha=1 aggregate entropy and redundancy need) and the variants every statistics notebook reads:
``base`` (no filter), ``position0`` (no filter, position 0 kept), ``selection`` (the token-entropy
filter selection uses) and one ``sweep`` variant per filter of ``sweep_filters``. All variants share
one capture of the corpus (see :func:`wavesurf.book.variants.profile_stats`). Two more, ``served``
and ``served:selection``, read the positions a drafter serves: the assistant tokens of the target's
own answers that the profile's drafters train on. ``selection_positions`` names the statistics the
layer sets are selected from: ``all`` (every position of the statistics corpus, the paper's
setting) or ``served``; optional, ``all`` when left out. ``served_min_tokens`` (optional) is the
fewest positions the served variants accept, None for the rule of every variant (hidden size + 1):
only ``smoke`` lowers it, whose few answers exercise the pipeline and estimate nothing.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ProfileError

#: where the statistics that select layer sets come from: every position of the statistics corpus,
#: or the assistant tokens of the target's own answers (the positions a drafter serves)
SELECTION_POSITIONS = ("all", "served")
#: analysis keys a profile may leave out (their defaults in :class:`AnalysisBudget`)
OPTIONAL_ANALYSIS = ("selection_positions", "served_min_tokens")

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {
        "description": "seconds per notebook; what CI runs through nbval",
        "analysis": {
            # the same capture settings as the unit tests' small analysis (tests/conftest.py SMALL),
            # so both share one cached result
            "max_tokens": 1500, "max_len": 128, "batch_tokens": 1024, "pilot_tokens": 8192,
            "estimator": "auto", "selection_filter": "q0.5", "selection_estimator": "minibatch",
            "sweep_filters": ["q0.25", "q0.5"], "sweep_estimator": "minibatch", "minibatch_size": 128,
            # 4 groups of conversations: enough for intervals on the unfiltered 1,500 tokens; the
            # q0.5 subsets are too small for them and exercise the "no intervals" path
            "resample_groups": 4,
            # the ~430 assistant tokens of its 400 answer tokens, halved by q0.5, are fewer than the
            # hidden size: the served variants run the pipeline, not an estimate
            "served_min_tokens": 64,
        },
        "drafter": {
            # wavesurf.book.speed_table.SpeedTableSettings: tiny drafters, the pipeline only (tau ~1)
            # conversations of at most 128 tokens and first held-out answers only (as the default): the
            # prompts' prefill, not the 16-token answers, was most of the smoke run's answer time, and
            # the stores and their scoring grow with the prompts too
            "distill": {"train_tokens": 400, "heldout_tokens": 200, "heldout_max_turns": 1, "max_new_tokens": 16,
                        "max_len": 128, "chunk_examples": 4},
            "features": {"max_len": 128, "batch_tokens": 1024},
            "train": {"train_tokens": 1500, "ttt_steps": 2, "draft_vocab_size": 1024, "batch_tokens": 1024,
                      "warmup_steps": 2, "checkpoint_every": 50},
            "acceptance": {"draft_len": 3, "max_draft_len": 4, "n_boot": 200, "lookup_ngram": 3},
            # mode chain: "auto" times the machine first (~20 s on one core per process, for 8 tokens);
            # tests/drafter/test_adaptive.py runs the auto path on the real model
            "bench": {"n_prompts": 1, "max_new_tokens": 8, "mode": "chain", "draft_len": 3, "n_calibration": 1,
                      "lookup_ngram": 3},
            # two random sets: the null the selected set is ranked in (the least that ranks)
            "datasets": ["mt-bench"], "seeds": [0], "methods": ["combined"], "n_random": 2,
            "curve_fractions": [0.5], "primary": "combined",
        },
    },
    "default": {
        "description": "the main job on a 2-core CPU with the embedded default model",
        "analysis": {
            "max_tokens": 20_000, "max_len": 512, "batch_tokens": 4096, "pilot_tokens": 8192,
            # "auto" = exact CKA whenever the cross moments fit 8 GB (both embedded models), and the
            # same cache key as `wavesurf analyze/select --max-tokens 20000 [--filter q0.5]`
            "estimator": "auto", "selection_filter": "q0.5", "selection_estimator": "auto",
            "sweep_filters": ["q0.25", "q0.5", "q0.75"], "sweep_estimator": "minibatch", "minibatch_size": 512,
            # jackknife groups of conversations for every interval (wavesurf.stats.resampling)
            "resample_groups": 10,
        },
        "drafter": {
            # wavesurf.book.speed_table.SpeedTableSettings. The target's own greedy answers (distilled once,
            # ~33 tok/s batched on 2 cores) train every head; every set x seed gets the same budget
            # (~1 pass over the 34k-token store, ~17 s per head at ~2,100 tok/s with 3 unrolled steps,
            # bfloat16, in the fresh run of f187b1d).
            # Options from benchmarks/drafter_sweep.py (results in benchmarks/results/drafter_sweep-*.json;
            # the sweep tables before them are in the README of commit 111d6ab): at this
            # budget lr 1e-3 beat 3e-4, 3 unrolled steps matched 4 at 1.5x the speed, a 4,096-id
            # vocabulary matched larger ones, init_lm_head=target was worse; 128-token batches in
            # bfloat16 gave +0.046 tau (+0.023 to +0.072) over 1,024-token float32 batches in the same
            # training time on the Intel Xeon host (benchmarks/results/drafter_sweep-20261206T031748.json):
            # a batch below one conversation's length holds one conversation, so ~86 optimizer steps per
            # head instead of ~37; with 256-token batches (the same one conversation per step) the head beats
            # the same head reading no layer (+0.034), which at 1,024 it did not. Issue 30's fusion options at
            # 72k tokens (2 seeds, drafter_sweep-20261206T120510/T120946.json, same training time):
            # init_fc=inverse_rms +0.012 (+0.004 to +0.019) and +0.006 (-0.001 to +0.013) tau,
            # fc_precision=float32 +0.003 and +0.002, input_norm=rms -0.022 and -0.021 (worse); not yet
            # adopted here, since the pages of this profile were measured without them.
            # Held-out: the first answer of each held-out conversation only (heldout_max_turns 1), so the
            # held-out answers come from ~100 conversations (the unit every interval resamples) and every
            # round of their generation is a full batch. 19k generated tokens, since 18k gave 15,674
            # scored ones for SmolLM2-135M (long run) but 14,847 for Gemma-3-270M (profile_summary-
            # 20261206T142434.json: its answers end sooner and its template takes more); issue 31 asks 15k.
            "distill": {"train_tokens": 24_000, "heldout_tokens": 19_000, "heldout_max_turns": 1,
                        "max_new_tokens": 256, "max_len": 512, "chunk_examples": 16},
            "features": {"max_len": 512, "batch_tokens": 4096},
            "train": {"train_tokens": 36_000, "ttt_steps": 3, "draft_vocab_size": 4096, "batch_tokens": 128,
                      "lr": 1e-3, "warmup_steps": 10, "checkpoint_every": 100, "precision": "auto"},
            # precision auto: bfloat16 where the CPU has AVX512-BF16 or AMX (where it was measured faster,
            # and where every page so far was made: the same heads and cache keys as "bfloat16"),
            # float32 elsewhere: on an AVX2-only AMD EPYC bfloat16 autocast trained ~20x slower
            # (wavesurf.drafter.train.resolve_precision; benchmarks/precision_speed.py). There the main job
            # takes ~76 min (fresh clone of 45219bb: benchmarks/results/fresh_clone-20261207T104243.json; the
            # float32 heads compute-bound at ~70% of its fastest matmul), and its float32 default heads beat the
            # embedding-only control by +0.045 tau (0.030 to 0.060): profile_summary-20261207T104547.json
            # every head is scored alone (the layer question) and with n-gram lookup drafting first (what
            # runs fastest here: a small target's greedy answers repeat; wavesurf.drafter.lookup).
            # Draft lengths 1-4 are scored (the table reports 4; nothing reads 5-6): ~10.7 s per head's
            # held-out answers instead of ~16.8 s at 1-6 (measured for the long profile), ~4 min of the
            # main job's ~45 scorings, and a margin under its 60 minutes on a host running slow
            # (64 min 18 s at 1ebd0ca: benchmarks/results/fresh_clone-20261206T230658.json)
            "acceptance": {"draft_len": 4, "max_draft_len": 4, "n_boot": 2000, "lookup_ngram": 3},
            # 128 new tokens per turn: MT-bench answers run longer than 64, and a small model's repeats
            # (what lookup drafts) start later in an answer
            "bench": {"n_prompts": 3, "max_new_tokens": 128, "mode": "auto", "draft_len": 4, "n_calibration": 2,
                      "lookup_ngram": 3},
            # four random sets: the null each selected set is ranked in (two leave every percentile
            # interval at 0-100%)
            "datasets": ["mt-bench", "humaneval"], "seeds": [0, 1],
            "methods": ["entropy", "aggregate", "cka", "combined"], "n_random": 4,
            "curve_fractions": [0.25, 0.5],
        },
        # minutes per notebook of an empty-cache run on the 2-core reference machine (Intel Xeon host,
        # fresh clone of cdbf546, 2026-12-06, 56 min 25 s in all with setup, the probe and the served
        # positions inside: benchmarks/results/fresh_clone-20261206T163753.json); only the progress
        # line's ETA reads them.
        # Gemma-3-270M: one run from the warm model cache of 7333e6b (2026-12-06, 75 min of notebooks,
        # benchmarks/results/profile_summary-20261206T142434.json) on a machine that ran tests beside
        # 01 and the start of 04b, so an upper bound
        "reference_minutes": {"smollm2-135m": {
            "01_entropy_compartments": 4.89, "02_cka_dynamics": 0.1, "03_aggregate_entropy": 0.15,
            "04_token_filtering": 0.12, "04b_filtering_drafters": 41.72, "04c_served_positions": 5.22,
            "05_layer_selection": 0.29, "06_speed_table": 2.63, "07_cross_model": 0.13},
            "gemma3-270m": {
            "01_entropy_compartments": 17.46, "02_cka_dynamics": 0.17, "03_aggregate_entropy": 0.22,
            "04_token_filtering": 0.32, "04b_filtering_drafters": 49.41, "04c_served_positions": 4.4,
            "05_layer_selection": 0.32, "06_speed_table": 2.9, "07_cross_model": 0.2}},
    },
    "long": {
        # The default recipe (128-token bfloat16 batches, lr 1e-3) at 4x the tokens per head, from
        # 2x the target's answers (~2.1 passes over the ~68k-token store), so heads can get past the
        # bigram floor (issue 30); and the inference issue 31 asks for: 3 seeds for the default set,
        # the primary comparison and the embedding-only control, 2 for the other sets, 1 for each of
        # 8 random sets (the null; seed noise is then in its spread), ~100 held-out conversations
        # (first answers, the default's). The fresh-clone run of 7fa78a6 (2-core Intel host, empty
        # cache: benchmarks/results/fresh_clone-20261206T093905.json) took 2 h 02 min with 64k answers
        # and 160k tokens per head: answers 27 min (~50 tok/s), feature stores 3.5 min, 33 heads at
        # ~125 s each (training ~1,500 tok/s plus scoring), the timed runs 4.5 min; notebook 04c and
        # the probe came later and add ~6 min. The trade to stay under 2 hours (issue 31): answers
        # 64k -> 48k and tokens per head 160k -> 144k (the heads' tau was still rising at 160k, so
        # this costs a little tau), and tau scored at draft lengths 1-4 instead of 1-6 (the default's
        # since; the table reports 4; scoring a head's held-out answers took 10.7 s instead of 16.8 s,
        # measured on the default run's store); held-out answers 18k -> 19k as in the default. Measured on a fresh
        # clone of 756f820 with an empty cache (2-core Intel Xeon host, 2026-12-06): 1 h 58 min 02 s
        # with setup, exit 0 (benchmarks/results/fresh_clone-20261206T195656.json; what it found:
        # profile_summary-20261206T195711.json), notebook 04b (answers, stores, 33 heads, timed runs)
        # 102.6 min of it. Its notebook minutes are the reference below (Gemma-3-270M: the default's,
        # scaled by budgets).
        "description": "the default analysis with drafters trained on 4x the tokens per head, from 2x the target's "
                       "answers; 3 seeds for the default and primary sets, 8 random sets (under 2 hours on a "
                       "2-core CPU)",
        "analysis": None,  # filled from "default" below: the same statistics and layer sets
        # the default's drafter part with these parts changed (a part given here replaces the keys it
        # names and keeps the default's others; see _over_default below)
        "drafter": {
            "distill": {"train_tokens": 48_000},
            "train": {"train_tokens": 144_000, "checkpoint_every": 200},
            "primary_seeds": [0, 1, 2], "null_seeds": [0], "n_random": 8, "primary": "combined",
            "curve_fractions": [0.25],
        },
        "reference_minutes": {"smollm2-135m": {
            "01_entropy_compartments": 4.85, "02_cka_dynamics": 0.1, "03_aggregate_entropy": 0.15,
            "04_token_filtering": 0.12, "04b_filtering_drafters": 102.57, "04c_served_positions": 5.61,
            "05_layer_selection": 0.35, "06_speed_table": 2.95, "07_cross_model": 0.15}},
    },
    "paper": {
        "description": "the sizes a GPU user would pick (more tokens, finer filter sweep)",
        "analysis": {
            "max_tokens": 200_000, "max_len": 1024, "batch_tokens": 8192, "pilot_tokens": 16384,
            "estimator": "auto", "selection_filter": "q0.5", "selection_estimator": "auto",
            "sweep_filters": ["q0.1", "q0.25", "q0.5", "q0.75", "q0.9"], "sweep_estimator": "auto",
            "minibatch_size": 1024, "resample_groups": 20,
        },
        "drafter": {
            "distill": {"train_tokens": 2_000_000, "heldout_tokens": 50_000, "max_new_tokens": 1024, "max_len": 2048},
            "features": {"max_len": 2048, "batch_tokens": 8192},
            "train": {"train_tokens": 8_000_000, "ttt_steps": 7, "draft_vocab_size": 32000, "batch_tokens": 8192,
                      "lr": 3e-4, "warmup_steps": 200, "checkpoint_every": 500},
            "acceptance": {"draft_len": 6, "max_draft_len": 8, "n_boot": 2000, "lookup_ngram": 3},
            "bench": {"n_prompts": 80, "max_new_tokens": 256, "mode": "tree", "depth": 6, "top_k": 8,
                      "total_tokens": 48},
            "datasets": ["mt-bench", "humaneval", "sharegpt"], "seeds": [0, 1, 2],
            "methods": ["entropy", "aggregate", "cka", "combined"], "n_random": 3,
            "curve_fractions": [0.0625, 0.125, 0.25, 0.5],
        },
    },
}


def _over_default(changes: dict[str, Any]) -> dict[str, Any]:
    """The default profile's drafter part with ``changes``: a dict value updates that part's keys,
    any other value replaces the entry, so a profile states only where it departs from the default."""
    merged = copy.deepcopy(PROFILES["default"]["drafter"])
    for key, value in changes.items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else copy.deepcopy(value)
    return merged


PROFILES["long"]["analysis"] = copy.deepcopy(PROFILES["default"]["analysis"])
PROFILES["long"]["drafter"] = _over_default(PROFILES["long"]["drafter"])



def profile_names() -> list[str]:
    return list(PROFILES)


@dataclass(frozen=True)
class AnalysisBudget:
    """The statistics part of a profile (see the module docstring)."""

    max_tokens: int
    max_len: int
    batch_tokens: int
    pilot_tokens: int
    estimator: str
    selection_filter: str
    selection_estimator: str
    sweep_filters: tuple[str, ...]
    sweep_estimator: str
    minibatch_size: int
    resample_groups: int
    selection_positions: str = "all"
    served_min_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.selection_positions not in SELECTION_POSITIONS:
            raise ProfileError(f"analysis selection_positions={self.selection_positions!r} is not one of "
                               f"{SELECTION_POSITIONS}")
        if self.served_min_tokens is not None and not (isinstance(self.served_min_tokens, int)
                                                       and self.served_min_tokens >= 2):
            raise ProfileError(f"analysis served_min_tokens={self.served_min_tokens!r} must be an integer >= 2 "
                               "or None (the hidden size + 1)")


@dataclass(frozen=True)
class Profile:
    """One run profile, checked: a description, the analysis budget, the drafter settings (a fresh
    dict per profile object, so callers may change it) and the reference minutes per model and
    notebook that the progress line's estimate starts from."""

    name: str
    description: str
    analysis: AnalysisBudget
    drafter: dict[str, Any] = field(default_factory=dict)
    reference_minutes: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, name: str, spec: dict[str, Any]) -> "Profile":
        known = {"description", "analysis", "drafter", "reference_minutes"}
        unknown = sorted(set(spec) - known)
        if unknown or "analysis" not in spec:
            raise ProfileError(f"profile {name!r}: keys {unknown or ['analysis (missing)']} are not allowed; "
                               f"a profile has {sorted(known)}")
        names = {f.name for f in fields(AnalysisBudget)}
        given = set(spec["analysis"]) | set(OPTIONAL_ANALYSIS)
        if given != names:
            raise ProfileError(f"profile {name!r}: analysis keys missing {sorted(names - given)}, "
                               f"unknown {sorted(given - names)}")
        analysis = AnalysisBudget(**{**spec["analysis"], "sweep_filters": tuple(spec["analysis"]["sweep_filters"])})
        return cls(name, str(spec.get("description", "")), analysis, copy.deepcopy(spec.get("drafter", {})),
                   copy.deepcopy(spec.get("reference_minutes", {})))


def get_profile(name: str) -> Profile:
    """Profile ``name``, checked and typed; the drafter part is a copy (callers may change it)."""
    if not isinstance(name, str) or name not in PROFILES:
        raise ProfileError(f"unknown profile {name!r}; available: {', '.join(PROFILES)}")
    return Profile.from_dict(name, PROFILES[name])


# ---------------------------------------------------------------------------------------------
# Progress estimates for profiles without measured reference times

#: the profile whose measured ``reference_minutes`` are scaled for profiles that have none
BASE_PROFILE = "default"
#: notebooks whose time follows the drafter budgets (they generate the target's answers, train and
#: time every head); every other notebook with a reference time follows the analysis token budget
DRAFTER_NOTEBOOKS = ("04b_filtering_drafters",)
#: tokens per second of the work a drafter notebook does, read off notebook 04b's progress bars in
#: an empty-cache default run on the 2-core AMD EPYC host (fresh clone of a70f5f3, 2026-12-04):
#: the target's batched greedy answers (28k tokens in 16.4 min), head training with each head's
#: offline scoring (36k tokens in ~47 s), the feature stores (prompts and answers, 40k tokens at
#: ~380 tok/s) and timed decoding (HF greedy and a head, 128 tokens per prompt, 4.6k tokens in
#: 6 min); loading, cost measurement and tuning add roughly a fixed minute. Only the ratios matter:
#: the estimate scales the base profile's measured minutes by the ratio of the two profiles' work.
#: Checked against the long profile's fresh-clone run (commit 352a39b, same host): at the start of
#: 04b it estimated ~115 min, and 04b took 91 min; that run's own rates (answers 51 tok/s, bfloat16
#: training with scoring ~1,320 tok/s, stores 400 tok/s, timed 15 tok/s) move the ratio by under 2%.
DRAFTER_TOKENS_PER_S = {"distill": 28.5, "train": 770.0, "features": 380.0, "bench": 12.8}
DRAFTER_FIXED_S = 60.0
#: head training tokens/s relative to float32, by ``TrainSettings.precision`` (benchmarks/drafter_sweep.py
#: on the AMD EPYC host, which has AVX512-BF16: 1,485 vs 1,030 tok/s at the default profile's settings)
#: "auto" as on the reference machines, which have native bfloat16 (the ETA is a ratio of budgets there;
#: a host that trains slower shows in the run's own pace)
TRAIN_PRECISION_SPEEDUP = {"float32": 1.0, "bfloat16": 1.44, "auto": 1.44}
#: conversation tokens per generated answer token in the feature stores (prompts come along)
STORE_TOKENS_PER_ANSWER_TOKEN = 1.4
#: heads timed per dataset by the speed table (the default set, the best selected set, the best control)
TIMED_HEADS = 3


def drafter_work_seconds(drafter: dict[str, Any]) -> float:
    """Seconds a profile's ``drafter`` budgets take on the reference machine, by the rates of
    :data:`DRAFTER_TOKENS_PER_S`. The number of layer sets is known only after selection, so it is
    bounded by what the settings allow (the default set, each method with and without the filter,
    3 fixed controls, the random sets); sets that coincide make the true count smaller."""
    from .speed_table import SpeedTableSettings  # the speed table's own defaults fill what a profile omits

    st = SpeedTableSettings.from_profile(drafter)
    n_selected = 2 * len(st.methods) + 3  # each method with and without the filter, 3 fixed controls
    k_lead = len(st.primary_seeds or st.seeds)  # the default set, the embedding-only control and the primary set
    heads = (3 * k_lead + (n_selected - 1) * len(st.seeds) + st.n_random * len(st.null_seeds or st.seeds)
             + 2 * sum(st.curve_fractions))
    tuned = st.bench.n_calibration if st.bench.auto else 0  # only mode 'auto' tunes on calibration prompts
    timed_tokens = TIMED_HEADS * len(st.datasets) * 2 * (st.bench.n_prompts + tuned) * st.bench.max_new_tokens
    rate = DRAFTER_TOKENS_PER_S
    answers = st.distill.train_tokens + st.distill.heldout_tokens
    train_speedup = TRAIN_PRECISION_SPEEDUP[st.train.precision]
    return (DRAFTER_FIXED_S + answers / rate["distill"] + answers * STORE_TOKENS_PER_ANSWER_TOKEN / rate["features"]
            + heads * (st.train.train_tokens or 0) / (rate["train"] * train_speedup) + timed_tokens / rate["bench"])


def scaled_reference_minutes(profile: Profile) -> dict[str, dict[str, float]]:
    """Reference minutes per model: the profile's own where that model was measured with it, else
    the base profile's, scaled per notebook by the ratio of the budgets that notebook's time
    follows (the analysis token budget, or :func:`drafter_work_seconds` for
    :data:`DRAFTER_NOTEBOOKS`). Made for the CPU that measured them: on a GPU the ratio of CPU
    throughputs says nothing, and callers should not use it there."""
    base = get_profile(BASE_PROFILE)
    analysis_ratio = profile.analysis.max_tokens / base.analysis.max_tokens
    base_work = drafter_work_seconds(base.drafter)
    drafter_ratio = drafter_work_seconds(profile.drafter) / base_work if base_work else 1.0
    scaled = {model: {stem: minutes * (drafter_ratio if stem in DRAFTER_NOTEBOOKS else analysis_ratio)
                      for stem, minutes in notebooks.items()}
              for model, notebooks in base.reference_minutes.items()}
    return {**scaled, **profile.reference_minutes}
