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
    from .select import METHODS, select_layers

    methods = list(methods or METHODS)
    if k != 3 and "default" in methods:
        methods.remove("default")
    rows = []
    default = select_layers(stats, k=3, method="default") if k == 3 else None
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
    from .select import select_layers
    from .stats.cka import cka_to_last, neighbour_cka

    rows = []
    for name, stats in stats_by_variant.items():
        f = stats.meta["filter"]
        views = [("all" if stats.control is None else "filtered", stats)]
        if stats.control is not None:
            views.append(("random", control_view(stats)))
        for subset, view in views:
            sel = select_layers(view, k=k, method=method)
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
                "method": method, "selected_ids": " ".join(map(str, sel.layer_ids)),
            })
    return rows


# ---------------------------------------------------------------------------------------------
_MODEL_FIELDS = ("model", "source", "n_layers", "hidden_size", "dtype", "wavesurf", "format")


def fmt_ids(ids: Iterable[int]) -> str:
    """``[2, 15, 27]`` as prose text."""
    return "[" + ", ".join(str(int(i)) for i in ids) + "]"


def depth_curves(stats: Any) -> dict[str, np.ndarray]:
    """Per-layer matrix entropy of the main subset: alpha 1 and 2, in nats and normalised by the
    maximum ``log min(n - 1, d)``."""
    from .stats.entropy import max_entropy

    top = max_entropy(int(stats.main.n_tokens), int(stats.meta["hidden_size"]))
    return {"S1": np.asarray(stats.entropy), "S2": np.asarray(stats.entropy2),
            "S1_norm": np.asarray(stats.entropy) / top, "S2_norm": np.asarray(stats.entropy2) / top}


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
