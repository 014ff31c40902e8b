"""Layer-selection methods: which k layers (vLLM ids) an EAGLE-3 drafter should read.

Every method scores candidate layers from one :class:`~wavesurf.stats.analysis.LayerStats`
(entropy per layer, purities, the CKA matrix) and returns a :class:`Selection` with the ids in
the vLLM convention, the SpecForge/SGLang ids, the scores and a one-line reason.

Candidates are ids 1..N by default: id 0 (the embedding output) has no SpecForge/SGLang
"output of block k" id and the drafter already embeds the tokens itself; pass
``candidates=range(0, N+1)`` to allow it.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .errors import SelectionError, is_int
from .models import block_output_ids, check_layer_ids, default_layer_ids
from .stats.compartments import compartments
from .stats.entropy import aggregate_entropy2_closed_form

#: Above this many k-subsets, exhaustive methods switch to greedy forward selection.
EXHAUSTIVE_LIMIT = 2_000_000
#: Sets re-scored with the exact alpha=1 aggregate entropy after alpha=2 screening.
SHORTLIST = 8
#: The alpha=1 aggregate entropy needs an eigendecomposition of a (k*d)^2 matrix; above this
#: size (k*d) it is left out of the scores (a 31-layer set of SmolLM2 would take minutes).
AGG1_MAX_DIM = 4096



@dataclass
class Selection:
    layer_ids: list[int]
    sglang_layer_ids: list[int | None]
    method: str
    k: int
    scores: dict[str, Any]
    reason: str
    convention: str = "vllm"
    stats_key: str | None = None
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    n_layers: int | None = None  # N of the target (needed to say which ids a server can capture)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def eagle_config(self, flavour: str = "specforge", architecture: str | None = None) -> dict[str, Any]:
        """The snippet a drafter config for consumer ``flavour`` (a :data:`wavesurf.consumers.FORMATS`
        name) needs to read these layers of a target of ``architecture`` (its HF class, e.g.
        ``LlamaForCausalLM``: SGLang's id rule depends on it), by that consumer's own rule."""
        from .consumers import config_snippet

        if self.n_layers is None:
            raise SelectionError("this selection does not record its target's number of layers; select again")
        return config_snippet(flavour, self.layer_ids, self.n_layers, architecture)


# ---------------------------------------------------------------------------------------------
def all_subsets(layer_ids: Iterable[int], k: int) -> np.ndarray:
    """Every k-subset of ``layer_ids`` as an ``[m, k]`` int64 array (sorted rows, lexicographic)."""
    return np.array(list(itertools.combinations(sorted(layer_ids), k)), dtype=np.int64).reshape(-1, k)


def check_k(k: Any, n_layers: int) -> int:
    """k layers out of the N+1 layer ids 0..N."""
    if not is_int(k, 1, n_layers + 1):
        raise SelectionError(f"k={k!r} is out of range: allowed are 1..{n_layers + 1} (N+1 layer ids for this model)")
    return int(k)


def check_method(method: str) -> str:
    if method not in METHODS:
        raise SelectionError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    return method


def _pair_mean(cka: np.ndarray, subsets: np.ndarray) -> np.ndarray:
    """Mean off-diagonal CKA within each subset row (0 for singletons)."""
    k = subsets.shape[1]
    if k < 2:
        return np.zeros(len(subsets))
    total = np.zeros(len(subsets))
    for a, b in itertools.combinations(range(k), 2):
        total += cka[subsets[:, a], subsets[:, b]]
    return total / (k * (k - 1) / 2)


def _best_subsets(score: Callable[[np.ndarray], np.ndarray], cand: list[int], k: int, top: int = 1) -> tuple[np.ndarray, np.ndarray, str]:
    """Highest-scoring k-subsets of ``cand`` (indices into the stats arrays): exhaustive when
    C(|cand|, k) <= EXHAUSTIVE_LIMIT, else greedy forward selection (then ``top`` = 1)."""
    n_sets = math.comb(len(cand), k)
    if n_sets <= EXHAUSTIVE_LIMIT:
        best_sets, best_scores = np.empty((0, k), dtype=np.int64), np.empty(0)
        combos = itertools.combinations(cand, k)
        while True:
            chunk = np.fromiter(itertools.chain.from_iterable(itertools.islice(combos, 200_000)), dtype=np.int64)
            if chunk.size == 0:
                break
            subsets = chunk.reshape(-1, k)
            s = score(subsets)
            keep = np.argsort(-s, kind="stable")[:top]
            best_sets = np.concatenate([best_sets, subsets[keep]])
            best_scores = np.concatenate([best_scores, s[keep]])
        order = np.argsort(-best_scores, kind="stable")[:top]
        return best_sets[order], best_scores[order], f"exhaustive over {n_sets:,} sets"
    chosen: list[int] = []
    for _ in range(k):
        rest = [c for c in cand if c not in chosen]
        trial = np.array([sorted(chosen + [c]) for c in rest], dtype=np.int64)
        # score partial sets with the same function (it accepts any set size)
        s = score(trial)
        chosen = list(trial[int(np.argmax(s))])
    final = np.array([sorted(chosen)], dtype=np.int64)
    return final, score(final), f"greedy forward selection ({n_sets:,} sets is too many to enumerate)"


class _Context:
    """Arrays of one LayerStats aligned by layer id, plus the candidate list."""

    def __init__(self, stats: Any, k: int, candidates: Iterable[int] | None):
        self.stats = stats
        self.n_layers = int(stats.n_layers)
        L = self.n_layers + 1
        k = check_k(k, self.n_layers)
        cand = list(range(1, L)) if candidates is None else check_layer_ids(list(candidates), self.n_layers)
        if len(cand) < k:
            raise SelectionError(f"k={k} is more than the {len(cand)} candidate layers {cand}")
        self.k, self.cand = int(k), sorted(cand)
        self.entropy = np.asarray(stats.entropy, dtype=np.float64)
        self.norm_entropy = np.asarray(stats.normalized_entropy, dtype=np.float64)
        self.purity = np.asarray(stats.purity, dtype=np.float64)
        self.cka = np.asarray(stats.cka, dtype=np.float64)

    def s2(self, subsets: np.ndarray) -> np.ndarray:
        return aggregate_entropy2_closed_form(self.purity, self.cka, subsets)

    def describe(self, ids: Sequence[int]) -> dict[str, Any]:
        arr = np.array([sorted(ids)])
        return {
            "entropy_nats": [round(float(self.entropy[i]), 4) for i in ids],
            "mean_entropy_nats": round(float(self.entropy[list(ids)].mean()), 4),
            "mean_pairwise_cka": round(float(_pair_mean(self.cka, arr)[0]), 4),
            "aggregate_entropy2_nats": round(float(self.s2(arr)[0]), 4),
        }


def _finish(ctx: _Context, ids: Sequence[int], method: str, reason: str, extra: dict[str, Any] | None = None,
            alternatives: list[dict[str, Any]] | None = None) -> Selection:
    ids = [int(i) for i in sorted(ids)]
    scores = {**ctx.describe(ids), **(extra or {})}
    agg1 = getattr(ctx.stats, "aggregate_entropy", None)
    small = len(ids) * ctx.stats.main.cross.dim <= AGG1_MAX_DIM if getattr(ctx.stats, "has_cross_covariance", False) else False
    if "aggregate_entropy1_nats" not in scores and agg1 is not None and small:
        scores["aggregate_entropy1_nats"] = round(float(agg1(ids, alpha=1.0)), 4)
    return Selection(ids, block_output_ids(ids), method, ctx.k, scores, reason,
                     stats_key=getattr(ctx.stats, "key", None), alternatives=alternatives or [],
                     n_layers=ctx.n_layers)


# ---------------------------------------------------------------------------------------------
def select_default(ctx: _Context) -> Selection:
    if ctx.k != 3:
        raise SelectionError(f"method 'default' is the fixed EAGLE-3 rule [2, N//2, N-3] and needs k=3, got k={ctx.k}")
    ids = default_layer_ids(ctx.n_layers)
    return _finish(ctx, ids, "default", f"the fixed EAGLE-3 rule [2, N//2, N-3] with N={ctx.n_layers}")


def select_entropy(ctx: _Context, min_spacing: int | None = None) -> Selection:
    """Most informative single layers (alpha=1 entropy), at least ``min_spacing`` ids apart
    (default: max(1, N // (2k)), so k picks can still spread over depth)."""
    spacing = max(1, ctx.n_layers // (2 * ctx.k)) if min_spacing is None else int(min_spacing)
    order = sorted(ctx.cand, key=lambda i: (-ctx.entropy[i], i))
    chosen: list[int] = []
    for i in order:
        if all(abs(i - j) >= spacing for j in chosen):
            chosen.append(i)
        if len(chosen) == ctx.k:
            break
    if len(chosen) < ctx.k:
        raise SelectionError(f"cannot place k={ctx.k} layers {spacing} ids apart among candidates {ctx.cand}; lower min_spacing")
    return _finish(ctx, chosen, "entropy",
                   f"the {ctx.k} highest-entropy layers at least {spacing} ids apart", {"min_spacing": spacing})


def select_aggregate(ctx: _Context) -> Selection:
    """Maximum aggregate entropy of the unit-trace concatenation: every k-subset scored with the
    exact alpha=2 closed form, the best few re-scored with the alpha=1 entropy when the
    cross-covariances are available."""
    top = SHORTLIST
    sets, s2, how = _best_subsets(ctx.s2, ctx.cand, ctx.k, top=top)
    alternatives = [{"layer_ids": [int(i) for i in s], "aggregate_entropy2_nats": round(float(v), 4)} for s, v in zip(sets, s2)]
    best, basis = sets[0], "alpha=2"
    if getattr(ctx.stats, "has_cross_covariance", False) and len(sets) > 1 and ctx.k * ctx.stats.main.cross.dim <= AGG1_MAX_DIM:
        s1 = np.array([ctx.stats.aggregate_entropy([int(i) for i in s], alpha=1.0) for s in sets])
        for alt, v in zip(alternatives, s1):
            alt["aggregate_entropy1_nats"] = round(float(v), 4)
        best, basis = sets[int(np.argmax(s1))], f"alpha=1 among the top {len(sets)} by alpha=2"
    return _finish(ctx, best, "aggregate", f"maximum aggregate entropy ({basis}; {how})",
                   alternatives=alternatives)


def select_cka(ctx: _Context) -> Selection:
    """One informative layer from each of k compartments (contiguous CKA blocks, exact DP for k
    blocks over the candidates), the combination with minimal mean pairwise CKA among layers
    whose entropy is at least the median of their compartment."""
    sub = np.ix_(ctx.cand, ctx.cand)
    blocks = compartments(ctx.cka[sub], n_blocks=ctx.k, max_blocks=max(ctx.k, 1))
    pools = []
    for start, end in blocks:
        members = ctx.cand[start : end + 1]
        ent = ctx.entropy[members]
        pools.append([m for m, e in zip(members, ent) if e >= np.median(ent)])
    combos = np.array(list(itertools.product(*pools)), dtype=np.int64)
    pair = _pair_mean(ctx.cka, combos)
    mean_ent = ctx.entropy[combos].mean(axis=1)
    best = combos[np.lexsort((-mean_ent, pair))[0]]
    ranges = [[ctx.cand[s], ctx.cand[e]] for s, e in blocks]
    return _finish(ctx, best, "cka", f"one informative layer from each of {ctx.k} CKA compartments {ranges}, "
                   "least mutually similar", {"compartments": ranges})


def select_combined(ctx: _Context, trade_off: float = 0.5) -> Selection:
    """Maximise (1 - t) * mean normalised entropy + t * (1 - mean pairwise CKA): informativeness
    and diversity, both in [0, 1]; t = ``trade_off`` (0 = entropy only, 1 = diversity only)."""
    if not 0.0 <= trade_off <= 1.0:
        raise SelectionError(f"trade_off={trade_off} must be in [0, 1]")

    def score(subsets: np.ndarray) -> np.ndarray:
        return (1 - trade_off) * ctx.norm_entropy[subsets].mean(axis=1) + trade_off * (1 - _pair_mean(ctx.cka, subsets))

    sets, vals, how = _best_subsets(score, ctx.cand, ctx.k, top=5)
    alternatives = [{"layer_ids": [int(i) for i in s], "combined_score": round(float(v), 4)} for s, v in zip(sets, vals)]
    return _finish(ctx, sets[0], "combined",
                   f"best trade-off of normalised entropy and 1 - mean CKA (t={trade_off}; {how})",
                   {"combined_score": round(float(vals[0]), 4), "trade_off": trade_off}, alternatives)


METHODS: dict[str, Callable[..., Selection]] = {
    "default": select_default,
    "entropy": select_entropy,
    "aggregate": select_aggregate,
    "cka": select_cka,
    "combined": select_combined,
}


def select_layers(stats: Any, k: int = 3, method: str = "combined", candidates: Iterable[int] | None = None,
                  **options: Any) -> Selection:
    """Pick ``k`` layer ids (vLLM convention) with ``method`` (one of :data:`METHODS`)."""
    return METHODS[check_method(method)](_Context(stats, k, candidates), **options)


def selection_recurrence(stats: Any, k: int = 3, method: str = "combined", **options: Any) -> float | None:
    """Share of the leave-one-group-out resamples of ``stats`` in which ``method`` picks the same
    set as on all data, or None for statistics without resampling replicates. Both sides are
    scored without cross-layer covariances (a replicate has none), so ``aggregate`` is compared
    on its alpha=2 basis."""
    if not getattr(stats, "has_intervals", False):
        return None
    reference = select_layers(stats.alpha2_view(), k=k, method=method, **options).layer_ids
    views = stats.replicate_views()
    return sum(select_layers(v, k=k, method=method, **options).layer_ids == reference for v in views) / len(views)


# ---------------------------------------------------------------------------------------------
# the tables the selection and filtering pages show (tidy rows; lists of ids are written to CSV
# space-joined by wavesurf.cache.write_rows_csv)
def selection_rows(stats: Any, k: int = 3, methods: Sequence[str] | None = None, **options: Any) -> list[dict[str, Any]]:
    """One tidy row per method: ids (vLLM and SGLang), scores, reason, and how it compares with
    the default rule (alpha=2 aggregate entropy and mean pairwise CKA difference)."""
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
            "method": m, "layer_ids": list(sel.layer_ids),  # lists: the CSV writer joins them with spaces
            "sglang_layer_ids": ["-" if i is None else i for i in sel.sglang_layer_ids],
            "mean_entropy_nats": s["mean_entropy_nats"], "mean_pairwise_cka": s["mean_pairwise_cka"],
            "aggregate_entropy2_nats": s["aggregate_entropy2_nats"],
            "aggregate_entropy1_nats": s.get("aggregate_entropy1_nats", ""),
            "redundancy2_nats": round(float(stats.redundancy2([sel.layer_ids])[0]), 4),
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
            rj = stats.redundancy2_interval([sel.layer_ids])
            row["redundancy2_low"], row["redundancy2_high"] = round(float(rj.low[0]), 4), round(float(rj.high[0]), 4)
        if has_iv:  # how often the same set is chosen with one group of conversations left out
            row["chosen_in_resamples"] = round(float(selection_recurrence(stats, k, m, **options.get(m, {}))), 4)
        rows.append(row)
    return rows


def sweep_rows(stats_by_variant: dict[str, Any], method: str = "combined", k: int = 3) -> list[dict[str, Any]]:
    """Tidy rows of a token-entropy filter sweep: per filter and subset (filtered / random
    control / all tokens) the kept tokens, threshold, mean entropy, mean neighbour CKA, mean CKA
    to the last layer, compartments and the layer set ``method`` selects."""
    from .stats.cka import cka_to_last, neighbour_cka
    from .stats.variants import control_view

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
                "method": method, "selected_ids": list(sel.layer_ids), **ivals,
            })
    return rows


#: Columns of :func:`sweep_rows` and the LayerStats quantities they average over layers.
_SWEEP_METRICS = {"mean_entropy_nats": "mean_entropy", "mean_normalized_entropy": "mean_normalized_entropy",
                  "mean_neighbour_cka": "mean_cka_next", "mean_cka_to_last": "mean_cka_to_last"}


def cross_model_rows(bases: dict[str, Any], selections: dict[str, Any],
                     methods: Sequence[str] = ("default", "aggregate", "combined"), k: int = 3) -> list[dict[str, Any]]:
    """One row per model (sorted by name) of the across-models table: its compartments without a
    filter (from ``bases``) and the set each of ``methods`` selects from its filtered statistics
    (``selections``; the unfiltered ones where a model has none), in vLLM ids and as relative
    depth id / N."""
    rows = []
    for m in sorted(bases):
        s = selections.get(m, bases[m])
        row: dict[str, Any] = {"model": m, "N": s.n_layers,
                               "compartments (no filter)": " ".join(f"{a}-{b}" for a, b in bases[m].compartments)}
        for method in methods:
            ids = select_layers(s, k=k, method=method).layer_ids
            row[method] = ("[" + ", ".join(str(int(i)) for i in ids) + "] → ["
                           + ", ".join(f"{i / s.n_layers:.2f}" for i in ids) + "]")
        rows.append(row)
    return rows
