"""Which criterion predicts a good drafter: the statistics the selection methods read, evaluated on
every layer set the speed table trains, and each one's rank correlation with those heads' offline
acceptance length τ (the paper's recipe is useful only if a criterion ranks layer sets the way
drafters rank them).

The interval of a correlation resamples what is random in it: the layer sets (a correlation over
another draw of sets), and each set's τ over held-out sequences and training seeds (the two-level
replicates of :mod:`wavesurf.drafter.intervals`, shared by every set, so the pairing of the sets'
τ is kept). With a dozen sets the interval is wide, and the page says so whatever it is.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import WavesurfError

#: criterion -> (what it is, the sign a useful criterion's correlation with τ should have)
CRITERIA: dict[str, tuple[str, int]] = {
    "mean_entropy": ("mean matrix entropy S1 of the set's layers (nats)", +1),
    "aggregate_entropy2": ("aggregate entropy S2 of the set's concatenated streams (nats)", +1),
    "aggregate_entropy1": ("aggregate entropy S1 of the set's concatenated streams (nats; exact analyses)", +1),
    "redundancy2": ("redundancy: sum of the layers' S2 minus the set's aggregate S2 (nats)", -1),
    "mean_pairwise_cka": ("mean pairwise linear CKA of the set's layers", -1),
    "probe_r2": ("held-out R2 of the ridge probe of the target's next last-layer state", +1),
}


def set_criteria(stats: Any, layer_ids: Sequence[int], probe: Any = None) -> dict[str, float]:
    """Every criterion of :data:`CRITERIA` for one layer set (vLLM ids) from a
    :class:`~wavesurf.stats.results.LayerStats`; ``aggregate_entropy1`` only where the analysis
    kept the cross-layer covariances, ``probe_r2`` only with a probe result
    (:func:`wavesurf.stats.probe.probe_layer_sets`) that scored this set (else NaN)."""
    from .select import AGG1_MAX_DIM

    ids = sorted(int(i) for i in layer_ids)
    position = {lid: i for i, lid in enumerate(stats.layer_ids)}
    missing = [i for i in ids if i not in position]
    if missing:
        raise WavesurfError(f"layer ids {missing} are not in the statistics (ids {stats.layer_ids[0]}.."
                            f"{stats.layer_ids[-1]})")
    rows = [position[i] for i in ids]
    pairs = list(stats.pair_cka(ids).values())
    out = {"mean_entropy": float(np.mean(np.asarray(stats.entropy, dtype=np.float64)[rows])),
           "aggregate_entropy2": float(stats.aggregate_entropy2([ids])[0]),
           "aggregate_entropy1": math.nan,
           "redundancy2": float(stats.redundancy2([ids])[0]),
           "mean_pairwise_cka": float(np.mean(pairs)) if pairs else math.nan,
           "probe_r2": math.nan}
    if getattr(stats, "has_cross_covariance", False) and len(ids) * stats.main.cross.dim <= AGG1_MAX_DIM:
        out["aggregate_entropy1"] = float(stats.aggregate_entropy(ids, alpha=1.0))
    if probe is not None:
        try:
            out["probe_r2"] = float(probe.score(ids))
        except (KeyError, ValueError, WavesurfError):
            pass
    return out


def spearman(x: Any, y: Any) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN when either side is constant."""
    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v), dtype=np.float64)
        r[order] = np.arange(len(v), dtype=np.float64)
        for value in np.unique(v):  # ties share their mean rank
            tie = v == value
            if tie.sum() > 1:
                r[tie] = r[tie].mean()
        return r

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / den) if den > 0 else math.nan


