"""What the paper-companion notebooks share beyond the statistics themselves: closed-form scores
over layer sets, the selection and filter-sweep tables, the speed-table run at a profile's budgets.
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
from .stats.variants import control_view, profile_stats


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
    from .stats.entropy import aggregate_entropy2_closed_form

    sub = _positions(stats, subsets)
    no_cross = np.eye(len(stats.purity))
    return (aggregate_entropy2_closed_form(stats.purity, no_cross, sub)
            - aggregate_entropy2_closed_form(stats.purity, stats.cka, sub))


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
def selection_rows(stats: Any, k: int = 3, methods: Sequence[str] | None = None, **options: Any) -> list[dict[str, Any]]:
    """One tidy row per method: ids (vLLM and SGLang), scores, reason, and how it compares with
    the default rule (alpha=2 aggregate entropy and mean pairwise CKA difference)."""
    from .select import METHODS, select_layers, selection_recurrence

    methods = list(methods or METHODS)
    if k != 3 and "default" in methods:
        methods.remove("default")
    rows = []
    default = select_layers(stats, k=3, method="default") if k == 3 else None
    has_iv = getattr(stats, "has_intervals", False)
    for m in methods:
        sel = select_layers(stats, k=k, method=m, **options.get(m, {}))
        s = sel.scores
        row = {
            "method": m, "layer_ids": " ".join(map(str, sel.layer_ids)),
            "sglang_layer_ids": " ".join("-" if i is None else str(i) for i in sel.sglang_layer_ids),
            "mean_entropy_nats": s["mean_entropy_nats"], "mean_pairwise_cka": s["mean_pairwise_cka"],
            "aggregate_entropy2_nats": s["aggregate_entropy2_nats"],
            "aggregate_entropy1_nats": s.get("aggregate_entropy1_nats", ""),
            "redundancy2_nats": round(float(redundancy2(stats, [sel.layer_ids])[0]), 4),
            "same_as_default": default is not None and sel.layer_ids == default.layer_ids,
            "reason": sel.reason,
        }
        if default is not None:
            row["delta_aggregate_entropy2_vs_default"] = round(
                s["aggregate_entropy2_nats"] - default.scores["aggregate_entropy2_nats"], 4)
            if has_iv:
                jk = stats.aggregate_entropy2_difference(sel.layer_ids, default.layer_ids)
                row["delta_aggregate_entropy2_low"] = round(float(jk.low), 4)
                row["delta_aggregate_entropy2_high"] = round(float(jk.high), 4)
        if has_iv:
            rj = stats.redundancy2([sel.layer_ids])
            row["redundancy2_low"], row["redundancy2_high"] = round(float(rj.low[0]), 4), round(float(rj.high[0]), 4)
        if has_iv:  # how often the same set is chosen with one group of conversations left out
            row["chosen_in_resamples"] = round(float(selection_recurrence(stats, k, m, **options.get(m, {}))), 4)
        rows.append(row)
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Tidy CSV (header from the first row's keys)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        raise WavesurfError(f"no rows to write to {path}")
    return write_rows_csv(path, rows, float_format=".6g")


def sweep_rows(stats_by_variant: dict[str, Any], method: str = "combined", k: int = 3) -> list[dict[str, Any]]:
    """Tidy rows of a token-entropy filter sweep: per filter and subset (filtered / random
    control / all tokens) the kept tokens, threshold, mean entropy, mean neighbour CKA, mean CKA
    to the last layer, compartments and the layer set ``method`` selects."""
    from .select import select_layers, selection_recurrence
    from .stats.cka import cka_to_last, neighbour_cka

    rows = []
    for name, stats in stats_by_variant.items():
        f = stats.meta["filter"]
        views = [("all" if stats.control is None else "filtered", stats)]
        if stats.control is not None:
            views.append(("random", control_view(stats)))
        for subset, view in views:
            sel = select_layers(view, k=k, method=method)
            ivals: dict[str, Any] = {}
            if getattr(view, "has_intervals", False):
                for col, q in _SWEEP_METRICS.items():
                    jk = view.interval(q)
                    ivals[f"{col}_low"], ivals[f"{col}_high"] = round(float(jk.low), 4), round(float(jk.high), 4)
                    if subset == "filtered" and stats.control.replicates is not None:
                        dj = stats.control_difference(q)
                        ivals[f"{col}_minus_random"] = round(float(dj.estimate), 4)
                        ivals[f"{col}_minus_random_low"] = round(float(dj.low), 4)
                        ivals[f"{col}_minus_random_high"] = round(float(dj.high), 4)
                ivals["selected_in_resamples"] = round(float(selection_recurrence(view, k, method)), 4)
            rows.append({
                "variant": name, "filter": f["filter"], "subset": subset,
                "threshold_nats": f["threshold_nats"] if f["threshold_nats"] is not None else "",
                "kept_fraction": f["kept_fraction"] if stats.control is not None else 1.0,
                "tokens": int(view.main.n_tokens),
                "mean_entropy_nats": round(float(np.mean(view.entropy)), 4),
                "mean_normalized_entropy": round(float(np.mean(view.normalized_entropy)), 4),
                "mean_neighbour_cka": round(float(np.mean(neighbour_cka(view.cka))), 4),
                "mean_cka_to_last": round(float(np.mean(cka_to_last(view.cka))), 4),
                "n_compartments": len(view.compartments),
                "compartments": " ".join(f"{a}-{b}" for a, b in view.compartments),
                "method": method, "selected_ids": " ".join(map(str, sel.layer_ids)), **ivals,
            })
    return rows


#: Columns of :func:`sweep_rows` and the LayerStats quantities they average over layers.
_SWEEP_METRICS = {"mean_entropy_nats": "mean_entropy", "mean_normalized_entropy": "mean_normalized_entropy",
                  "mean_neighbour_cka": "mean_cka_next", "mean_cka_to_last": "mean_cka_to_last"}


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
