"""What the paper-companion notebooks share beyond the statistics themselves: ranks, ids and
intervals in prose, the tidy CSV writer, the speed-table run at a profile's budgets.

The statistics own their results: set scores, pair matrices and depth curves are
:class:`~wavesurf.stats.results.LayerStats` methods; the profile's analysis variants and the
cached-results lookup live in :mod:`wavesurf.book.variants`; the selection, filter-sweep and
cross-model tables in :mod:`wavesurf.select`; parameter checks and the first cell in
:mod:`wavesurf.book.notebook`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cache import write_rows_csv
from ..errors import WavesurfError
from .notebook import NotebookParams
from .variants import profile_stats, selection_variant_names, statistics_corpus

if TYPE_CHECKING:
    from ..models import Target


# ---------------------------------------------------------------------------------------------
def rank_of(values: np.ndarray, value: float) -> tuple[int, float]:
    """(1-based rank of ``value`` among ``values``, descending; fraction of values strictly above)."""
    above = int(np.sum(values > value + 1e-12))
    return above + 1, above / max(len(values), 1)


# ---------------------------------------------------------------------------------------------
def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Tidy CSV (header from the first row's keys)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        raise WavesurfError(f"no rows to write to {path}")
    return write_rows_csv(path, rows, float_format=".6g")


# ---------------------------------------------------------------------------------------------
# intervals in prose
def fmt_interval(jk: Any, fmt: str = ".3f", index: Any = None) -> str:
    """``"0.123 (95% CI 0.110 to 0.136)"`` for a :class:`~wavesurf.stats.resampling.Jackknife`
    (``index`` picks one entry of an array-valued one)."""
    pick = (lambda a: float(np.asarray(a)[index])) if index is not None else (lambda a: float(a))
    level = int(round(100 * jk.level))
    return f"{pick(jk.estimate):{fmt}} ({level}% CI {pick(jk.low):{fmt}} to {pick(jk.high):{fmt}})"


def interval_text(value: float, jk: Any | None, fmt: str = ".3f", index: Any = None, verdict: bool = False) -> str:
    """``value`` with its interval (:func:`fmt_interval`), or the bare value when ``jk`` is None (a
    run without intervals); ``verdict=True`` (differences) appends "within noise"/"beyond noise"."""
    if jk is None:
        return f"{float(value):{fmt}} (no interval)"
    text = fmt_interval(jk, fmt, index)
    return text[:-1] + f"; {noise_verdict(jk, index)})" if verdict else text


def noise_verdict(jk: Any, index: Any = None) -> str:
    """``"within noise"`` where the interval of a difference covers 0, else ``"beyond noise"``."""
    lo, hi = (float(np.asarray(jk.low)[index]), float(np.asarray(jk.high)[index])) if index is not None else (
        float(jk.low), float(jk.high))
    return "within noise" if lo <= 0.0 <= hi else "beyond noise"


def paired_difference(stats_a: Any, stats_b: Any, quantity: str, level: float = 0.95) -> Any:
    """``quantity`` of ``stats_a`` minus that of ``stats_b`` (two runs over the same corpus, e.g.
    with and without position 0), with a paired jackknife interval: both runs deal the same
    conversations to the same resampling groups. Refuses runs with different group counts."""
    from ..stats.resampling import jackknife, values_and_replicates

    ga = stats_a.meta.get("intervals", {}).get("groups")
    gb = stats_b.meta.get("intervals", {}).get("groups")
    if ga != gb or stats_a.meta.get("dataset") != stats_b.meta.get("dataset"):
        raise WavesurfError(f"a paired difference needs runs on the same corpus with the same resampling groups; "
                            f"got {ga} groups on {stats_a.meta.get('dataset')!r} and {gb} on {stats_b.meta.get('dataset')!r}")
    ea, ra = values_and_replicates(stats_a.main, quantity)
    eb, rb = values_and_replicates(stats_b.main, quantity)
    return jackknife(ea - eb, ra - rb, level=level)


def interval_note(stats: Any) -> str:
    """One sentence on the intervals of a run: how they are computed, or why there are none."""
    iv = stats.meta.get("intervals", {})
    if getattr(stats, "has_intervals", False):
        return (f"Intervals are 95% grouped-jackknife intervals over {iv.get('groups')} groups of whole "
                f"conversations, from the same pass ({iv.get('exact_cka', '')} for CKA).")
    note = (stats.main.interval_note or "resample_groups=0").rstrip(".")
    return f"This run has no intervals ({note})."


def jackknife_agreement_note(stats: Any) -> str:
    """What a share of leave-one-group-out replicates can and cannot say (issue 32: it is not a
    stability estimate). Each replicate keeps (G-1)/G of the conversations, so a replicate's
    statistic moves about 1/sqrt(G-1) as far from the full-data value as a fresh sample's would:
    agreement across replicates overstates how often another sample gives the same answer."""
    groups = int(stats.meta.get("intervals", {}).get("groups") or 0)
    if groups < 2:
        return ""
    return (f"This is jackknife agreement, not stability: each of the {groups} replicates keeps "
            f"{groups - 1} of {groups} groups of conversations and moves about "
            f"1/{np.sqrt(groups - 1):.1f} as far as a new sample would, so it overstates how often "
            f"another sample would give the same answer; a low share is evidence of instability, a high "
            f"one is not evidence of stability.")


def profile_probe(target: Target, params: NotebookParams, include: Iterable[Sequence[int]], k: int = 3,
                  progress: bool = True) -> Any:
    """The predictive probe (:func:`wavesurf.stats.probe.probe_layer_sets`) of every k-set of the
    target's ids (a seeded sample past 10,000 sets) plus ``include``, with top-1 agreement for the
    ``include`` sets, on the profile's statistics corpus and token budget (cached)."""
    from ..stats.probe import ProbeSettings, probe_layer_sets

    a = params.profile_spec.analysis
    corpus = statistics_corpus(params)
    settings = ProbeSettings(**corpus, split_seed=0, max_len=a.max_len, batch_tokens=a.batch_tokens,
                             pilot_tokens=min(ProbeSettings.pilot_tokens, corpus["max_tokens"] // 2))
    sets = [list(s) for s in include]
    return probe_layer_sets(target, k=k, settings=settings, include=sets, top1_sets=sets, seed=params.seed,
                            progress=progress)


def criteria_against_heads(stats: Any, trained: Sequence[Any], table: Any, settings: Any, seed: int = 0,
                           probe: Any = None) -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    """Every criterion (:func:`wavesurf.criteria.set_criteria`, on ``stats``) of each layer set the
    speed table ``table`` trained, and each criterion's rank correlation with those heads' τ at the
    table's draft length and level (:func:`wavesurf.criteria.criteria_vs_tau`: sets, sequences and
    seeds resampled). Returns ``(criteria per set, correlation rows)``."""
    from ..criteria import criteria_vs_tau, set_criteria

    criteria = [set_criteria(stats, s.layer_ids, probe=probe) for s in trained]
    rows = criteria_vs_tau(criteria, [table.runs[s.name] for s in trained], table.info["draft_len"],
                           level=table.info["level"], n_boot=settings.acceptance.n_boot, seed=seed)
    return criteria, rows


# ---------------------------------------------------------------------------------------------
def fmt_ids(ids: Iterable[int]) -> str:
    """``[2, 15, 27]`` as prose text."""
    return "[" + ", ".join(str(int(i)) for i in ids) + "]"


def profile_speed_table(target: Target, params: NotebookParams, k: int = 3, progress: bool = True) -> tuple[list, Any, Any]:
    """The speed-table experiment at the profile's drafter budgets: layer sets from the unfiltered
    and the filtered statistics (``base`` and ``selection`` variants, or ``served`` and
    ``served:selection`` when the profile selects on served positions), then one drafter per set and
    seed. Returns ``(sets, settings, table)``; every drafter and benchmark is cached."""
    from .speed_table import SpeedTableSettings, run_speed_table
    from .table_sets import layer_sets

    settings = SpeedTableSettings.from_profile(params.profile_spec.drafter)
    unfiltered, filtered = selection_variant_names(params)
    stats = profile_stats(target, params, [unfiltered, filtered], progress=progress)
    sets = layer_sets(stats[unfiltered], stats[filtered], k=k, methods=settings.methods, n_random=settings.n_random,
                      seed=params.seed)
    return sets, settings, run_speed_table(target, sets, settings, progress=progress)
