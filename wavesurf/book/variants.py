"""The analysis variants a profile asks for (``base``, ``position0``, ``selection``, the filter
sweep, and the served-position variants ``served`` and ``served:selection``), computed from one
capture where they share it and cached exactly as :func:`wavesurf.stats.analysis.analyze` caches
them; the lookup of every model's cached result for given settings; the random-control view of a
filtered result."""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from ..errors import ParameterError, WavesurfError

if TYPE_CHECKING:
    from ..models import Target

#: Keep captured batches in memory to feed several analyses from one forward pass when their
#: hidden states (all layers, float32, padding included) take at most this many bytes.
SHARED_CAPTURE_MAX_BYTES = 6 * 2**30


def statistics_corpus(params: Any) -> dict[str, Any]:
    """What every all-positions variant and the probe read: ``dataset``, ``split`` (ShareGPT's
    "stats" split, none for other corpora) and the token budget ``max_tokens`` (the notebook's, else
    the profile's)."""
    return {"dataset": params.dataset, "split": "stats" if params.dataset == "sharegpt" else None,
            "max_tokens": params.max_tokens or params.profile_spec.analysis.max_tokens}


def analysis_variants(params: Any) -> dict[str, Any]:
    """AnalysisSettings of every variant the statistics notebooks read, by name:
    ``base``, ``position0``, ``selection`` and ``sweep:<filter>`` for each sweep filter."""
    from ..stats.analysis import AnalysisSettings

    a = params.profile_spec.analysis
    common = dict(**statistics_corpus(params), max_len=a.max_len, batch_tokens=a.batch_tokens,
                  pilot_tokens=a.pilot_tokens, seed=params.seed, resample_groups=a.resample_groups)
    exact = AnalysisSettings(**common, estimator=a.estimator)
    sweep = AnalysisSettings(**common, estimator=a.sweep_estimator, minibatch_size=a.minibatch_size)
    variants = {
        "base": exact,
        "position0": replace(sweep, include_position0=True),
        "selection": replace(exact, filter=a.selection_filter, estimator=a.selection_estimator,
                             minibatch_size=a.minibatch_size),
    }
    for f in a.sweep_filters:
        variants[f"sweep:{f}"] = replace(sweep, filter=f)
    return variants


#: the variants on the positions a drafter serves: every assistant token of the target's own answers
#: (template and special tokens excluded), unfiltered and with the profile's selection filter
SERVED_VARIANTS = ("served", "served:selection")


def served_variants(target: Target, params: Any, progress: bool = True) -> dict[str, Any]:
    """AnalysisSettings of :data:`SERVED_VARIANTS`: the statistics of the positions a drafter serves,
    on the target's own answers to the ShareGPT training prompts that the profile's drafters train
    on (generated here when missing: that is notebook 04b's first and longest step), assistant
    tokens only, as many positions as the all-positions variants have (the profile's analysis token
    budget), or every answer when the corpus holds fewer."""
    from ..data import tokens_for_role_positions
    from ..stats.analysis import AnalysisSettings
    from .speed_table import SpeedTableSettings, distilled_corpus

    a = params.profile_spec.analysis
    drafter = SpeedTableSettings.from_profile(params.profile_spec.drafter)
    corpus = distilled_corpus(target, drafter, "train", progress)
    max_len = max(a.max_len, drafter.distill.max_len)  # whole answers, as the drafters read them
    budget = tokens_for_role_positions(corpus, target.tokenizer, target.has_chat_template,
                                       statistics_corpus(params)["max_tokens"], max_len=max_len)
    common = dict(dataset=f"{corpus.name}#{corpus.info['key']}", split="train", roles="assistant",
                  max_tokens=budget, max_len=max_len, min_tokens=a.served_min_tokens,
                  batch_tokens=a.batch_tokens, pilot_tokens=a.pilot_tokens, seed=params.seed,
                  resample_groups=a.resample_groups)
    served = AnalysisSettings(**common, estimator=a.estimator)
    return {"served": served,
            "served:selection": replace(served, filter=a.selection_filter, estimator=a.selection_estimator,
                                        minibatch_size=a.minibatch_size)}


def selection_variant_names(params: Any) -> tuple[str, str]:
    """The (unfiltered, filtered) variants layer sets are selected from, as the profile's
    ``analysis.selection_positions`` names them."""
    served = params.profile_spec.analysis.selection_positions == "served"
    return SERVED_VARIANTS if served else ("base", "selection")


def sweep_variant_names(params: Any) -> list[str]:
    return ["base"] + [f"sweep:{f}" for f in params.profile_spec.analysis.sweep_filters]


