"""Layer-selection methods: which k layers (vLLM ids) an EAGLE-3 drafter should read.

Every method scores candidate layers from one :class:`~wavesurf.stats.results.LayerStats`
(entropy per layer, purities, the CKA matrix) and returns a :class:`Selection` with the ids in
the vLLM convention, the SpecForge/SGLang ids, the scores and a one-line reason.

Candidates are ids 1..N by default: id 0 (the embedding output) has no SpecForge/SGLang
"output of block k" id and the drafter already embeds the tokens itself; pass
``candidates=range(0, N+1)`` to allow it.

The methods isolate one criterion each where they can: ``entropy`` (informativeness alone, pure
top-k by S1), ``aggregate`` / ``greedy-aggregate`` (informativeness of the set as a whole),
``mrmr`` (informativeness minus redundancy, greedily), ``cka`` (one layer per CKA compartment),
``combined`` (standardised informativeness and diversity, trade-off t) and ``probe`` (held-out
predictive power of a ridge probe, :mod:`wavesurf.stats.probe`; it needs a capture of the target,
not only statistics). ``entropy-spaced`` keeps the earlier heuristic of top-S1 layers forced apart.

Over ~450 lines because every method in ``METHODS`` lives beside the others it is compared with
(each isolates one criterion) and shares their candidate and scoring helpers; the tidy tables of
selections are what the CLI's ``select`` writes.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
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


def _chunks(tuples: Iterator[tuple[int, ...]], k: int, size: int = 200_000) -> Iterator[np.ndarray]:
    """``k``-tuples from an iterator as ``[<=size, k]`` int64 chunks."""
    while True:
        chunk = np.fromiter(itertools.chain.from_iterable(itertools.islice(tuples, size)), dtype=np.int64)
        if chunk.size == 0:
            return
        yield chunk.reshape(-1, k)


def subset_chunks(cand: Sequence[int], k: int, size: int = 200_000) -> Iterator[np.ndarray]:
    """Every k-subset of ``cand`` in lexicographic order, as ``[<=size, k]`` int64 chunks."""
    return _chunks(itertools.combinations(sorted(cand), k), k, size)


def _best_subsets(score: Callable[[np.ndarray], np.ndarray], cand: list[int], k: int, top: int = 1) -> tuple[np.ndarray, np.ndarray, str]:
    """Highest-scoring k-subsets of ``cand`` (indices into the stats arrays): exhaustive when
    C(|cand|, k) <= EXHAUSTIVE_LIMIT, else greedy forward selection (then ``top`` = 1)."""
    n_sets = math.comb(len(cand), k)
    if n_sets <= EXHAUSTIVE_LIMIT:
        best_sets, best_scores = np.empty((0, k), dtype=np.int64), np.empty(0)
        for subsets in subset_chunks(cand, k):
            s = score(subsets)
            keep = np.argsort(-s, kind="stable")[:top]
            best_sets = np.concatenate([best_sets, subsets[keep]])
            best_scores = np.concatenate([best_scores, s[keep]])
        order = np.argsort(-best_scores, kind="stable")[:top]
        return best_sets[order], best_scores[order], f"exhaustive over {n_sets:,} sets"
    final = np.array([_greedy(score, cand, k)], dtype=np.int64)
    return final, score(final), f"greedy forward selection ({n_sets:,} sets is too many to enumerate)"


def _greedy(score: Callable[[np.ndarray], np.ndarray], cand: Sequence[int], k: int) -> list[int]:
    """Greedy forward selection: add, k times, the candidate whose set scores highest (``score``
    takes ``[m, j]`` sets of any size j; ties go to the lower id). Returns the sorted ids."""
    chosen: list[int] = []
    for _ in range(k):
        rest = [c for c in cand if c not in chosen]
        trial = np.array([sorted(chosen + [c]) for c in rest], dtype=np.int64)
        chosen = [int(i) for i in trial[int(np.argmax(score(trial)))]]
    return sorted(chosen)


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

    @property
    def compartments(self) -> list[tuple[int, int]]:
        """The CKA compartments (inclusive id ranges) the analysis found; for views without them
        (resampling replicates), the same rule applied to their CKA matrix."""
        found = getattr(self.stats, "compartments", None)
        if found is None:
            ids = list(self.stats.layer_ids)
            found = [(ids[a], ids[b]) for a, b in compartments(self.cka)]
        return [(int(a), int(b)) for a, b in found]

    def has_alpha1(self) -> bool:
        """Whether the exact alpha=1 aggregate entropy of a k-set is available and affordable."""
        return bool(getattr(self.stats, "has_cross_covariance", False)) and self.k * self.stats.main.cross.dim <= AGG1_MAX_DIM

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


def select_entropy(ctx: _Context) -> Selection:
    """Informativeness alone: the k candidates with the highest per-layer entropy S1 (alpha=1,
    nats), with no spacing rule (ties: the lower id). The same set maximises mean S1 over every
    k-subset of the candidates."""
    chosen = sorted(ctx.cand, key=lambda i: (-ctx.entropy[i], i))[: ctx.k]
    return _finish(ctx, chosen, "entropy", f"the {ctx.k} highest-entropy layers (S1), no spacing rule")


def _spaced(subsets: np.ndarray, spacing: int) -> np.ndarray:
    """Rows of sorted ids whose neighbours are at least ``spacing`` apart."""
    return np.ones(len(subsets), dtype=bool) if subsets.shape[1] < 2 else (np.diff(subsets, axis=1) >= spacing).all(axis=1)


def select_entropy_spaced(ctx: _Context, min_spacing: int | None = None) -> Selection:
    """A heuristic: the highest-S1 layers taken in turn, skipping any closer than ``min_spacing``
    ids to one already taken (default max(1, N // (2k)), so the picks spread over depth). It
    mixes informativeness with a spread rule; ``entropy`` is S1 alone. Reports the gap in mean S1
    to the best set that obeys the same spacing (exhaustive when enumerable)."""
    if min_spacing is not None and not is_int(min_spacing, 1):
        raise SelectionError(f"min_spacing={min_spacing!r} must be an integer >= 1")
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
    extra: dict[str, Any] = {"min_spacing": spacing}
    if math.comb(len(ctx.cand), ctx.k) <= EXHAUSTIVE_LIMIT:
        best = max(float(ctx.entropy[sub][_spaced(sub, spacing)].mean(axis=1).max(initial=-np.inf))
                   for sub in subset_chunks(ctx.cand, ctx.k))
        extra["mean_entropy_gap_to_spaced_optimum_nats"] = round(best - float(ctx.entropy[chosen].mean()), 6)
    return _finish(ctx, chosen, "entropy-spaced",
                   f"heuristic: the {ctx.k} highest-entropy layers taken in turn, at least {spacing} ids apart", extra)


def select_aggregate(ctx: _Context) -> Selection:
    """Maximum aggregate entropy of the unit-trace concatenation: every k-subset scored with the
    exact alpha=2 closed form, the best few re-scored with the alpha=1 entropy when the
    cross-covariances are available."""
    top = SHORTLIST
    sets, s2, how = _best_subsets(ctx.s2, ctx.cand, ctx.k, top=top)
    alternatives = [{"layer_ids": [int(i) for i in s], "aggregate_entropy2_nats": round(float(v), 4)} for s, v in zip(sets, s2)]
    best, basis = sets[0], "alpha=2"
    if ctx.has_alpha1() and len(sets) > 1:
        s1 = np.array([ctx.stats.aggregate_entropy([int(i) for i in s], alpha=1.0) for s in sets])
        for alt, v in zip(alternatives, s1):
            alt["aggregate_entropy1_nats"] = round(float(v), 4)
        best, basis = sets[int(np.argmax(s1))], f"alpha=1 among the top {len(sets)} by alpha=2"
    return _finish(ctx, best, "aggregate", f"maximum aggregate entropy ({basis}; {how})",
                   alternatives=alternatives)


def select_greedy_aggregate(ctx: _Context, alpha: float | None = None) -> Selection:
    """Greedy forward selection of maximum aggregate entropy: k times, add the layer that raises
    the set's aggregate entropy most. ``alpha`` 1 (default where the cross-layer covariances of an
    exact analysis are kept and k*d <= AGG1_MAX_DIM; one eigendecomposition per trial set) or 2
    (the closed form). What scales past exhaustive enumeration; the gap to the exhaustive alpha=2
    optimum is reported whenever C(|candidates|, k) <= EXHAUSTIVE_LIMIT (for alpha=1 the
    exhaustive optimum would need one eigendecomposition per set and is not computed)."""
    if alpha is None:
        alpha = 1.0 if ctx.has_alpha1() else 2.0
    if alpha not in (1, 2):
        raise SelectionError(f"alpha={alpha!r} is not allowed for greedy-aggregate: 1 or 2")
    alpha = float(alpha)
    if alpha == 1.0 and not ctx.has_alpha1():
        raise SelectionError("alpha=1 aggregate entropy needs the cross-layer covariances of an exact analysis "
                             f"(estimator='exact') and k*d <= {AGG1_MAX_DIM}; use alpha=2")
    if alpha == 2.0:
        score = ctx.s2
    else:
        from .progress import progress_bar

        bar = progress_bar(total=sum(len(ctx.cand) - j for j in range(1, ctx.k)), desc="greedy alpha=1 aggregate entropy",
                   unit="set", disable=None, leave=False)

        def score(subsets: np.ndarray) -> np.ndarray:
            if subsets.shape[1] == 1:  # a single layer's aggregate entropy is its own S1
                return ctx.entropy[subsets[:, 0]]
            out = np.array([ctx.stats.aggregate_entropy([int(i) for i in row], alpha=1.0) for row in subsets])
            bar.update(len(subsets))
            return out

    chosen = _greedy(score, ctx.cand, ctx.k)
    if alpha == 1.0:
        bar.close()
    value = float(score(np.array([chosen]))[0])
    extra: dict[str, Any] = {"alpha": alpha, "greedy_score_nats": round(value, 6)}
    n_sets = math.comb(len(ctx.cand), ctx.k)
    if n_sets <= EXHAUSTIVE_LIMIT:
        opt_sets, opt, _ = _best_subsets(ctx.s2, ctx.cand, ctx.k)
        gap2 = float(opt[0]) - float(ctx.s2(np.array([chosen]))[0])
        extra.update(exhaustive_alpha2_optimum_ids=[int(i) for i in opt_sets[0]],
                     alpha2_gap_to_exhaustive_nats=round(gap2, 6))
        extra["gap_to_exhaustive_nats"] = round(gap2, 6) if alpha == 2.0 else None
    else:
        extra["gap_to_exhaustive_nats"] = None
    return _finish(ctx, chosen, "greedy-aggregate",
                   f"greedy forward selection of maximum aggregate entropy (alpha={alpha:g})", extra)


def mrmr_objective(entropy: np.ndarray, cka: np.ndarray, orders: np.ndarray, redundancy_weight: float) -> np.ndarray:
    """The quantity mRMR selection adds up, of ordered layer tuples ``orders`` ``[m, k]``:
    ``sum_i S1(l_i) - lambda * max_{j<i} CKA(l_i, l_j)`` (the first layer pays no redundancy)."""
    total = entropy[orders[:, 0]].astype(np.float64)
    for i in range(1, orders.shape[1]):
        red = np.max(cka[orders[:, i, None], orders[:, :i]], axis=1)
        total = total + entropy[orders[:, i]] - redundancy_weight * red
    return total


def select_mrmr(ctx: _Context, redundancy_weight: float = 1.0) -> Selection:
    """mRMR-style greedy (after Peng, Long & Ding 2005, with matrix entropy as relevance and CKA as
    redundancy): k times, add the layer with the largest ``S1(l) - lambda * max CKA(l, chosen)``
    (S1 in nats, lambda = ``redundancy_weight`` in nats per unit of CKA; ties: the lower id).
    Reports the gap to the best ordered k-tuple of the same objective (exhaustive when
    C(|candidates|, k) * k! <= EXHAUSTIVE_LIMIT)."""
    lam = redundancy_weight
    if isinstance(lam, bool) or not isinstance(lam, int | float | np.floating) or not math.isfinite(lam) or lam < 0:
        raise SelectionError(f"redundancy_weight={lam!r} must be a finite number >= 0")
    chosen: list[int] = []
    gains: list[float] = []
    for _ in range(ctx.k):
        rest = np.array([c for c in ctx.cand if c not in chosen])
        red = ctx.cka[np.ix_(rest, chosen)].max(axis=1) if chosen else np.zeros(len(rest))
        gain = ctx.entropy[rest] - lam * red
        best = int(np.argmax(gain))
        chosen.append(int(rest[best]))
        gains.append(float(gain[best]))
    value = float(sum(gains))
    extra: dict[str, Any] = {"redundancy_weight": lam, "pick_order": list(chosen), "mrmr_objective_nats": round(value, 6)}
    n_orders = math.comb(len(ctx.cand), ctx.k) * math.factorial(ctx.k)
    if n_orders <= EXHAUSTIVE_LIMIT:
        best_val, best_order = -np.inf, None
        for orders in _chunks(itertools.permutations(ctx.cand, ctx.k), ctx.k):
            v = mrmr_objective(ctx.entropy, ctx.cka, orders, lam)
            i = int(np.argmax(v))
            if v[i] > best_val:
                best_val, best_order = float(v[i]), [int(x) for x in orders[i]]
        extra.update(exhaustive_optimum_order=best_order, gap_to_exhaustive_nats=round(best_val - value, 6))
    else:
        extra["gap_to_exhaustive_nats"] = None
    return _finish(ctx, chosen, "mrmr", f"greedy max S1(l) - {lam:g} * max CKA to the layers already chosen "
                   f"(order {chosen})", extra)


def select_cka(ctx: _Context) -> Selection:
    """One informative layer from each of k of the CKA compartments the analysis found (the
    silhouette-chosen segmentation of depth, :mod:`wavesurf.stats.compartments`), not a
    re-segmentation into exactly k blocks. A compartment's informative layers are its candidates
    with S1 at least the compartment's median; the picks cover min(k, #compartments) different
    compartments (with fewer compartments than k, some give two or more layers), and among those
    sets the one with the least mean pairwise CKA wins (ties: higher mean S1)."""
    blocks = [(lo, hi) for lo, hi in ctx.compartments if any(lo <= c <= hi for c in ctx.cand)]
    comp_of = np.full(ctx.n_layers + 1, -1, dtype=np.int64)
    pool: list[int] = []
    for b, (lo, hi) in enumerate(blocks):
        members = [c for c in ctx.cand if lo <= c <= hi]
        comp_of[members] = b
        med = np.median(ctx.entropy[members])
        pool += [m for m in members if ctx.entropy[m] >= med]
    pool = sorted(pool) if len(pool) >= ctx.k else list(ctx.cand)
    need = min(ctx.k, len(blocks))

    def feasible(subsets: np.ndarray) -> np.ndarray:
        labels = np.sort(comp_of[subsets], axis=1)
        distinct = 1 + (np.diff(labels, axis=1) != 0).sum(axis=1)
        return distinct == min(subsets.shape[1], need)

    if math.comb(len(pool), ctx.k) <= EXHAUSTIVE_LIMIT:
        sets = np.concatenate([sub[feasible(sub)] for sub in subset_chunks(pool, ctx.k)])
        best = sets[np.lexsort((-ctx.entropy[sets].mean(axis=1), _pair_mean(ctx.cka, sets)))[0]]
        how = f"exhaustive over {len(sets):,} sets"
    else:
        best = np.array(_greedy(lambda s: np.where(feasible(s), -_pair_mean(ctx.cka, s), -np.inf), pool, ctx.k))
        how = "greedy forward selection"
    ranges = [[int(lo), int(hi)] for lo, hi in blocks]
    return _finish(ctx, best, "cka", f"informative layers from {need} of the {len(blocks)} CKA compartments {ranges} "
                   f"the analysis found, least mutually similar ({how})", {"compartments": ranges})


# ------------------------------------------------------------------ combined: standardised terms
#: Above EXHAUSTIVE_LIMIT sets, the terms' means and spreads come from this many random sets.
STANDARDIZE_SAMPLE = 100_000


def _combined_terms(ctx: _Context) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """Informativeness (mean normalised S1) and diversity (1 - mean pairwise CKA) of sets."""
    return {"informativeness": lambda s: ctx.norm_entropy[s].mean(axis=1),
            "diversity": lambda s: 1.0 - _pair_mean(ctx.cka, s)}


def _sample_subsets(cand: Sequence[int], k: int, n: int, seed: int = 0) -> np.ndarray:
    """``n`` uniformly random k-subsets of ``cand`` (sorted rows, seeded; repeats possible)."""
    rng = np.random.default_rng(seed)
    idx = np.argsort(rng.random((n, len(cand))), axis=1)[:, :k]
    return np.sort(np.asarray(sorted(cand), dtype=np.int64)[idx], axis=1)


def _candidate_sets(ctx: _Context) -> tuple[Iterator[np.ndarray], str]:
    """Every k-subset of the candidates (in chunks), or a seeded sample when there are too many."""
    n_sets = math.comb(len(ctx.cand), ctx.k)
    if n_sets <= EXHAUSTIVE_LIMIT:
        return subset_chunks(ctx.cand, ctx.k), f"all {n_sets:,} sets"
    return iter([_sample_subsets(ctx.cand, ctx.k, STANDARDIZE_SAMPLE)]), \
        f"a seeded sample of {STANDARDIZE_SAMPLE:,} of {n_sets:,} sets"


def _standardizers(ctx: _Context) -> tuple[dict[str, tuple[float, float]], str]:
    """Mean and standard deviation of each combined term over the candidate k-subsets."""
    terms = _combined_terms(ctx)
    sums = {t: np.zeros(3) for t in terms}
    chunks, basis = _candidate_sets(ctx)
    for sub in chunks:
        for t, fn in terms.items():
            v = fn(sub)
            sums[t] += (len(v), v.sum(), (v * v).sum())
    out = {}
    for t, (n, s1, s2) in sums.items():
        mean = s1 / n
        out[t] = (float(mean), float(math.sqrt(max(s2 / n - mean * mean, 0.0))))
    return out, basis


def _z(value: np.ndarray, mean_sd: tuple[float, float]) -> np.ndarray:
    mean, sd = mean_sd
    return (value - mean) / sd if sd > 1e-12 else np.zeros_like(value)  # a constant term weighs nothing


def check_trade_off(trade_off: Any) -> float:
    if isinstance(trade_off, bool) or not isinstance(trade_off, int | float | np.floating) or not 0.0 <= trade_off <= 1.0:
        raise SelectionError(f"trade_off={trade_off!r} must be a number in [0, 1] (0 = informativeness only, "
                             "1 = diversity only)")
    return float(trade_off)


def select_combined(ctx: _Context, trade_off: float = 0.5) -> Selection:
    """Maximise ``(1 - t) z(I) + t z(D)``: I = mean normalised S1 of the set (informativeness),
    D = 1 - mean pairwise CKA (diversity), each standardised (z-score) over the candidate k-subsets
    so that t weighs them on one scale (raw D spans several times the range of I); t =
    ``trade_off`` (0 = informativeness only, 1 = diversity only). :func:`combined_front` sweeps t
    and gives the Pareto front of I against D."""
    t = check_trade_off(trade_off)
    scale, basis = _standardizers(ctx)
    terms = _combined_terms(ctx)

    def score(subsets: np.ndarray) -> np.ndarray:
        return ((1 - t) * _z(terms["informativeness"](subsets), scale["informativeness"])
                + t * _z(terms["diversity"](subsets), scale["diversity"]))

    sets, vals, how = _best_subsets(score, ctx.cand, ctx.k, top=5)
    alternatives = [{"layer_ids": [int(i) for i in s], "combined_score": round(float(v), 4)} for s, v in zip(sets, vals)]
    best = sets[:1]
    extra = {"combined_score": round(float(vals[0]), 4), "trade_off": t,
             "informativeness": round(float(terms["informativeness"](best)[0]), 6),
             "diversity": round(float(terms["diversity"](best)[0]), 6),
             "standardized_over": basis,
             **{f"{name}_mean": round(m, 6) for name, (m, _) in scale.items()},
             **{f"{name}_sd": round(sd, 6) for name, (_, sd) in scale.items()}}
    return _finish(ctx, sets[0], "combined",
                   f"best trade-off of standardised informativeness (mean normalised S1) and diversity (1 - mean CKA), "
                   f"t={t:g} ({how})", extra, alternatives)


def combined_front(stats: Any, k: int = 3, trade_offs: Iterable[float] | None = None,
                   candidates: Iterable[int] | None = None) -> dict[str, Any]:
    """The trade-off of ``combined`` swept instead of fixed: the Pareto front of informativeness
    (mean normalised S1) against diversity (1 - mean pairwise CKA) over the candidate k-subsets
    (every set no other set beats on both; sorted by informativeness, highest first), and the set
    ``combined`` picks at each t of ``trade_offs`` (default 0, 0.1, ..., 1) with its z-scores.
    Over all sets when C(|candidates|, k) <= EXHAUSTIVE_LIMIT, else over a seeded sample."""
    ctx = _Context(stats, k, candidates)
    ts = [check_trade_off(t) for t in (np.linspace(0.0, 1.0, 11).tolist() if trade_offs is None else trade_offs)]
    terms = _combined_terms(ctx)
    scale, basis = _standardizers(ctx)
    chunks, _ = _candidate_sets(ctx)
    sets = np.concatenate(list(chunks))
    info, div = terms["informativeness"](sets), terms["diversity"](sets)
    order = np.lexsort((-div, -info))
    front, best_div = [], -np.inf
    for i in order:
        if div[i] > best_div:
            best_div = div[i]
            front.append(i)
    zi, zd = _z(info, scale["informativeness"]), _z(div, scale["diversity"])
    picks = []
    for t in ts:
        s = (1 - t) * zi + t * zd
        i = int(np.argmax(s))  # first maximum: the lexicographically first set among ties
        picks.append({"trade_off": t, "layer_ids": [int(x) for x in sets[i]], "combined_score": float(s[i]),
                      "informativeness": float(info[i]), "diversity": float(div[i])})
    return {"k": ctx.k, "over": basis, "scale": {n: {"mean": m, "sd": sd} for n, (m, sd) in scale.items()},
            "front": [{"layer_ids": [int(x) for x in sets[i]], "informativeness": float(info[i]),
                       "diversity": float(div[i]), "z_informativeness": float(zi[i]), "z_diversity": float(zd[i])}
                      for i in front],
            "picks": picks}


# ------------------------------------------------------------------ probe: needs a capture
def select_probe(ctx: _Context, probe: Any = None) -> Selection:
    """The set whose features best predict the target's next last-layer state on held-out
    positions: highest R² of the ridge probe (:func:`wavesurf.stats.probe.probe_layer_sets`)
    among its scored k-sets whose ids are all candidates. Statistics alone do not hold it:
    ``probe`` is a :class:`~wavesurf.stats.probe.ProbeResult` of the same target."""
    if probe is None:
        raise SelectionError("method 'probe' ranks layer sets by a ridge probe fitted on a capture of the target, which "
                             "the statistics do not hold: pass probe=wavesurf.stats.probe.probe_layer_sets(target, k=...) "
                             "(`wavesurf select --method probe` runs it)")
    if int(probe.n_layers) != ctx.n_layers:
        raise SelectionError(f"the probe result is of a target with N={probe.n_layers} blocks, the statistics of N={ctx.n_layers}")
    sets = np.asarray(probe.layer_sets)
    if sets.shape[1] != ctx.k:
        raise SelectionError(f"the probe result scores {sets.shape[1]}-layer sets, not k={ctx.k}; probe again with k={ctx.k}")
    ok = np.isin(sets, ctx.cand).all(axis=1)
    if not ok.any():
        raise SelectionError(f"none of the {len(sets):,} sets the probe scored lies within the candidates {ctx.cand}")
    r2 = np.where(ok, probe.r2, -np.inf)
    order = np.argsort(-r2, kind="stable")[: min(5, int(ok.sum()))]
    best = order[0]
    alternatives = [{"layer_ids": [int(i) for i in sets[j]], "probe_r2": round(float(probe.r2[j]), 6)} for j in order]
    extra = {"probe_r2": round(float(probe.r2[best]), 6), "probe_r2_raw": round(float(probe.r2_raw[best]), 6),
             "probe_sets_scored": int(ok.sum()), "probe_over": probe.over, "probe_key": probe.key}
    return _finish(ctx, sets[best], "probe",
                   f"highest held-out R² of a ridge probe (target's last-layer state at t+1 from the set's streams at t "
                   f"and the embedding of x_(t+1)) among {int(ok.sum()):,} {probe.over} sets", extra, alternatives)


METHODS: dict[str, Callable[..., Selection]] = {
    "default": select_default,
    "entropy": select_entropy,
    "entropy-spaced": select_entropy_spaced,
    "aggregate": select_aggregate,
    "greedy-aggregate": select_greedy_aggregate,
    "mrmr": select_mrmr,
    "cka": select_cka,
    "combined": select_combined,
    "probe": select_probe,
}
#: Methods that need more than the statistics, and the option that carries it: tables built
#: from statistics alone (:func:`selection_rows`) leave them out unless the option is given.
NEEDS_OPTION: dict[str, str] = {"probe": "probe"}


def select_layers(stats: Any, k: int = 3, method: str = "combined", candidates: Iterable[int] | None = None,
                  **options: Any) -> Selection:
    """Pick ``k`` layer ids (vLLM convention) with ``method`` (one of :data:`METHODS`)."""
    return METHODS[check_method(method)](_Context(stats, k, candidates), **options)


def selection_recurrence(stats: Any, k: int = 3, method: str = "combined", **options: Any) -> float | None:
    """Jackknife agreement: share of the leave-one-group-out replicates of ``stats`` in which
    ``method`` picks the same set as on all data (each replicate keeps (G-1)/G of the data, so this
    overstates stability), or None for statistics without resampling replicates. Both sides are
    scored without cross-layer covariances (a replicate has none), so ``aggregate`` is compared
    on its alpha=2 basis. None too for methods that read more than the statistics (``probe``):
    a resample of the statistics does not resample what they read."""
    if not getattr(stats, "has_intervals", False) or method in NEEDS_OPTION:
        return None
    reference = select_layers(stats.alpha2_view(), k=k, method=method, **options).layer_ids
    views = stats.replicate_views()
    return sum(select_layers(v, k=k, method=method, **options).layer_ids == reference for v in views) / len(views)


# ---------------------------------------------------------------------------------------------
# the tables the selection and filtering pages show (tidy rows; lists of ids are written to CSV
# space-joined by wavesurf.cache.write_rows_csv)
def selection_rows(stats: Any, k: int = 3, methods: Sequence[str] | None = None, **options: Any) -> list[dict[str, Any]]:
    """One tidy row per method: ids (vLLM and SGLang), scores, reason, and how it compares with
    the default rule (alpha=2 aggregate entropy and mean pairwise CKA difference). By default
    every method of :data:`METHODS` that the statistics suffice for; ``probe`` joins when
    ``options["probe"]`` carries its ``probe=`` result."""
    methods = list(methods or [m for m in METHODS
                               if m not in NEEDS_OPTION or NEEDS_OPTION[m] in options.get(m, {})])
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
        recurrence = selection_recurrence(stats, k, m, **options.get(m, {})) if has_iv else None
        if recurrence is not None:  # how often the same set is chosen with one group of conversations left out
            row["jackknife_agreement"] = round(float(recurrence), 4)
        rows.append(row)
    return rows


def sweep_rows(stats_by_variant: dict[str, Any], method: str = "combined", k: int = 3) -> list[dict[str, Any]]:
    """Tidy rows of a token-entropy filter sweep: per filter and subset (filtered / random
    control / all tokens) the kept tokens, threshold, mean entropy, mean neighbour CKA, mean CKA
    to the last layer, compartments and the layer set ``method`` selects."""
    from .stats.cka import cka_to_last, neighbour_cka
    from .stats.results import control_view

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
                ivals["selected_jackknife_agreement"] = round(float(selection_recurrence(view, k, method)), 4)
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
