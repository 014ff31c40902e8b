"""What the paper-companion notebooks share beyond the statistics themselves: closed-form scores
over layer sets, intervals in prose, the speed-table run at a profile's budgets (the selection and
filter-sweep tables live in :mod:`wavesurf.select`).
The profile's analysis variants and the cached-results lookup live in :mod:`wavesurf.stats.variants`;
parameter checks and the first cell in :mod:`wavesurf.notebook`.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .cache import write_rows_csv
from .errors import WavesurfError
from .notebook import NotebookParams
from .stats.variants import profile_stats


# ---------------------------------------------------------------------------------------------
def all_subsets(layer_ids: Sequence[int], k: int) -> np.ndarray:
    """Every k-subset of ``layer_ids`` as an ``[m, k]`` int64 array (sorted rows)."""
    return np.array(list(itertools.combinations(sorted(layer_ids), k)), dtype=np.int64).reshape(-1, k)


def aggregate_entropy2(stats: Any, subsets: Any) -> np.ndarray:
    """Alpha=2 aggregate entropy (nats) of layer-id subsets (rows), exact closed form."""
    from .stats.entropy import aggregate_entropy2_closed_form

    return aggregate_entropy2_closed_form(stats.purity, stats.cka, _positions(stats, subsets))


def redundancy2(stats: Any, subsets: Any) -> np.ndarray:
    """Alpha=2 redundancy (nats, >= 0) of layer-id subsets: the block-diagonal alpha=2 entropy
    minus the joint one, i.e. ``log(sum P + sum_{a!=b} CKA sqrt(P P)) - log(sum P)``."""
    from .stats.entropy import redundancy2_closed_form

    return redundancy2_closed_form(stats.purity, stats.cka, _positions(stats, subsets))


def pair_matrix(stats: Any, fn: Any = None) -> np.ndarray:
    """``[L, L]`` matrix of a set score over layer pairs (default: alpha=2 aggregate entropy); the
    diagonal holds the single layer's score."""
    fn = fn or aggregate_entropy2
    ids = list(stats.layer_ids)
    L = len(ids)
    pairs = np.array([[a, b] for a in ids for b in ids], dtype=np.int64)
    vals = np.empty(len(pairs))
    diag = pairs[:, 0] == pairs[:, 1]
    vals[diag] = fn(stats, pairs[diag][:, :1])
    vals[~diag] = fn(stats, pairs[~diag])
    return vals.reshape(L, L)


def _positions(stats: Any, subsets: Any) -> np.ndarray:
    pos = {lid: k for k, lid in enumerate(stats.layer_ids)}
    sub = np.asarray(subsets, dtype=np.int64)
    if sub.ndim == 1:
        sub = sub[None, :]
    try:
        return np.vectorize(pos.__getitem__, otypes=[np.int64])(sub)
    except KeyError as exc:
        raise WavesurfError(f"layer id {exc.args[0]} is not in the statistics (ids {stats.layer_ids})") from None


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
    from .stats.resampling import jackknife, values_and_replicates

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


# ---------------------------------------------------------------------------------------------
_MODEL_FIELDS = ("model", "source", "n_layers", "hidden_size", "dtype", "wavesurf", "format")


def fmt_ids(ids: Iterable[int]) -> str:
    """``[2, 15, 27]`` as prose text."""
    return "[" + ", ".join(str(int(i)) for i in ids) + "]"


def depth_curves(stats: Any) -> dict[str, np.ndarray]:
    """Per-layer matrix entropy of the main subset: alpha 1 and 2, in nats and normalised by the
    maximum ``log min(n - 1, d)``; with resampling replicates also ``<key>_band`` = (low, high)."""
    from .stats.entropy import max_entropy

    top = max_entropy(int(stats.main.n_tokens), int(stats.meta["hidden_size"]))
    out = {"S1": np.asarray(stats.entropy), "S2": np.asarray(stats.entropy2),
           "S1_norm": np.asarray(stats.entropy) / top, "S2_norm": np.asarray(stats.entropy2) / top}
    if getattr(stats, "has_intervals", False):  # "<key>_band": (low, high) of the 95% interval
        j1, j2 = stats.interval("entropy"), stats.interval("entropy2")
        out.update(S1_band=(j1.low, j1.high), S2_band=(j2.low, j2.high),
                   S1_norm_band=(j1.low / top, j1.high / top), S2_norm_band=(j2.low / top, j2.high / top))
    return out


def profile_speed_table(target: Any, params: NotebookParams, k: int = 3, progress: bool = True) -> tuple[list, Any, Any]:
    """The speed-table experiment at the profile's drafter budgets: layer sets from the unfiltered
    and the filtered statistics (``base`` and ``selection`` variants), then one drafter per set and
    seed. Returns ``(sets, settings, table)``; every drafter and benchmark is cached."""
    from .speed_table import SpeedTableSettings, layer_sets, run_speed_table

    settings = SpeedTableSettings.from_profile(params.profile_spec.drafter)
    stats = profile_stats(target, params, ["base", "selection"], progress=progress)
    sets = layer_sets(stats["base"], stats["selection"], k=k, methods=settings.methods, n_random=settings.n_random,
                      seed=params.seed)
    return sets, settings, run_speed_table(target, sets, settings, progress=progress)