def profile_stats(target: Target, params: Any, names: Sequence[str] | None = None,
                  progress: bool = True) -> dict[str, Any]:
    """LayerStats of the profile's variants (all but the served ones by default), from the results
    cache where present.

    Missing variants that share capture settings are computed from **one** forward pass over the
    corpus (batches kept in memory when they fit :data:`SHARED_CAPTURE_MAX_BYTES`, else one pass
    each), then cached exactly as :func:`wavesurf.analyze` would, so either reads the other's result.
    """
    from ..stats.analysis import analysis_key
    from ..stats.store import load_stats, result_dir
    from ..cache import verify_directory

    variants = analysis_variants(params)
    names = list(variants) if names is None else list(names)
    unknown = [n for n in names if n not in variants and n not in SERVED_VARIANTS]
    if unknown:  # before any work (the served variants may have answers to generate)
        raise ParameterError(f"unknown analysis variant(s) {unknown}; available: "
                             f"{', '.join([*variants, *SERVED_VARIANTS])}")
    if any(n in SERVED_VARIANTS for n in names):
        variants.update(served_variants(target, params, progress))
    out: dict[str, Any] = {}
    missing: dict[str, Any] = {}
    for name in names:
        settings = variants[name]
        settings.check()
        key, _ = analysis_key(target, settings)
        path = result_dir(target.name, key)
        if path.exists() and verify_directory(path) is None:
            out[name] = load_stats(path)
        else:
            missing[name] = settings
    if missing:
        out.update(_compute_shared(target, missing, progress))
    for name, stats in out.items():  # reload computed ones from disk: cross blocks memory-mapped
        if stats.path is None:
            key, _ = analysis_key(target, variants[name])
            out[name] = load_stats(result_dir(target.name, key))
    return {n: out[n] for n in names}


def _capture_fields(s: Any) -> tuple:
    return (s.dataset, s.split, s.split_seed, s.max_tokens, s.max_len, s.batch_tokens)


def _compute_shared(target: Target, missing: dict[str, Any], progress: bool) -> dict[str, Any]:
    from ..capture import capture
    from ..data import load_corpus
    from ..stats.analysis import analysis_key, analyze, analyze_batches, check_corpus_groups
    from ..stats.store import result_dir, save_stats

    results: dict[str, Any] = {}
    groups: dict[tuple, list[str]] = {}
    for name, s in missing.items():
        groups.setdefault(_capture_fields(s), []).append(name)
    for fields_, group in groups.items():
        s0 = missing[group[0]]
        # padded batches hold up to batch_tokens per forward; budget with 25% padding slack
        need = int(s0.max_tokens * 1.25) * (target.n_layers + 1) * target.hidden_size * 4
        if len(group) == 1 or need > SHARED_CAPTURE_MAX_BYTES:
            for name in group:
                results[name] = analyze(target, missing[name], progress=progress)
            continue
        t0 = time.perf_counter()
        corpus = load_corpus(s0.dataset, split=s0.split, seed=s0.split_seed)
        for name in group:
            check_corpus_groups(missing[name], corpus)
        batches = list(capture(target, corpus, s0.max_tokens, max_len=s0.max_len,
                               batch_tokens=s0.batch_tokens, progress=progress))
        t_capture = time.perf_counter() - t0
        for name in group:
            t1 = time.perf_counter()
            settings = missing[name]
            key, params = analysis_key(target, settings)
            stats = analyze_batches(batches, target.n_layers, target.hidden_size, settings, key=key, params=params,
                                    corpus_order=[e.id for e in corpus.examples])
            stats.meta["seconds"] = round(time.perf_counter() - t1 + t_capture / len(group), 1)
            stats.meta["shared_capture"] = {"variants": len(group), "capture_seconds": round(t_capture, 1)}
            out = result_dir(target.name, key)
            save_stats(stats, out)
            results[name] = stats
            if progress:
                print(f"analysis {name}: {stats.meta['seconds']} s", flush=True)
        del batches
    return results


def cached_results(settings: Any) -> list[Any]:
    """LayerStats of every model whose cached analysis used exactly ``settings`` (all
    AnalysisSettings fields equal; model facts free), sorted by model name."""
    from ..cache import cache_root, verify_directory
    from ..stats.store import load_stats

    want = {**asdict(settings), "filter": _filter_label(settings.filter)}
    found = {}
    root = cache_root() / "results" / "analyze"
    for meta_path in sorted(root.glob("*/meta.json")) if root.exists() else []:
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        recorded = {**meta, "filter": _filter_label(meta.get("filter"))}
        if any(recorded.get(k, object()) != v for k, v in want.items()):
            continue
        if verify_directory(meta_path.parent) is not None:
            continue
        found.setdefault(meta["model"], meta_path.parent)
    return [load_stats(found[m]) for m in sorted(found)]


def _filter_label(spec: Any) -> str | None:
    """The canonical label of a filter spec, or of the filter summary a result's meta records."""
    from ..stats.filtering import TokenFilter

    if isinstance(spec, dict):
        spec = spec.get("filter")
    try:
        return TokenFilter.parse(spec).label
    except WavesurfError:
        return None


__all__ = ["SHARED_CAPTURE_MAX_BYTES", "analysis_variants", "cached_results", "profile_stats",
           "sweep_variant_names"]