def criteria_vs_tau(criteria: Sequence[dict[str, float]], runs: Sequence[Sequence[Any]], draft_len: int, *,
                    level: float = 0.95, n_boot: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """Rank correlation of each criterion with τ at ``draft_len`` across layer sets: ``criteria[g]``
    holds :func:`set_criteria` of set g and ``runs[g]`` its acceptance runs (one per training seed,
    all on the same held-out continuations). The interval resamples the sets with replacement and,
    on the same replicate, held-out sequences and seeds (two-level, shared by all sets); percentile
    interval at ``level``. A criterion with fewer than 4 sets of finite values is reported without
    a correlation. ``agrees`` says whether the interval lies on the side a useful criterion's
    correlation should (:data:`CRITERIA`)."""
    from .drafter.acceptance import acceptance_arrays
    from .drafter.intervals import check_level, tau_replicates

    level = check_level(level)
    if len(criteria) != len(runs):
        raise WavesurfError(f"{len(criteria)} sets of criteria for {len(runs)} sets of runs")
    committed, cycles = acceptance_arrays(runs, draft_len)
    rep, per_seed = tau_replicates(committed, cycles, n_boot=n_boot, seed=seed)  # [B, G], [G, K]
    tau = np.nanmean(per_seed, axis=1)  # sets may have different numbers of seeds (NaN where missing)
    rng = np.random.default_rng([seed, 1])
    picks = rng.integers(0, len(runs), size=(n_boot, len(runs)))
    a = (1 - level) / 2
    out = []
    for name, (what, sign) in CRITERIA.items():
        values = np.array([c.get(name, math.nan) for c in criteria], dtype=np.float64)
        ok = np.isfinite(values)
        row: dict[str, Any] = {"criterion": name, "what": what, "expected_sign": "+" if sign > 0 else "-",
                               "sets": int(ok.sum()), "rho": math.nan, "rho_lo": math.nan, "rho_hi": math.nan,
                               "agrees": ""}
        if ok.sum() >= 4:
            keep = np.flatnonzero(ok)
            row["rho"] = spearman(values[keep], tau[keep])
            boot = []
            for b in range(n_boot):
                idx = keep[rng.integers(0, len(keep), size=len(keep))] if not ok.all() else picks[b]
                boot.append(spearman(values[idx], rep[b, idx]))
            boot = np.asarray(boot)
            boot = boot[np.isfinite(boot)]
            if len(boot) >= 0.5 * n_boot:
                row["rho_lo"], row["rho_hi"] = (float(q) for q in np.quantile(boot, [a, 1 - a]))
                lo, hi = row["rho_lo"], row["rho_hi"]
                row["agrees"] = ("yes" if (lo > 0 if sign > 0 else hi < 0) else
                                 "opposite" if (hi < 0 if sign > 0 else lo > 0) else "undecided")
        out.append({k: round(v, 4) if isinstance(v, float) and math.isfinite(v) else v for k, v in row.items()})
    return out


def criteria_sentence(rows: Sequence[dict[str, Any]], level: float = 0.95) -> str:
    """What the correlations say, in one sentence, whatever they say."""
    shown = [r for r in rows if isinstance(r["rho"], float) and math.isfinite(r["rho"])]
    if not shown:
        return "Too few trained layer sets to correlate any criterion with the heads' τ (at least 4)."
    pct = round(100 * level)
    parts = [f"{r['criterion']} ρ = {r['rho']:+.2f}" + (f" ({pct}% CI {r['rho_lo']:+.2f} to {r['rho_hi']:+.2f})"
                                                         if r["agrees"] else "") for r in shown]
    good = [r["criterion"] for r in shown if r["agrees"] == "yes"]
    opposite = [r["criterion"] for r in shown if r["agrees"] == "opposite"]
    verdict = (f"Beyond its interval, {', '.join(good)} rank{'s' if len(good) == 1 else ''} the trained sets the way "
               "their heads do" if good else
               "No criterion ranks the trained sets the way their heads do beyond its interval")
    if opposite:
        verdict += (f"; {', '.join(opposite)} correlate{'s' if len(opposite) == 1 else ''} with the opposite sign "
                    "to the one a criterion of diversity assumes (more redundant sets drafted better)")
    return (f"Across the {shown[0]['sets']} trained layer sets, rank correlation with the heads' τ: "
            + "; ".join(parts) + f". {verdict}.")


__all__ = ["CRITERIA", "criteria_sentence", "criteria_vs_tau", "set_criteria", "spearman"]
