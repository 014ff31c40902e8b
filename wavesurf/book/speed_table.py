"""The speed-table experiment: do entropy/CKA-selected layer sets give a drafter that accepts more
tokens than the default ``[2, N//2, N-3]``? One head per layer set and training seed on the
target's own answers, scored by exact offline acceptance with floors, controls and two-level
intervals, then timed. The sets come from :mod:`wavesurf.book.table_sets`, the sentences from
:mod:`wavesurf.book.verdicts`.

Over ~450 lines because the settings, the run and its result type belong together: the run reads
every settings part, and the result's methods re-derive intervals from the run's own data.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..bench import BenchSettings
from ..distill import DEFAULT_BATCH_SIZE, DEFAULT_CHUNK_EXAMPLES
from ..drafter.features import FeatureSettings
from ..drafter.train import TrainSettings
from ..errors import WavesurfError, is_int
from ..models import to_sglang
from .table_sets import SELECTION_METHODS, LayerSet, is_random_set
from .verdicts import CONTROL, classify, lookup_sentence, null_sentence, verdict_sentence

if TYPE_CHECKING:
    from ..models import Target

@dataclass(frozen=True)
class DistillBudget:
    """The target's own greedy answers (:func:`wavesurf.distill.distill_corpus`) to ShareGPT prompts:
    ``train_tokens`` generated tokens of the training split for the drafters, ``heldout_tokens`` of
    the held-out split for offline acceptance, ``max_new_tokens`` per answer and ``max_len`` per
    conversation; ``heldout_max_turns`` answers only the first turns of each held-out conversation
    (1: one answer each, so the held-out budget spreads over more conversations, the unit the
    intervals resample; None: every turn); ``chunk_examples`` (conversations per cache chunk, which
    bounds how far generation runs past the budget) and ``batch_size`` change speed, not the answers."""

    train_tokens: int = 60_000
    heldout_tokens: int = 20_000
    heldout_max_turns: int | None = None
    max_new_tokens: int = 256
    max_len: int = 1024
    chunk_examples: int = DEFAULT_CHUNK_EXAMPLES
    batch_size: int = DEFAULT_BATCH_SIZE


@dataclass(frozen=True)
class AcceptanceSettings:
    """How the heads are scored offline: ``draft_len`` (the chain length the table reports),
    ``max_draft_len`` (lengths scored), ``n_boot`` and ``level`` of the bootstrap intervals,
    ``family_level`` (None: ``level``) of the simultaneous intervals of the comparisons with the
    default set, ``lookup_ngram`` (n > 0: every head is also scored drafting with n-gram lookup
    first, as the timed runs decode when ``bench.lookup_ngram`` is set; 0: the head alone only)."""

    draft_len: int = 4
    max_draft_len: int = 6
    n_boot: int = 2000
    level: float = 0.95
    family_level: float | None = None
    lookup_ngram: int = 3

    @property
    def simultaneous_level(self) -> float:
        """The level of the simultaneous intervals (``family_level``, else ``level``)."""
        return self.level if self.family_level is None else self.family_level

    def check(self) -> None:
        if not is_int(self.draft_len, 1, self.max_draft_len):
            raise WavesurfError(f"acceptance draft_len={self.draft_len!r} must be an integer in 1..max_draft_len")
        for key in ("level", "family_level"):
            value = getattr(self, key)
            if key == "family_level" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise WavesurfError(f"acceptance {key}={value!r} must be a number in (0, 1), e.g. 0.95")
        from ..drafter.lookup import check_lookup_ngram

        check_lookup_ngram(self.lookup_ngram, name="acceptance lookup_ngram", error=WavesurfError)


#: the parts of :class:`SpeedTableSettings` that are settings of their own: name -> (class, fields
#: the table sets itself and a profile may not)
_PARTS: dict[str, tuple[type, tuple[str, ...]]] = {
    "distill": (DistillBudget, ()),
    "features": (FeatureSettings, ("dataset", "split", "max_tokens", "layer_ids")),
    "train": (TrainSettings, ("seed",)),
    "acceptance": (AcceptanceSettings, ()),
    "bench": (BenchSettings, ()),
}


@dataclass
class SpeedTableSettings:
    """Budgets of the speed table (a profile's ``"drafter"`` dict fills these).

    Each part is settings of its own, and a profile gives any of its fields as a dict: what the
    dict leaves out comes from this class's default of that part, the same as when the profile
    leaves out the whole part. ``distill``: a :class:`DistillBudget`; ``features``: the
    :class:`~wavesurf.drafter.features.FeatureSettings` of both stores except the corpus (the
    table sets ``dataset``, ``split``, ``max_tokens`` and ``layer_ids``: both stores hold the union
    of the sets' layer ids); ``train``: the :class:`~wavesurf.drafter.train.TrainSettings`,
    identical for every set (the table sets ``seed`` from ``seeds``); ``acceptance``: an
    :class:`AcceptanceSettings`; ``bench``: the :class:`~wavesurf.bench.BenchSettings` of the timed
    runs of the default set, the best selected set and the best control on each of ``datasets``
    (the runs time ``hf_generate`` and ``eagle3`` only); ``curve_fractions``: fractions of the
    training budget at which the default and the best set are trained again; ``n_random``: random
    layer sets (drawn once with the table's seed), the null every selected set is ranked in;
    ``primary``: the pre-registered comparison with the default.

    Seeds: ``seeds`` train every layer set; ``primary_seeds`` (starting with ``seeds``; empty: the
    same) train the default set, the primary comparison's set and the embedding-only control, the
    comparisons the book leads with; ``null_seeds`` (a prefix of ``seeds``; empty: the same) train
    the random sets, whose spread across sets then includes seed noise. Seed k of every set is
    the same seed value, so sets stay paired by index (:mod:`wavesurf.drafter.intervals`).
    """

    distill: DistillBudget = field(default_factory=DistillBudget)
    features: FeatureSettings = field(default_factory=lambda: FeatureSettings(max_len=1024, batch_tokens=4096))
    train: TrainSettings = field(default_factory=lambda: TrainSettings(train_tokens=60_000, ttt_steps=4,
                                                                       draft_vocab_size=8192))
    acceptance: AcceptanceSettings = field(default_factory=AcceptanceSettings)
    bench: BenchSettings = field(default_factory=lambda: BenchSettings(n_prompts=3, max_new_tokens=64, mode="auto",
                                                                     draft_len=4))
    datasets: tuple[str, ...] = ("mt-bench", "humaneval", "sharegpt")
    seeds: tuple[int, ...] = (0, 1)
    primary_seeds: tuple[int, ...] = ()  # the default, primary and embedding-only heads ("": seeds)
    null_seeds: tuple[int, ...] = ()  # the random sets' heads ("": seeds)
    curve_fractions: tuple[float, ...] = (0.25, 0.5)
    methods: tuple[str, ...] = SELECTION_METHODS  # selection methods whose sets enter the table
    n_random: int = 2  # random control sets: the null each selected set is ranked in
    #: the one comparison with the default the book leads with, named before the run (a layer-set
    #: name or alias such as "combined"; "" for none): reported with its own 95% interval, the rest
    #: of the table is exploratory (simultaneous intervals)
    primary: str = "combined"

    @classmethod
    def from_profile(cls, drafter: dict) -> SpeedTableSettings:
        known = [f.name for f in fields(cls)]
        bad = sorted(set(drafter) - set(known))
        if bad:
            raise WavesurfError(f"unknown speed-table settings {bad}; allowed: {', '.join(sorted(known))}")
        out = cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in drafter.items()})
        out.check()
        return out

    def __post_init__(self) -> None:
        defaults = {f.name: f.default_factory for f in fields(self) if f.name in _PARTS}
        for name, (kind, fixed) in _PARTS.items():
            value = getattr(self, name)
            if isinstance(value, dict):  # a profile's plain-data form: its fields over this class's default
                allowed = [f.name for f in fields(kind) if f.init and f.name not in fixed]
                bad = sorted(set(value) - set(allowed))
                if bad:
                    raise WavesurfError(f"unknown {name} settings {bad}; allowed: {', '.join(allowed)}")
                value = replace(defaults[name](), **{k: tuple(v) if isinstance(v, list) else v
                                                     for k, v in value.items()})
                setattr(self, name, value)
            if not isinstance(value, kind):
                raise WavesurfError(f"{name}={value!r} must be a {kind.__name__} or a dict of its fields")

    def check(self) -> None:
        if not self.seeds:
            raise WavesurfError("the speed table needs at least one training seed")
        for name in ("seeds", "primary_seeds", "null_seeds"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not all(is_int(v, 0) for v in values) or len(set(values)) != len(values):
                raise WavesurfError(f"{name}={values!r} must be distinct non-negative integer seeds")
        if self.primary_seeds and tuple(self.primary_seeds[: len(self.seeds)]) != tuple(self.seeds):
            raise WavesurfError(f"primary_seeds={list(self.primary_seeds)} must start with seeds={list(self.seeds)}: "
                                "sets are paired seed by seed (add seeds after them)")
        if self.null_seeds and tuple(self.seeds[: len(self.null_seeds)]) != tuple(self.null_seeds):
            raise WavesurfError(f"null_seeds={list(self.null_seeds)} must be a prefix of seeds={list(self.seeds)}: "
                                "sets are paired seed by seed")
        from ..distill import check_settings as check_distill

        d = self.distill
        for tokens, turns in ((d.train_tokens, None), (d.heldout_tokens, d.heldout_max_turns)):
            check_distill(tokens, d.max_len, d.max_new_tokens, 0.0, 0, d.batch_size, d.chunk_examples, turns)
        self.acceptance.check()
        self.train.check()
        for f in self.curve_fractions:
            if not 0 < f < 1:
                raise WavesurfError(f"curve fraction {f!r} must be in (0, 1)")
        if not is_int(self.n_random, 0):
            raise WavesurfError(f"n_random={self.n_random!r} must be a non-negative integer")
        if not isinstance(self.primary, str):
            raise WavesurfError(f"primary={self.primary!r} must be a layer-set name such as 'combined', or ''")


    def seeds_for(self, layer_set: LayerSet, primary: LayerSet | None = None) -> tuple[int, ...]:
        """The training seeds of one layer set (see the class docstring)."""
        if layer_set.group == "default" or (primary is not None and layer_set.name == primary.name):
            return self.primary_seeds or self.seeds
        if is_random_set(layer_set):
            return self.null_seeds or self.seeds
        return self.seeds


@dataclass
class SpeedTable:
    """The speed table's tidy outputs.

    ``rows``: one per layer set x seed (offline tau at every draft length, per-step accuracy,
    training facts); ``summary``: one per layer set plus the bigram and n-gram lookup floors at
    ``draft_len``: what its intervals rest on (``seeds``, ``sequences``, ``interval``: both
    resampled with 2+ seeds, sequences only with 1), tau (seeds averaged) with its interval and
    standard error, the seed spread, the paired difference to the default set with ``diff_lo``/
    ``diff_hi`` simultaneous over the layer sets (max-T; ``diff_interval`` says which interval it
    is), ``diff_unadj_lo``/``diff_unadj_hi`` per comparison, ``diff_se`` with its seed and sequence
    parts and Satterthwaite ``diff_df``, and a verdict (``better``, ``worse``, ``within noise``, on
    the simultaneous interval); with ``lookup_ngram`` also ``lookup_tau`` (n-gram lookup first, the
    head after it) with its interval and its paired difference to the default set drafting the
    same way (``lookup_diff_lo``/``hi`` simultaneous too); ``info["family"]``: the family's size,
    level and critical value; ``info["can_rank"]``: whether the default set's heads beat both the
    bigram floor and the ``embedding-only`` control (the default set's head trained reading no
    stream, a ``floor`` row) beyond their intervals, without which the table cannot rank layer
    sets; ``rescue_*`` columns: step-0 accuracy where the bigram floor drafts wrong (where only
    what a head reads can help, :mod:`wavesurf.drafter.diagnostics`); ``streams``: per set and
    layer, the share of the fused input each stream makes (first seed) and, for the default set,
    tau without that stream; ``timed``: real decoding of the default, the best selected set and the best control
    against HF greedy ``generate``; ``curve``: offline tau against training tokens.
    """

    rows: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    timed: list[dict[str, Any]]
    curve: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, list[Any]] = field(default_factory=dict, repr=False)  # set name -> Acceptance per seed
    aliases: dict[str, str] = field(default_factory=dict, repr=False)  # alias -> set name
    streams: list[dict[str, Any]] = field(default_factory=list)  # per set and layer: what the head reads

    def compare(self, name: str, baseline: str) -> dict[str, float]:
        """Paired difference of offline tau between two layer sets (or aliases) of the table, at the
        table's draft length, seeds paired in order: one per-comparison interval (no family), from
        the same two-level replicates and pooled seed variance as the summary."""
        from ..drafter.acceptance import acceptance_intervals

        a, b = self.aliases.get(name, name), self.aliases.get(baseline, baseline)
        for n in (a, b):
            if n not in self.runs:
                raise KeyError(f"no layer set {n!r} in the speed table; sets: {sorted(self.runs)}")
        names = list(self.runs)
        iv = acceptance_intervals([self.runs[n] for n in names], self.info["draft_len"], reference=names.index(b),
                                  n_boot=self.info.get("n_boot", 2000), level=self.info.get("level", 0.95))
        row = iv.rows[names.index(a)]
        return {**{k: v for k, v in row.items() if not k.startswith("diff_fw")}, "seeds": row["seeds"],
                "baseline_seeds": iv.seeds_per_drafter[names.index(b)], "sequences": iv.sequences}

    def filtering_rows(self, methods: Sequence[str]) -> list[dict[str, Any]]:
        """Per selection method: the set chosen from all positions and from the token-entropy
        filtered ones, their offline tau, and the paired difference filtered - unfiltered."""
        out = []
        for m in methods:
            plain, filt = self.aliases.get(m, m), self.aliases.get(m + "+filter", m + "+filter")
            same = plain == filt
            diff = {"diff": 0.0, "diff_lo": 0.0, "diff_hi": 0.0, "diff_seed_min": 0.0, "diff_seed_max": 0.0} if same \
                else self.compare(filt, plain)
            out.append({"method": m, "layer_ids": self.row(plain)["layer_ids"],
                        "filtered_layer_ids": self.row(filt)["layer_ids"], "same_set": same,
                        "tau": self.row(plain)["tau"], "filtered_tau": self.row(filt)["tau"],
                        **{k: round(v, 5) for k, v in diff.items() if k.startswith("diff")},
                        "verdict": "same set" if same else classify(diff)})
        return out

    def best(self, groups: Sequence[str] = ("selected", "selected+filter", "control", "default")) -> dict[str, Any]:
        rows = [r for r in self.summary if r["group"] in groups]
        return max(rows, key=lambda r: r["tau"])

    def row(self, name: str) -> dict[str, Any]:
        for r in self.summary:
            if r["layer_set"] == name or name in r.get("aliases", "").split():
                return r
        raise KeyError(f"no layer set {name!r} in the speed table; sets: {[r['layer_set'] for r in self.summary]}")

    @property
    def verdict(self) -> str:
        return verdict_sentence(self.summary, self.info)

    def lookup_rows(self) -> list[dict[str, Any]]:
        """The summary as seen drafting with n-gram lookup first: per layer set its ``lookup_*``
        columns under the plain names (``tau``, ``diff``, ``verdict``, ...), plus lookup alone as
        the floor (its paired difference to the default set's heads after lookup); [] when the
        table was made without lookup."""
        over = self.info.get("head_over_lookup")
        if not over:
            return []
        keys = ("tau", "tau_lo", "tau_hi", "diff", "diff_lo", "diff_hi", "diff_seed_min", "diff_seed_max", "verdict")
        rows = [{**{k: r[k] for k in ("layer_set", "group", "layer_ids", "draft_len")},
                 **{k: r["lookup_" + k] for k in keys}} for r in self.summary if "lookup_tau" in r]
        floor = self.row("lookup")
        diff = {"diff": -over["diff"], "diff_lo": -over["diff_hi"], "diff_hi": -over["diff_lo"]}
        rows.append({**{k: floor[k] for k in ("layer_set", "group", "layer_ids", "draft_len", "tau", "tau_lo", "tau_hi")},
                     **diff, "verdict": classify({**diff, "diff_seed_min": diff["diff"], "diff_seed_max": diff["diff"]})})
        return rows

    @property
    def lookup_verdict(self) -> str:
        """One sentence on the heads drafting after n-gram lookup (empty when they were not scored)."""
        return lookup_sentence(self.summary, self.info)

    @property
    def selection_verdict(self) -> str:
        """One sentence: each selected set's rank among the random layer sets (the null), with its
        interval. Beating the default can come from reading a better region of layers, which random
        sets of that region do too; ranking high in the null credits the selection criterion, and
        unlike pairing the best selected set with the best control it compares no two maxima."""
        return null_sentence(self.info.get("null") or {}, self.info)

    @property
    def timed_setting(self) -> str:
        """One sentence on what the timed heads ran at (mode 'auto': the chosen chain lengths)."""
        if not self.timed or self.timed[0].get("predicted_speedup", "") in ("", None):
            lens = sorted({str(r.get("draft_len_run", "")) for r in self.timed})
            return f"Heads ran at a fixed draft length ({', '.join(lens)})." if self.timed else ""
        parts = []
        for r in self.timed:
            d = int(r["draft_len_run"])
            what = "plain decoding" if d == 0 else f"a chain of {d} cut below path probability {float(r['min_confidence']):g}"
            parts.append(f"{r['layer_set']} on {r['dataset']}: {what} (predicted {float(r['predicted_speedup']):.2f}x)")
        return ("Each head ran at the setting its measured costs and calibration prompts favoured "
                "(draft length 0 = plain decoding, chosen when drafting does not pay): " + "; ".join(parts) + ".")


def _train_and_score(target: Target, train_store: Any, held_store: Any, ids: list[int], train: TrainSettings,
                     seed: int, acceptance: AcceptanceSettings, name: str,
                     progress: bool, with_lookup: bool = False, floor: Any = None) -> tuple[Any, Any, Any, dict, Any]:
    """Train one head and score it alone and, ``with_lookup``, after n-gram lookup of the
    acceptance settings' order too (one unroll of the head for both; with a bigram ``floor``, its
    floor-miss diagnostics from the same unroll); the last item is that second score or None."""
    from ..drafter.acceptance import offline_acceptances
    from ..drafter.head import load_head
    from ..drafter.train import train_drafter

    result = train_drafter(target, train_store, ids, replace(train, seed=seed), progress=progress)
    head, info = load_head(result.out_dir, target)
    orders = (0, acceptance.lookup_ngram) if with_lookup and acceptance.lookup_ngram else (0,)
    scores = offline_acceptances(target, head, held_store, max_draft_len=acceptance.max_draft_len,
                                 lookup_ngrams=orders, names=(name, f"{name}+lookup")[: len(orders)], progress=progress,
                                 floor=floor)
    return result, head, scores[0], info, scores[1] if len(scores) > 1 else None


def distilled_corpus(target: Target, settings: SpeedTableSettings, split: str, progress: bool = True) -> Any:
    """The target's own greedy answers to the ShareGPT ``split`` ("train" or "heldout") prompts at
    the settings' budget (:func:`wavesurf.distill.distill_corpus`; cached, so a second call reads them)."""
    from ..distill import distill_corpus

    d = settings.distill
    budget, turns = (d.train_tokens, None) if split == "train" else (d.heldout_tokens, d.heldout_max_turns)
    return distill_corpus(target, "sharegpt", split=split, max_tokens=budget, max_len=d.max_len,
                          max_new_tokens=d.max_new_tokens, chunk_examples=d.chunk_examples,
                          batch_size=d.batch_size, progress=progress, max_turns=turns)


def distilled_stores(target: Target, settings: SpeedTableSettings, layer_ids: Sequence[int], progress: bool = True):
    """The target's own answers to the ShareGPT training and held-out prompts, and a feature store
    of each at ``layer_ids`` (plus layer N). Returns ``(train_store, heldout_store, train_corpus_name)``."""
    from ..drafter.features import build_feature_store
    from ..progress import phase

    stores, names = [], []
    for i, split in enumerate(("train", "heldout")):
        phase("the target's answers and feature stores (train, held-out)", i + 1, 2)
        corpus = distilled_corpus(target, settings, split, progress)
        names.append(f"{corpus.name}#{corpus.info['key']}")  # this very entry, whatever its settings
        stores.append(build_feature_store(
            target, replace(settings.features, dataset=names[-1], split=split, max_tokens=None,
                            layer_ids=sorted(set(layer_ids))),
            progress=progress))
    return stores[0], stores[1], names[0]


def run_speed_table(target: Target, sets: Sequence[LayerSet], settings: SpeedTableSettings | None = None, *,
                    progress: bool = True) -> SpeedTable:
    """Train one drafter per layer set and seed on the target's own answers with one budget, score
    each by exact offline chain acceptance on held-out target answers (with paired two-level
    bootstrap intervals against the default set, simultaneous over the sets), then time real decoding of the default, the best selected
    set and the best control against HF greedy ``generate``.

    Every corpus, store, drafter, score and timed run is cached under its own key, so an
    interrupted run resumes where it stopped and a re-run only reads the cache.
    """
    from ..drafter.acceptance import bigram_acceptance, bootstrap_tau, build_bigram_table, lookup_acceptance
    from ..progress import phase

    settings = settings or SpeedTableSettings()
    settings.check()
    acc_cfg = settings.acceptance
    d, level = acc_cfg.draft_len, acc_cfg.level
    primary = _primary_set(sets, settings.primary)
    union = sorted({i for s in sets for i in s.layer_ids})
    train_store, held_store, corpus_name = distilled_stores(target, settings, union, progress)

    rows: list[dict[str, Any]] = []
    runs: dict[str, list[Any]] = {}
    lookup_runs_by_set: dict[str, list[Any]] = {}
    heads: dict[str, Any] = {}
    heads_by_seed: dict[str, list[Any]] = {}
    default = next(s for s in sets if s.group == "default")
    control_seeds = settings.seeds_for(default)
    n_heads, done = sum(len(settings.seeds_for(s, primary)) for s in sets) + len(control_seeds), 0
    # the bigram floor first: each head's scoring unroll also counts where the floor misses (_diagnostics)
    table = build_bigram_table(target, corpus_name, split="train")
    for s in sets:
        for seed in settings.seeds_for(s, primary):
            done += 1
            phase("train and score heads", done, n_heads)
            result, head, acc, info, both = _train_and_score(target, train_store, held_store, s.layer_ids,
                                                             settings.train, seed, acc_cfg, f"{s.name}/seed{seed}",
                                                             progress, with_lookup=True, floor=table)
            runs.setdefault(s.name, []).append(acc)
            with_lookup = {}
            if both is not None:
                lookup_runs_by_set.setdefault(s.name, []).append(both)
                with_lookup = {f"lookup_tau_{k}": round(both.tau(k), 5) for k in both.draft_lens}
            heads.setdefault(s.name, result.out_dir)
            heads_by_seed.setdefault(s.name, []).append(head)
            vocab = info.get("vocab", {})
            rows.append({
                "layer_set": s.name, "group": s.group, "aliases": " ".join(s.aliases),
                "layer_ids": " ".join(map(str, s.layer_ids)),
                "sglang_layer_ids": " ".join(map(str, to_sglang(s.layer_ids, target.n_layers))), "seed": seed,
                **{f"tau_{k}": round(acc.tau(k), 5) for k in acc.draft_lens},
                **{f"step_accuracy_{j}": round(a, 5) for j, a in enumerate(acc.step_accuracy)}, **with_lookup,
                "train_tokens": result.train_tokens, "train_steps": result.steps,
                "train_seconds": round(result.seconds, 1), "train_tokens_per_second": round(result.tokens_per_second, 1),
                "vocab_coverage_heldout": vocab.get("heldout_coverage", ""), "drafter": result.out_dir,
            })

    floor = bigram_acceptance(target, table, held_store, max_draft_len=acc_cfg.max_draft_len, progress=progress)
    k_seeds = len(control_seeds)
    floor_runs = [floor] * k_seeds  # deterministic: the same floor paired with every seed
    lookup = lookup_acceptance(target, held_store, max_draft_len=acc_cfg.max_draft_len, progress=progress)
    lookup_runs = [lookup] * k_seeds
    # the embedding-only control: the default set's head with every stream zeroed, same budget, data and seeds
    control_runs = []
    for seed in control_seeds:
        done += 1
        phase("train and score heads", done, n_heads)
        _, head, acc, _, _ = _train_and_score(target, train_store, held_store, default.layer_ids,
                                           replace(settings.train, embedding_only=True), seed, acc_cfg,
                                           f"{CONTROL}/seed{seed}", progress, floor=table)
        control_runs.append(acc)
        heads_by_seed.setdefault(CONTROL, []).append(head)
    # one family of comparisons with the default: every layer set (the floors ride along, unadjusted)
    iv = _family_intervals([runs[s.name] for s in sets] + [floor_runs, lookup_runs, control_runs], sets, acc_cfg)
    summary: list[dict[str, Any]] = [_summary_row(s.name, s.group, s.aliases, s.layer_ids, runs[s.name], iv, i, acc_cfg)
                                     for i, s in enumerate(sets)]
    summary.append(_summary_row("bigram", "floor", [], [], floor_runs, iv, len(sets), acc_cfg))
    summary.append(_summary_row("lookup", "floor", [], [], lookup_runs, iv, len(sets) + 1, acc_cfg))
    summary.append(_summary_row(CONTROL, "floor", [], [], control_runs, iv, len(sets) + 2, acc_cfg))
    streams, rescue = _diagnostics(target, sets, heads_by_seed, table, train_store, held_store, runs, acc_cfg, progress)
    for row in summary:
        row.update(rescue.get(row["layer_set"], {}))
    info = {"draft_len": d, "level": level, "seeds": len(settings.seeds),
            "seed_counts": {"default, primary and control": k_seeds, "other sets": len(settings.seeds),
                            "random sets": len(settings.null_seeds or settings.seeds)}, "lookup_ngram": acc_cfg.lookup_ngram, "heldout_sequences": len(floor.sequence_ids),
            "heldout_positions": floor.positions, "heldout_cut_tokens": floor.cut_tokens, "corpus": corpus_name,
            "train_store_tokens": train_store.tokens, "heldout_store_tokens": held_store.tokens}

    info.update(n_boot=acc_cfg.n_boot, family_level=acc_cfg.simultaneous_level, interval=iv.basis,
                seed_df=iv.seed_df, pooled_seed_std=round(iv.pooled_seed_std, 5), family=iv.family)
    if lookup_runs_by_set:
        with_lookup = [s for s in sets if s.name in lookup_runs_by_set]
        liv = _family_intervals([lookup_runs_by_set[s.name] for s in with_lookup] + [lookup_runs], with_lookup, acc_cfg)
        position = {s.name: i for i, s in enumerate(sets)}
        for i, s in enumerate(with_lookup):
            summary[position[s.name]].update(_lookup_columns(liv, i, acc_cfg, reference=s.group == "default"))
        alone = liv.rows[-1]  # lookup alone - the default's heads after lookup, unadjusted
        info["head_over_lookup"] = {"diff": round(-alone["diff"], 5), "diff_lo": round(-alone["diff_hi"], 5),
                                    "diff_hi": round(-alone["diff_lo"], 5)}
        info["lookup_family"] = liv.family
    aliases = {a: s.name for s in sets for a in s.aliases}
    info["can_rank"] = _can_rank(summary)
    if primary is not None:
        row = summary[[x.name for x in sets].index(primary.name)]
        unadj = {**{k: row[k] for k in ("diff", "diff_seed_min", "diff_seed_max")},
                 "diff_lo": row["diff_unadj_lo"], "diff_hi": row["diff_unadj_hi"]}
        info["primary"] = {"named": settings.primary, "layer_set": primary.name, "layer_ids": row["layer_ids"],
                           "tau": row["tau"], "diff": row["diff"], "diff_lo": row["diff_unadj_lo"],
                           "diff_hi": row["diff_unadj_hi"], "verdict": classify(unadj)}
    info["null"] = _null_ranks(sets, runs, acc_cfg, settings.n_random)
    result = SpeedTable(rows, summary, [], [], info, {**runs, "bigram": floor_runs, "lookup": lookup_runs,
                                                      CONTROL: control_runs}, aliases, streams)
    by_name = {s.name: s for s in sets}
    chosen = [("default", default.name)]
    for label, groups in (("best selected", ("selected", "selected+filter")), ("best control", ("control",))):
        cands = [r for r in summary if r["group"] in groups]
        if cands:
            chosen.append((label, max(cands, key=lambda r: r["tau"])["layer_set"]))
    result.timed = _timed_rows(target, [(label, by_name[n], heads[n]) for label, n in chosen], settings, progress)

    budget = settings.train.train_tokens
    best = result.best(("selected", "selected+filter", "control"))["layer_set"] if len(sets) > 1 else default.name
    if budget and settings.curve_fractions:
        curve_sets, fracs = list(dict.fromkeys([default.name, best])), sorted(settings.curve_fractions) + [1.0]
        for j, name in enumerate(curve_sets):
            s = by_name[name]
            for i, frac in enumerate(fracs):
                phase("learning curve", j * len(fracs) + i + 1, len(curve_sets) * len(fracs))
                train = replace(settings.train, train_tokens=max(1, int(budget * frac)))
                res, _, acc, _, _ = _train_and_score(target, train_store, held_store, s.layer_ids, train,
                                                  settings.seeds[0], acc_cfg, f"{s.name}/curve{frac}", progress)
                ci = bootstrap_tau([acc], d, n_boot=acc_cfg.n_boot, level=level)
                result.curve.append({"layer_set": name, "layer_ids": " ".join(map(str, s.layer_ids)),
                                     "fraction": frac, "train_tokens": res.train_tokens, "seed": settings.seeds[0],
                                     "draft_len": d, "tau": round(ci["tau"], 5), "tau_lo": round(ci["tau_lo"], 5),
                                     "tau_hi": round(ci["tau_hi"], 5)})
    return result


def _diagnostics(target: Target, sets: Sequence[LayerSet], heads: dict[str, list[Any]], table: Any, train_store: Any,
                 held_store: Any, runs: dict[str, list[Any]], acc_cfg: AcceptanceSettings,
                 progress: bool) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Whether the heads use their layers: per set, step-0 accuracy where the bigram floor is
    wrong (seeds pooled, interval over held-out sequences); per set and layer, the stream's share
    of the fused input (first seed's head); for the default set, tau without each stream (paired
    with the full heads, every seed)."""
    from ..drafter.acceptance import acceptance_intervals, offline_acceptance
    from ..drafter.diagnostics import FloorMisses, ablate_stream, floor_miss_accuracy, stream_contributions

    rescue: dict[str, dict[str, Any]] = {}
    streams: list[dict[str, Any]] = []
    d = acc_cfg.draft_len
    for name in [s.name for s in sets] + [CONTROL]:
        per_seed = [floor_miss_accuracy(target, h, table, held_store) for h in heads[name]]
        pooled = FloorMisses(name, per_seed[0].sequence_ids, sum(f.misses for f in per_seed),
                             sum(f.rescued for f in per_seed), sum(f.floor_hits for f in per_seed),
                             sum(f.lost for f in per_seed))
        iv = pooled.interval(n_boot=acc_cfg.n_boot, level=acc_cfg.level)
        rescue[name] = {"rescue": round(iv["rescue_rate"], 5), "rescue_lo": round(iv["rescue_lo"], 5),
                        "rescue_hi": round(iv["rescue_hi"], 5), "floor_misses": iv.get("floor_misses", 0)}
    for s in sets:
        for c in stream_contributions(heads[s.name][0], train_store):
            streams.append({"layer_set": s.name, "group": s.group, "layer_id": c["layer_id"],
                            "share": round(c["share"], 5), "contribution_rms": round(c["contribution_rms"], 5),
                            "stream_rms": round(c["stream_rms"], 5), "fc_weight_norm": round(c["fc_weight_norm"], 5)})
    default = next(s for s in sets if s.group == "default")
    if len(default.layer_ids) > 1:
        ablated = {lid: [offline_acceptance(target, ablate_stream(h, lid), held_store,
                                            max_draft_len=acc_cfg.max_draft_len,
                                            name=f"{default.name} without {lid}/seed{i}", progress=progress)
                         for i, h in enumerate(heads[default.name])] for lid in default.layer_ids}
        lids = list(ablated)
        iv = acceptance_intervals([ablated[lid] for lid in lids] + [runs[default.name]], d, reference=len(lids),
                                  level=acc_cfg.level, n_boot=acc_cfg.n_boot)
        for i, lid in enumerate(lids):
            r = iv.rows[i]
            row = next(x for x in streams if x["layer_set"] == default.name and x["layer_id"] == lid)
            row.update(tau_without=round(r["tau"], 5), drop=round(-r["diff"], 5), drop_lo=round(-r["diff_hi"], 5),
                       drop_hi=round(-r["diff_lo"], 5))
    return streams, rescue


def _primary_set(sets: Sequence[LayerSet], name: str) -> LayerSet | None:
    """The layer set the pre-registered primary comparison names (by name or alias); refuses a name
    the table does not train, before anything is trained."""
    if not name:
        return None
    for s in sets:
        if name == s.name or name in s.aliases:
            if s.group == "default":
                raise WavesurfError(f"primary={name!r} chose the default set itself {s.layer_ids}: there is "
                                    "nothing to compare; name another set or ''")
            return s
    names = sorted({n for s in sets for n in [s.name, *s.aliases]})
    raise WavesurfError(f"primary={name!r} names no layer set this table trains; choose one of {', '.join(names)} "
                        "or '' for none")


def _null_ranks(sets: Sequence[LayerSet], runs: dict[str, list[Any]], acc_cfg: AcceptanceSettings,
                n_random: int) -> dict[str, Any]:
    """Each selected set's percentile among the random sets (the null), with two-level intervals."""
    from ..drafter.acceptance import acceptance_null_percentiles

    null = [i for i, s in enumerate(sets) if is_random_set(s)]
    subjects = [i for i, s in enumerate(sets) if s.group.startswith("selected")]
    out: dict[str, Any] = {"random_sets": len(null), "asked": n_random, "rows": []}
    if len(null) < 2 or not subjects:
        out["note"] = (f"{len(null)} random layer set{'s' if len(null) != 1 else ''}: too few to rank the selected "
                       "sets against (at least 2)" if len(null) < 2 else "no selected set to rank")
        return out
    ranks = acceptance_null_percentiles([runs[s.name] for s in sets], acc_cfg.draft_len, subjects, null,
                                        level=acc_cfg.level, n_boot=acc_cfg.n_boot)
    for i, r in zip(subjects, ranks):
        out["rows"].append({"layer_set": sets[i].name, "layer_ids": " ".join(map(str, sets[i].layer_ids)),
                            **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}})
    return out


def _can_rank(summary: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Whether the default set's heads beat the bigram floor and the embedding-only control beyond
    the floors' (per-comparison) intervals: only then can differences between layer sets be about
    the layers. A floor row's ``diff`` is floor - default, so the heads beat it when ``diff_hi < 0``."""
    out: dict[str, Any] = {}
    for name in ("bigram", CONTROL):
        row = next((r for r in summary if r["layer_set"] == name), None)
        if row is not None:
            out[name] = {"beaten": bool(row["diff_hi"] < 0), "margin": round(-row["diff"], 5),
                         "margin_lo": round(-row["diff_hi"], 5), "margin_hi": round(-row["diff_lo"], 5),
                         "tau": row["tau"]}
    out["ok"] = all(v["beaten"] for v in out.values() if isinstance(v, dict))
    return out


def _family_intervals(groups: list[list[Any]], sets: Sequence[LayerSet], acc_cfg: AcceptanceSettings) -> Any:
    """Intervals of every drafter in ``groups`` (the runs of ``sets`` in order, then any floors) from
    one set of two-level replicates: differences against the default set, simultaneous (max-T) over
    the other layer sets, the floors compared unadjusted (they are not candidates)."""
    from ..drafter.acceptance import acceptance_intervals

    ref = next(i for i, s in enumerate(sets) if s.group == "default")
    family = [i for i, s in enumerate(sets) if s.group != "default"]
    return acceptance_intervals(groups, acc_cfg.draft_len, reference=ref, family=family, level=acc_cfg.level,
                                family_level=acc_cfg.simultaneous_level, n_boot=acc_cfg.n_boot)


def _interval_columns(iv: Any, i: int, reference: bool) -> dict[str, Any]:
    """Columns of drafter ``i`` of :class:`~wavesurf.drafter.intervals.TauIntervals` ``iv``: tau
    with its interval, and the difference to the reference with ``diff_lo``/``diff_hi`` the
    simultaneous interval for a member of the family (the per-comparison one for a floor),
    ``diff_unadj_lo``/``diff_unadj_hi`` the per-comparison interval, the standard error with its
    seed and sequence parts, and ``diff_interval`` saying which interval ``diff_lo`` is."""
    r = iv.rows[i]
    out = {k: round(r[k], 5) for k in ("tau", "tau_lo", "tau_hi", "tau_se", "tau_seed_std")}
    if reference:
        return {**out, "diff": 0.0, "diff_lo": 0.0, "diff_hi": 0.0, "diff_unadj_lo": 0.0, "diff_unadj_hi": 0.0,
                "diff_se": 0.0, "diff_se_seed": 0.0, "diff_se_seq": 0.0, "diff_df": "", "diff_seed_min": 0.0,
                "diff_seed_max": 0.0, "diff_interval": "reference"}
    level = round(100 * iv.level)
    fam = iv.family
    simultaneous = "diff_fw_lo" in r and fam.get("comparisons", 0) > 1  # a family of one is one comparison
    out.update(diff=round(r["diff"], 5),
               diff_lo=round(r["diff_fw_lo" if simultaneous else "diff_lo"], 5),
               diff_hi=round(r["diff_fw_hi" if simultaneous else "diff_hi"], 5),
               diff_unadj_lo=round(r["diff_lo"], 5), diff_unadj_hi=round(r["diff_hi"], 5),
               **{k: round(r[k], 5) for k in ("diff_se", "diff_se_seed", "diff_se_seq")},
               diff_df=round(r["diff_df"], 1), diff_seed_min=round(r["diff_seed_min"], 5),
               diff_seed_max=round(r["diff_seed_max"], 5),
               diff_interval=(f"simultaneous {round(100 * fam['level'])}% (max-T over {fam['comparisons']} comparisons)"
                              if simultaneous else f"per-comparison {level}%"))
    return out


def _summary_row(name: str, group: str, aliases: Sequence[str], layer_ids: Sequence[int], runs: list[Any],
                 iv: Any, i: int, acc_cfg: AcceptanceSettings) -> dict[str, Any]:
    """One summary row: the set, what its intervals rest on (``seeds``, ``sequences``, ``interval``),
    :func:`_interval_columns` and the verdict (:func:`classify` of the simultaneous interval)."""
    row = {"layer_set": name, "group": group, "aliases": " ".join(aliases), "layer_ids": " ".join(map(str, layer_ids)),
           "seeds": iv.seeds_per_drafter[i], "sequences": iv.sequences, "interval": iv.row_basis(i),
           "draft_len": acc_cfg.draft_len,
           **_interval_columns(iv, i, reference=group == "default"),
           "step_accuracy_0": round(float(np.mean([r.step_accuracy[0] for r in runs])), 5)}
    row["verdict"] = "reference" if group == "default" else classify(row)
    return row


def _lookup_columns(liv: Any, i: int, acc_cfg: AcceptanceSettings, reference: bool) -> dict[str, Any]:
    """tau of a set's heads drafting with n-gram lookup first, with its interval, and the paired
    difference to the default set's heads drafting the same way (simultaneous over the sets, the
    per-comparison interval as ``lookup_diff_unadj_*``)."""
    cols = _interval_columns(liv, i, reference)
    keys = ("tau", "tau_lo", "tau_hi", "diff", "diff_lo", "diff_hi", "diff_unadj_lo", "diff_unadj_hi", "diff_se",
            "diff_seed_min", "diff_seed_max")
    out = {"lookup_" + k: cols[k] for k in keys}
    out["lookup_verdict"] = "reference" if reference else classify(cols)
    return out


def _setting_columns(summary: dict) -> dict[str, Any]:
    """What the head ran at: the chain length and threshold chosen in mode 'auto' (0 = plain
    decoding) with the cost model's predicted speedup, else the fixed shape."""
    choice = summary.get("adaptive", {}).get("choice")
    st = summary.get("settings", {})
    if choice:
        return {"draft_len_run": choice["draft_len"], "min_confidence": choice["min_confidence"],
                "predicted_speedup": choice["predicted_speedup"]}
    return {"draft_len_run": st.get("depth", ""), "min_confidence": 0.0, "predicted_speedup": ""}


def _timed_rows(target: Target, chosen: Sequence[tuple[str, LayerSet, str]], settings: SpeedTableSettings,
                progress: bool) -> list[dict[str, Any]]:
    from ..bench import run_bench
    from ..drafter.head import load_head
    from ..progress import phase

    timed = replace(settings.bench, methods=("hf_generate", "eagle3"))
    rows = []
    for j, (label, s, out_dir) in enumerate(chosen):
        head, _ = load_head(out_dir, target)
        for i, ds in enumerate(settings.datasets):
            phase("timed runs", j * len(settings.datasets) + i + 1, len(chosen) * len(settings.datasets))
            run = run_bench(target, head, ds, timed, progress=progress)
            spec, ref = run.summary["methods"]["eagle3"], run.summary["methods"]["hf_generate"]
            lossless = str(spec.get("lossless", ""))
            same, _, total = lossless.partition("/")
            rows.append({"role": label, "layer_set": s.name, "layer_ids": " ".join(map(str, s.layer_ids)),
                         "dataset": ds, "tau": spec["tau"], "speedup": spec["speedup"],
                         "speedup_lo": (spec.get("speedup_ci95") or ["", ""])[0],
                         "speedup_hi": (spec.get("speedup_ci95") or ["", ""])[1],
                         "tokens_per_second": spec["mean_tokens_per_second"],
                         "hf_tokens_per_second": ref["mean_tokens_per_second"],
                         "lossless_prompts": int(same) if same.isdigit() else "",
                         "prompts": int(total) if total.isdigit() else "", "drafter": out_dir,
                         **_setting_columns(run.summary)})
    return rows
