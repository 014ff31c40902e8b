"""The speed-table experiment: do entropy/CKA-selected layer sets give a drafter that accepts more
tokens than the default ``[2, N//2, N-3]``?

Layer sets (all vLLM ids, k layers unless a control says otherwise):

* ``default`` — the EAGLE-3 rule;
* each selection method (``entropy``, ``aggregate``, ``cka``, ``combined``), from statistics
  without and with token-entropy filtering (``+filter``);
* controls: ``last-3`` (the top three ids), ``even-3`` (k ids evenly spaced over 1..N),
  ``last-1`` (the single top layer, EAGLE-1 style), and ``random-i`` sets drawn with a seed.

Identical sets are trained once and reported under every name that chose them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .errors import WavesurfError
from .models import default_layer_ids
from .select import check_k, select_layers

SELECTION_METHODS = ("entropy", "aggregate", "cka", "combined")


@dataclass
class LayerSet:
    name: str
    group: str  # "default", "selected", "selected+filter" or "control"
    layer_ids: list[int]
    reason: str
    aliases: list[str] = field(default_factory=list)  # other names that chose the same ids

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evenly_spaced(n_layers: int, k: int) -> list[int]:
    """k ids spread evenly over 1..N, ending at N: ``round(N * (i + 1) / k)``."""
    return sorted({max(1, round(n_layers * (i + 1) / k)) for i in range(k)})


def random_sets(n_layers: int, k: int, n: int, seed: int, avoid: Sequence[Sequence[int]] = ()) -> list[list[int]]:
    """``n`` distinct random k-subsets of 1..N (seeded), none equal to a set in ``avoid``."""
    from math import comb

    if n > comb(n_layers, k) - len(avoid):
        raise WavesurfError(f"cannot draw {n} distinct random {k}-layer sets from {n_layers} layers")
    rng = np.random.default_rng(seed)
    seen = {tuple(sorted(a)) for a in avoid}
    out: list[list[int]] = []
    while len(out) < n:
        ids = tuple(sorted(int(i) for i in rng.choice(np.arange(1, n_layers + 1), size=k, replace=False)))
        if ids not in seen:
            seen.add(ids)
            out.append(list(ids))
    return out


def layer_sets(
    stats: Any,
    filtered_stats: Any | None = None,
    *,
    k: int = 3,
    methods: Sequence[str] = SELECTION_METHODS,
    n_random: int = 2,
    seed: int = 0,
) -> list[LayerSet]:
    """The layer sets of the speed table, from unfiltered ``stats`` and (optionally) statistics
    computed with a token-entropy filter. Duplicated id lists are merged (``aliases``)."""
    n = stats.n_layers
    k = check_k(k, n)
    methods = list(methods)
    candidates: list[LayerSet] = [
        LayerSet("default", "default", default_layer_ids(n), f"EAGLE-3 rule [2, N//2, N-3] for N={n}")
    ]
    for flt, st in (("", stats), ("+filter", filtered_stats)):
        if st is None:
            continue
        for method in methods:
            sel = select_layers(st, k=k, method=method)
            group = "selected" + flt
            filt = st.meta.get("filter", {}).get("filter", "?")
            candidates.append(LayerSet(method + flt, group, list(sel.layer_ids),
                                       f"{sel.reason} (filter {filt})" if flt else sel.reason))
    candidates += [
        LayerSet("last-3", "control", list(range(n - k + 1, n + 1)), f"the top {k} layer ids"),
        LayerSet("even-3", "control", evenly_spaced(n, k), f"{k} ids evenly spaced over 1..N"),
        LayerSet("last-1", "control", [n], "the single top layer (EAGLE-1 style)"),
    ]
    for i, ids in enumerate(random_sets(n, k, n_random, seed, [c.layer_ids for c in candidates])):
        candidates.append(LayerSet(f"random-{i + 1}", "control", ids, f"random {k}-subset of 1..N (seed {seed})"))
    merged: dict[tuple[int, ...], LayerSet] = {}
    for c in candidates:
        key = tuple(c.layer_ids)
        if key in merged:
            merged[key].aliases.append(c.name)
        else:
            merged[key] = c
    return list(merged.values())


# ---------------------------------------------------------------------------------------------
# running the experiment
@dataclass
class SpeedTableSettings:
    """Budgets of the speed table (a profile's ``"drafter"`` dict fills these).

    ``features``: :class:`~wavesurf.drafter.features.FeatureSettings` fields (the training split is
    captured once, at the union of the sets' layer ids); ``train``: :class:`TrainSettings` fields,
    identical for every set (only ``seed`` varies over ``seeds``); ``bench``: keyword arguments of
    :func:`wavesurf.bench.run_bench` except the dataset, run for each dataset of ``datasets``;
    ``curve_fractions``: fractions of the training budget at which the default set is trained again
    for the tau-against-training-tokens curve (first seed, first dataset).
    """

    features: dict = field(default_factory=lambda: {"max_tokens": 20_000})
    train: dict = field(default_factory=lambda: {"train_tokens": 20_000, "ttt_steps": 3, "draft_vocab_size": 8192})
    bench: dict = field(default_factory=lambda: {"n_prompts": 3, "max_new_tokens": 48, "mode": "chain", "draft_len": 4})
    datasets: tuple[str, ...] = ("mt-bench", "humaneval", "sharegpt")
    seeds: tuple[int, ...] = (0, 1)
    curve_fractions: tuple[float, ...] = (0.125, 0.25, 0.5)
    methods: tuple[str, ...] = SELECTION_METHODS  # selection methods whose sets enter the table
    n_random: int = 2  # random control sets

    @classmethod
    def from_profile(cls, drafter: dict) -> SpeedTableSettings:
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(drafter) - known)
        if bad:
            raise WavesurfError(f"unknown speed-table settings {bad}; allowed: {', '.join(sorted(known))}")
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in drafter.items()})


@dataclass
class SpeedTable:
    rows: list[dict[str, Any]]  # one per layer set x seed x dataset
    curve: list[dict[str, Any]]  # tau of the default set against training tokens
    summary: list[dict[str, Any]]  # mean and spread over seeds per layer set x dataset

    def best(self, dataset: str = "mt-bench") -> dict[str, Any]:
        rows = [r for r in self.summary if r["dataset"] == dataset]
        return max(rows, key=lambda r: r["tau_mean"])


def _train_and_bench(target: Any, store: Any, ids: list[int], train: dict, seed: int, datasets: Sequence[str],
                     bench: dict, progress: bool) -> tuple[Any, dict[str, Any]]:
    from .bench import run_bench
    from .drafter.head import load_head
    from .drafter.train import TrainSettings, train_drafter

    result = train_drafter(target, store, ids, TrainSettings(**{**train, "seed": seed}), progress=progress)
    head, _ = load_head(result.out_dir, target)
    runs = {ds: run_bench(target, head, ds, methods=["hf_generate", "eagle3"], progress=progress, **bench)
            for ds in datasets}
    return result, runs


def run_speed_table(target: Any, sets: Sequence[LayerSet], settings: SpeedTableSettings | None = None, *,
                    progress: bool = True) -> SpeedTable:
    """Train one drafter per layer set and seed on the same captured tokens with the same budget,
    and measure tau and speedup (against HF greedy ``generate``, in the same run) per dataset.

    Every drafter and every benchmark is cached under its own key, so an interrupted run resumes
    where it stopped and a re-run only reads the cache.
    """
    from .drafter.features import FeatureSettings, build_feature_store

    settings = settings or SpeedTableSettings()
    union = sorted({i for s in sets for i in s.layer_ids})
    store = build_feature_store(target, FeatureSettings(**{**settings.features, "layer_ids": union}), progress=progress)
    rows: list[dict[str, Any]] = []
    for s in sets:
        for seed in settings.seeds:
            result, runs = _train_and_bench(target, store, s.layer_ids, settings.train, seed, settings.datasets,
                                            settings.bench, progress)
            for ds, run in runs.items():
                spec, ref = run.summary["methods"]["eagle3"], run.summary["methods"]["hf_generate"]
                rows.append({
                    "layer_set": s.name, "group": s.group, "aliases": " ".join(s.aliases),
                    "layer_ids": " ".join(map(str, s.layer_ids)),
                    "sglang_layer_ids": " ".join(str(i - 1) for i in s.layer_ids), "seed": seed, "dataset": ds,
                    "tau": spec["tau"], "speedup": spec["speedup"],
                    "tokens_per_second": spec["mean_tokens_per_second"],
                    "hf_tokens_per_second": ref["mean_tokens_per_second"], "lossless": spec.get("lossless", ""),
                    "train_tokens": result.train_tokens, "train_seconds": round(result.seconds, 1),
                    "train_tokens_per_second": round(result.tokens_per_second, 1),
                    "accuracy_step0": round(result.accuracy[0], 4) if result.accuracy else "",
                    "drafter": result.out_dir,
                })
    curve: list[dict[str, Any]] = []
    default = next((s for s in sets if s.name == "default"), None)
    budget = settings.train.get("train_tokens")
    if default is not None and budget and settings.curve_fractions:
        ds = settings.datasets[0]
        for frac in sorted(settings.curve_fractions) + [1.0]:
            train = {**settings.train, "train_tokens": max(1, int(budget * frac))}
            result, runs = _train_and_bench(target, store, default.layer_ids, train, settings.seeds[0], [ds],
                                            settings.bench, progress)
            spec = runs[ds].summary["methods"]["eagle3"]
            curve.append({"layer_set": "default", "dataset": ds, "fraction": frac, "train_tokens": result.train_tokens,
                          "tau": spec["tau"], "speedup": spec["speedup"], "seed": settings.seeds[0]})
    return SpeedTable(rows, curve, summarize_rows(rows))


def summarize_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and spread (sample std, min, max) of tau and speedup over seeds, per set x dataset."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["layer_set"], r["dataset"]), []).append(r)
    out = []
    for (name, ds), rs in groups.items():
        entry = {"layer_set": name, "group": rs[0]["group"], "aliases": rs[0]["aliases"],
                 "layer_ids": rs[0]["layer_ids"], "dataset": ds, "seeds": len(rs)}
        for key in ("tau", "speedup"):
            vals = np.array([float(r[key]) for r in rs if r[key] is not None], dtype=float)
            entry[f"{key}_mean"] = round(float(vals.mean()), 4) if vals.size else float("nan")
            entry[f"{key}_std"] = round(float(vals.std(ddof=1)), 4) if vals.size > 1 else 0.0
            entry[f"{key}_min"] = round(float(vals.min()), 4) if vals.size else float("nan")
            entry[f"{key}_max"] = round(float(vals.max()), 4) if vals.size else float("nan")
        out.append(entry)
    return out
