"""One pass of capture -> streaming statistics -> per-layer entropy, CKA, compartments, cached.

:func:`analyze` runs the target over a corpus once and accumulates, on the statistics positions
(no padding, no position 0 unless asked, chosen roles, optional token-entropy filter), the float64
moments of every layer id 0..N. From them it derives matrix entropy per layer, purities, the
(N+1)x(N+1) linear CKA matrix (exact full-data CKA when the cross-moment matrix fits the memory
budget, else the unbiased minibatch estimator), and depth compartments. With a filter, the same
statistics of a random subset of the same size are computed in the same pass (the control).

Results live in the cache under a key of every parameter that changes them, as ``stats.npz``,
tidy ``layers.csv`` / ``cka.csv``, ``meta.json`` and (exact estimator) the cross-covariance blocks
``cross_<subset>.npy`` (float32, upper block triangle) that the alpha=1 aggregate entropy of
shortlisted layer sets needs.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..capture import ROLE_FILTERS, check_roles
from ..cache import atomic_directory, entry_dir, params_key, verify_directory, write_manifest, write_rows_csv
from ..errors import StatsError, WavesurfError
from ..settings_cli import setting
from .cka import DEFAULT_MEMORY_BUDGET, MinibatchCKA, TokenShuffler, choose_cka_estimator, cka_to_last, linear_cka_from_moments, neighbour_cka
from .compartments import compartment_stability, compartments
from .entropy import aggregate_entropy as _aggregate_entropy
from .entropy import aggregate_entropy2_closed_form, effective_rank, max_entropy, purity, redundancy as _redundancy
from .entropy import redundancy2_closed_form, renyi_entropy
from .filtering import FILTER_HELP, FilterError, FilterState, TokenFilter
from .moments import LayerMoments, gather_layer_rows, l2_normalize_rows_, masked_group_ids
from .resampling import (DEFAULT_GROUPS, DEFAULT_LEVEL, REPLICATED, GroupAssigner, GroupedLayerMoments, Jackknife,
                         ReplicateView, aggregate_entropy2_replicates, boundary_frequency, check_groups, jackknife,
                         redundancy2_replicates, values_and_replicates)

ESTIMATORS = ("auto", "exact", "minibatch")
RESULT_FORMAT = 2  # 2: resampling replicates


@dataclass(frozen=True)
class AnalysisSettings:
    """Every parameter that changes the statistics (all of them enter the cache key)."""

    # setting(...) adds the command-line help (wavesurf.settings_cli); the defaults are the fields' own
    dataset: str = setting("sharegpt", help="corpus: a packaged one (`wavesurf datasets`), a .jsonl path, "
                           "or <corpus>@<model> from `wavesurf distill`")
    split: str | None = setting("stats", help="ShareGPT split")
    split_seed: int = setting(0, help="seed of the ShareGPT train/stats/heldout split")
    max_tokens: int = setting(100_000, positive=True, help="tokens fed to the model")
    max_len: int = setting(512, positive=True, help="truncate examples to this many tokens")
    batch_tokens: int = setting(4096, positive=True, help="padded tokens per forward pass")
    roles: str = setting("all", choices=ROLE_FILTERS, help="tokens that count: all, or assistant tokens only")
    filter: str = setting("none", help=f"token-entropy filter: {FILTER_HELP}; a random subset of the same size is "
                          "computed beside it")
    pilot_tokens: int = setting(8192, positive=True, help="positions that fix a quantile threshold")
    include_position0: bool = setting(False, help="keep position 0 (BOS / attention sink) in the statistics")
    l2_normalize: bool = setting(False, help="unit-norm rows per layer before accumulation (cosine variant)")
    estimator: str = setting("auto", choices=ESTIMATORS, help="CKA estimator: exact full-data, unbiased minibatch, "
                             "or auto by the memory budget")
    memory_budget_gb: float = setting(DEFAULT_MEMORY_BUDGET / 2**30, help="memory for exact cross-layer moments (GB)")
    minibatch_size: int = setting(512, positive=True, help="tokens per CKA minibatch")
    seed: int = setting(0, help="seed of the random control subset and minibatch shuffling")
    min_tokens: int | None = setting(None, positive=True, help="kept positions the statistics need (default: d + 1)")
    resample_groups: int = setting(DEFAULT_GROUPS, help="groups of conversations for 95% jackknife intervals on every "
                                   "statistic, from the same pass; 0 turns them off")

    def check(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise WavesurfError(f"estimator={self.estimator!r} is not one of {', '.join(ESTIMATORS)}")
        check_roles(self.roles)
        if self.minibatch_size < 4:
            raise WavesurfError(f"minibatch_size={self.minibatch_size} must be >= 4 (unbiased HSIC needs n >= 4)")
        if self.memory_budget_gb <= 0:
            raise WavesurfError(f"memory_budget_gb={self.memory_budget_gb} must be > 0")
        TokenFilter.parse(self.filter)
        check_groups(self.resample_groups)


@dataclass
class SubsetStats:
    """Statistics of one token subset ("all", "filtered" or its "random" control)."""

    name: str
    n_tokens: int
    layer_ids: list[int]
    entropy: np.ndarray  # alpha=1 (von Neumann) matrix entropy per layer, nats
    entropy2: np.ndarray  # alpha=2 (collision) entropy per layer, nats
    normalized_entropy: np.ndarray  # entropy / log(min(n - 1, d)) in [0, 1]
    purity: np.ndarray  # ||C / tr C||_F^2 = exp(-entropy2)
    trace: np.ndarray  # tr C per layer (total variance)
    cka: np.ndarray  # [L, L] linear CKA
    compartments: list[tuple[int, int]]  # contiguous blocks of layer ids (inclusive)
    cross: Any = field(default=None, repr=False)  # LayerMoments or stored blocks, for aggregate entropy
    # leave-one-group-out values (see wavesurf.stats.resampling): REPLICATED quantities [G, L],
    # "cka" [G, L, L], "group_tokens" [G]; None without intervals (interval_note says why)
    replicates: dict[str, np.ndarray] | None = field(default=None, repr=False)
    interval_note: str | None = None

    @property
    def effective_rank(self) -> np.ndarray:
        return effective_rank(self.entropy)


class BlockCovariances:
    """Cross-layer covariance blocks kept after a run (float32, upper block triangle: 0.66 GB for
    SmolLM2 instead of 2.5 GB of float64 moments), with the ``covariance(i, j)`` interface of
    :class:`LayerMoments` that the aggregate-entropy functions read. Relative precision ~1e-7."""

    pairs = True

    def __init__(self, blocks: np.ndarray, layer_ids: Sequence[int], n: int):
        import torch

        self.blocks = blocks
        self.layer_ids, self.dim, self.n = list(layer_ids), int(blocks.shape[-1]), int(n)
        self.device = torch.device("cpu")
        self._pos = {lid: k for k, lid in enumerate(self.layer_ids)}

    @classmethod
    def from_moments(cls, moments: LayerMoments) -> BlockCovariances:
        ids, d = list(moments.layer_ids), moments.dim
        L = len(ids)
        blocks = np.empty((L * (L + 1) // 2, d, d), dtype=np.float32)
        for a in range(L):
            for b in range(a, L):
                blocks[_pair_index(a, b, L)] = moments.covariance(ids[a], ids[b]).cpu().numpy()
        return cls(blocks, ids, moments.n)

    def _index(self, layer_id: int) -> int:
        if layer_id not in self._pos:
            raise WavesurfError(f"layer id {layer_id} is not in the statistics (ids {self.layer_ids})")
        return self._pos[layer_id]

    def covariance(self, i: int, j: int | None = None) -> Any:
        import torch

        a, b = self._index(i), self._index(i if j is None else j)
        lo, hi = min(a, b), max(a, b)
        block = torch.from_numpy(np.array(self.blocks[_pair_index(lo, hi, len(self.layer_ids))], dtype=np.float64))
        return block.T if a > b else block


def _pair_index(a: int, b: int, L: int) -> int:
    """Index of block (a, b), a <= b, in row-major upper-triangle order."""
    return a * L - a * (a - 1) // 2 + (b - a)


@dataclass
class LayerStats:
    """Per-layer statistics of one model on one corpus; ``control`` is the random subset of the
    same size as a token-entropy filter kept (None without a filter)."""

    key: str
    meta: dict[str, Any]
    main: SubsetStats
    control: SubsetStats | None = None
    path: Path | None = None

    # the arrays selection reads, of the main subset
    @property
    def n_layers(self) -> int:
        return int(self.meta["n_layers"])

    @property
    def layer_ids(self) -> list[int]:
        return self.main.layer_ids

    @property
    def entropy(self) -> np.ndarray:
        """α=1 matrix entropy per layer (nats), main subset."""
        return self.main.entropy

    @property
    def entropy2(self) -> np.ndarray:
        """α=2 matrix entropy per layer (nats), main subset."""
        return self.main.entropy2

    @property
    def normalized_entropy(self) -> np.ndarray:
        return self.main.normalized_entropy

    @property
    def purity(self) -> np.ndarray:
        return self.main.purity

    @property
    def trace(self) -> np.ndarray:
        return self.main.trace

    @property
    def cka(self) -> np.ndarray:
        """[L, L] linear CKA, main subset."""
        return self.main.cka

    @property
    def compartments(self) -> list[tuple[int, int]]:
        return self.main.compartments

    @property
    def n_tokens(self) -> int:
        return self.main.n_tokens

    @property
    def has_cross_covariance(self) -> bool:
        return self.main.cross is not None

    def aggregate_entropy(self, layer_ids: Sequence[int], alpha: float = 1.0, subset: str = "main") -> float:
        """Entropy (nats) of the unit-trace-scaled concatenation of ``layer_ids`` (exact)."""
        return _aggregate_entropy(self._cross(subset), list(layer_ids), alpha)

    def redundancy(self, layer_ids: Sequence[int], alpha: float = 1.0, subset: str = "main") -> float:
        """Block-diagonal entropy minus joint entropy (nats, >= 0): what the set repeats."""
        return _redundancy(self._cross(subset), list(layer_ids), alpha)

    def _cross(self, subset: str) -> Any:
        stats = self.main if subset == "main" else self.control
        if stats is None or stats.cross is None:
            raise WavesurfError("aggregate entropy needs the cross-layer covariances, which the minibatch "
                                "estimator does not keep; rerun with estimator='exact' or use the alpha=2 closed form")
        return stats.cross

    # ------------------------------------------------------------------ intervals
    def _subset(self, subset: str) -> SubsetStats:
        if subset not in ("main", "control"):
            raise WavesurfError(f"subset={subset!r} must be 'main' or 'control'")
        sub = self.main if subset == "main" else self.control
        if sub is None:
            raise WavesurfError("these statistics have no random control subset (no token filter)")
        return sub

    @property
    def has_intervals(self) -> bool:
        return self.main.replicates is not None

    def interval(self, quantity: str, subset: str = "main", level: float = DEFAULT_LEVEL) -> Jackknife:
        """Grouped-jackknife interval of a quantity (``entropy``, ``entropy2``, ``normalized_entropy``,
        ``purity``, ``trace``, ``effective_rank``, ``cka``, ``cka_next``, ``cka_to_last`` or
        ``mean_<per-layer quantity>``) over resampling groups of sequences."""
        sub = self._subset(subset)
        return jackknife(*values_and_replicates(sub, quantity), level=level)

    def band(self, quantity: str, subset: str = "main") -> tuple[np.ndarray, np.ndarray] | None:
        """``(low, high)`` of :meth:`interval` for a figure's shaded band, or None without intervals."""
        sub = self._subset(subset)
        if sub.replicates is None:
            return None
        jk = jackknife(*values_and_replicates(sub, quantity))
        return jk.low, jk.high

    def control_difference(self, quantity: str, level: float = DEFAULT_LEVEL) -> Jackknife:
        """Filtered minus random-control value of a quantity, with a paired interval (both subsets
        come from the same sequences and share their resampling groups)."""
        e1, r1 = values_and_replicates(self._subset("main"), quantity)
        e0, r0 = values_and_replicates(self._subset("control"), quantity)
        return jackknife(e1 - e0, r1 - r0, level=level)

    # ------------------------------------------------------------------ scores of layer sets
    def aggregate_entropy2(self, layer_sets: Any) -> np.ndarray:
        """Alpha=2 aggregate entropy (nats) of layer-id sets (rows of ``[m, k]``; one list is one
        set), ``[m]``: the exact closed form from purities and CKA (book: methods-closed-form)."""
        return aggregate_entropy2_closed_form(self.purity, self.cka, self._positions(layer_sets))

    def redundancy2(self, layer_sets: Any) -> np.ndarray:
        """Alpha=2 redundancy (nats, >= 0) of layer-id sets, ``[m]``: the block-diagonal alpha=2
        entropy minus the joint one, ``log(sum P + sum_{a!=b} CKA sqrt(P P)) - log(sum P)``."""
        return redundancy2_closed_form(self.purity, self.cka, self._positions(layer_sets))

    def pair_matrix(self, score: Callable[[Any], np.ndarray] | None = None) -> np.ndarray:
        """``[L, L]`` matrix of a set score over layer pairs (default :meth:`aggregate_entropy2`);
        the diagonal holds the single layer's score."""
        score = score or self.aggregate_entropy2
        ids = list(self.layer_ids)
        L = len(ids)
        pairs = np.array([[a, b] for a in ids for b in ids], dtype=np.int64)
        vals = np.empty(len(pairs))
        diag = pairs[:, 0] == pairs[:, 1]
        vals[diag] = score(pairs[diag][:, :1])
        vals[~diag] = score(pairs[~diag])
        return vals.reshape(L, L)

    def pair_cka(self, layer_ids: Sequence[int]) -> dict[tuple[int, int], float]:
        """Linear CKA of every pair ``(a, b)``, a before b in ``layer_ids`` (main subset)."""
        ids = [int(i) for i in layer_ids]
        pos = self._positions([ids])[0]
        return {(ids[i], ids[j]): float(self.cka[pos[i], pos[j]])
                for i in range(len(ids)) for j in range(i + 1, len(ids))}

    def depth_curves(self) -> dict[str, Any]:
        """Per-layer matrix entropy of the main subset: ``S1``/``S2`` (alpha 1 and 2, nats) and
        ``S1_norm``/``S2_norm`` divided by the maximum ``log min(n - 1, d)`` (book:
        methods-entropy); with resampling replicates also ``<key>_band`` = (low, high) of the 95% interval."""
        top = max_entropy(int(self.main.n_tokens), int(self.meta["hidden_size"]))
        out: dict[str, Any] = {"S1": np.asarray(self.entropy), "S2": np.asarray(self.entropy2),
                               "S1_norm": np.asarray(self.entropy) / top, "S2_norm": np.asarray(self.entropy2) / top}
        if self.has_intervals:
            j1, j2 = self.interval("entropy"), self.interval("entropy2")
            out.update(S1_band=(j1.low, j1.high), S2_band=(j2.low, j2.high),
                       S1_norm_band=(j1.low / top, j1.high / top), S2_norm_band=(j2.low / top, j2.high / top))
        return out

    def aggregate_entropy2_interval(self, layer_sets: Any, level: float = DEFAULT_LEVEL) -> Jackknife:
        """:meth:`aggregate_entropy2` with grouped-jackknife intervals (needs resampling replicates)."""
        return jackknife(*aggregate_entropy2_replicates(self.main, self._positions(layer_sets)), level=level)

    def redundancy2_interval(self, layer_sets: Any, level: float = DEFAULT_LEVEL) -> Jackknife:
        """:meth:`redundancy2` with grouped-jackknife intervals (needs resampling replicates)."""
        return jackknife(*redundancy2_replicates(self.main, self._positions(layer_sets)), level=level)

    def aggregate_entropy2_difference(self, layer_ids: Sequence[int], reference_ids: Sequence[int],
                                      level: float = DEFAULT_LEVEL) -> Jackknife:
        """Alpha=2 aggregate entropy of ``layer_ids`` minus that of ``reference_ids`` (same k), paired."""
        est, reps = aggregate_entropy2_replicates(self.main, self._positions([list(layer_ids), list(reference_ids)]))
        return jackknife(est[0] - est[1], reps[:, 0] - reps[:, 1], level=level)

    def _positions(self, layer_sets: Any) -> np.ndarray:
        """``[m, k]`` positions into the layer arrays of layer-id sets (a 1-D list is one set)."""
        sets = np.asarray(layer_sets, dtype=np.int64)
        if sets.ndim == 1:
            sets = sets[None, :]
        pos = {lid: k for k, lid in enumerate(self.layer_ids)}
        try:
            return np.array([[pos[int(i)] for i in row] for row in sets], dtype=np.int64).reshape(sets.shape)
        except KeyError as exc:
            raise WavesurfError(f"layer id {exc.args[0]} is not in the statistics (ids {self.layer_ids})") from None

    def boundary_frequency(self, subset: str = "main") -> np.ndarray:
        """``[L]`` share of resamples whose CKA compartments start a new one at each layer id."""
        return boundary_frequency(self._subset(subset))

    def replicate_views(self) -> list[ReplicateView]:
        """The leave-one-group-out statistics as objects :func:`wavesurf.select_layers` accepts."""
        if not self.has_intervals:
            raise WavesurfError(f"no resampling replicates: {self.main.interval_note or 'resample_groups=0'}")
        return [ReplicateView.replicate(self, g) for g in range(len(self.main.replicates["group_tokens"]))]

    def alpha2_view(self) -> ReplicateView:
        """The full-data arrays in the form of :meth:`replicate_views` (no cross-covariances), the
        reference a resample's selection is compared with."""
        return ReplicateView.full(self)

    def layer_rows(self) -> list[dict[str, Any]]:
        """Tidy per-layer rows (one per subset and layer id) as written to ``layers.csv``; with
        resampling replicates, ``<q>_low``/``<q>_high`` give 95% grouped-jackknife intervals and
        ``boundary_frequency`` how often a compartment starts at the layer across resamples."""
        rows = []
        for sub in [self.main] + ([self.control] if self.control else []):
            block_of = {lid: b for b, (s, e) in enumerate(sub.compartments) for lid in range(s, e + 1)}
            nxt, last = neighbour_cka(sub.cka), cka_to_last(sub.cka)
            ivals = {}
            if sub.replicates is not None:
                for col, q in (("entropy_nats", "entropy"), ("entropy2_nats", "entropy2"),
                               ("normalized_entropy", "normalized_entropy"), ("cka_next", "cka_next"),
                               ("cka_to_last", "cka_to_last")):
                    ivals[col] = jackknife(*values_and_replicates(sub, q))
                freq = boundary_frequency(sub)
            for k, lid in enumerate(sub.layer_ids):
                extra: dict[str, Any] = {}
                for col, jk in ivals.items():
                    ok = k < len(jk.low)
                    extra[f"{col}_low"] = jk.low[k] if ok else ""
                    extra[f"{col}_high"] = jk.high[k] if ok else ""
                if ivals:
                    extra["boundary_frequency"] = freq[k]
                rows.append({
                    "model": self.meta["model"], "subset": sub.name, "filter": self.meta["filter"]["filter"],
                    "layer_id": lid, "sglang_layer_id": lid - 1 if lid > 0 else "",
                    "relative_depth": round(lid / self.n_layers, 4), "tokens": sub.n_tokens,
                    "entropy_nats": sub.entropy[k], "entropy2_nats": sub.entropy2[k],
                    "normalized_entropy": sub.normalized_entropy[k], "effective_rank": float(sub.effective_rank[k]),
                    "purity": sub.purity[k], "trace": sub.trace[k],
                    "cka_next": nxt[k] if k < len(nxt) else "", "cka_to_last": last[k],
                    "compartment": block_of.get(lid, ""), **extra,
                })
        return rows

    def cka_rows(self) -> list[dict[str, Any]]:
        rows = []
        for sub in [self.main] + ([self.control] if self.control else []):
            jk = jackknife(*values_and_replicates(sub, "cka")) if sub.replicates is not None else None
            for a, la in enumerate(sub.layer_ids):
                for b, lb in enumerate(sub.layer_ids):
                    row = {"subset": sub.name, "layer_i": la, "layer_j": lb, "cka": sub.cka[a, b]}
                    if jk is not None:
                        row.update(cka_low=jk.low[a, b], cka_high=jk.high[a, b])
                    rows.append(row)
        return rows


# ---------------------------------------------------------------------------------------------
def _finalize(name: str, layer_ids: list[int], moments: LayerMoments, cka: np.ndarray, dim: int,
              replicates: dict[str, np.ndarray] | None = None, interval_note: str | None = None) -> SubsetStats:
    import torch

    n = moments.n
    ent, ent2, norm, pur, tr = [], [], [], [], []
    top = max_entropy(n, dim)
    for lid in layer_ids:
        cov = moments.covariance(lid)
        eigs = torch.linalg.eigvalsh(cov).cpu().numpy()  # one decomposition serves both alphas
        ent.append(renyi_entropy(eigs, 1.0))
        ent2.append(renyi_entropy(eigs, 2.0))
        norm.append(ent[-1] / top if top > 0 else 0.0)
        pur.append(purity(cov))
        tr.append(float(cov.trace()))
    blocks = [(layer_ids[s], layer_ids[e]) for s, e in compartments(cka)]
    cross = BlockCovariances.from_moments(moments) if moments.pairs else None
    return SubsetStats(name, n, list(layer_ids), np.array(ent), np.array(ent2), np.array(norm), np.array(pur),
                       np.array(tr), np.asarray(cka, dtype=np.float64), blocks, cross, replicates, interval_note)


def _per_layer_replicates(grouped: GroupedLayerMoments, dim: int) -> dict[str, np.ndarray]:
    """Per-layer quantities of every leave-one-group-out covariance: ``[G, L]`` each (float64
    spectra: float32 ``eigvalsh`` is only ~1.4x faster and its noise floor on the small eigenvalues
    would add ~1e-4 nats to each replicate's entropy)."""
    import torch

    G, L = grouped.n_groups, len(grouped.layer_ids)
    out = {q: np.empty((G, L)) for q in REPLICATED}
    sizes = grouped.group_sizes
    for g in range(G):
        top = max_entropy(int(sizes.sum() - sizes[g]), dim)
        for k, lid in enumerate(grouped.layer_ids):
            cov = grouped.covariance(lid, drop_group=g)
            eigs = torch.linalg.eigvalsh(cov).cpu().numpy()
            out["entropy"][g, k] = renyi_entropy(eigs, 1.0)
            out["entropy2"][g, k] = renyi_entropy(eigs, 2.0)
            out["normalized_entropy"][g, k] = out["entropy"][g, k] / top if top > 0 else 0.0
            t = float(eigs.sum())
            out["purity"][g, k] = float(np.sum(eigs * eigs)) / t**2 if t > 0 else np.nan
            out["trace"][g, k] = float(cov.trace())
    out["group_tokens"] = sizes.astype(np.int64)
    return out


class _Accumulator:
    """Moments (+ minibatch CKA) of one token subset; with ``resample_groups``, the same sums per
    group of sequences for jackknife intervals (the minibatch CKA then also runs next to the exact
    one, to give the CKA replicates)."""

    def __init__(self, name: str, layer_ids: list[int], dim: int, exact: bool, settings: AnalysisSettings, meta: dict):
        import torch

        self.name, self.layer_ids, self.dim, self.exact = name, layer_ids, dim, exact
        self.n_groups = settings.resample_groups
        sub_meta = {**meta, "subset": name}
        self.grouped = None
        if self.n_groups:  # beside the exact moments, else it *is* the per-layer moments
            self.grouped = GroupedLayerMoments(layer_ids, dim, self.n_groups, settings.l2_normalize, sub_meta)
        self.moments = (self.grouped if self.grouped is not None and not exact else
                        LayerMoments(layer_ids, dim, pairs=exact, l2_normalize=settings.l2_normalize, meta=sub_meta))
        need_mb = not exact or self.n_groups
        self.mb = (MinibatchCKA(layer_ids, meta=sub_meta, gram_dtype=torch.float32, n_groups=self.n_groups)
                   if need_mb else None)
        self.shuffler = None if not need_mb else TokenShuffler(8 * settings.minibatch_size, settings.minibatch_size,
                                                               seed=settings.seed + (0 if name != "random" else 7))
        self.l2 = settings.l2_normalize

    def update(self, hidden: dict[int, Any], mask: Any, groups: Any = None) -> None:
        if mask is None or not bool(mask.any()):
            return
        if self.grouped is not None:
            self.grouped.update(hidden, groups, mask)
        if self.moments is not self.grouped:
            self.moments.update(hidden, mask)
        if self.mb is not None:
            rows = gather_layer_rows(hidden, self.layer_ids, mask)
            if self.l2:
                rows = [l2_normalize_rows_(r) for r in rows]  # r is a fresh copy (masked rows)
            feed: dict[Any, Any] = {lid: r for lid, r in zip(self.layer_ids, rows)}
            if self.n_groups:
                feed["groups"] = masked_group_ids(groups, mask)
            for minibatch in self.shuffler.add(feed):
                self.mb.update(minibatch, groups=minibatch.get("groups"))

    def finish(self) -> None:
        """Flush the last minibatches and sum the accumulators over all processes (if several)."""
        if self.mb is not None:
            for minibatch in self.shuffler.flush():
                self.mb.update(minibatch, groups=minibatch.get("groups"))
            self.mb.all_reduce_()
        self.moments.all_reduce_()
        if self.grouped is not None and self.grouped is not self.moments:
            self.grouped.all_reduce_()

    def _interval_problem(self) -> str | None:
        """Why this subset gets no intervals (None when it does)."""
        if not self.n_groups:
            return "resample_groups=0: intervals were not asked for"
        what = {"all": "", "filtered": "filtered ", "random": "random-control "}.get(self.name, f"{self.name} ")
        empty = int((self.grouped.group_sizes == 0).sum())
        if empty:
            return (f"too small for {self.n_groups} resampling groups: {empty} of them hold no {what}tokens; "
                    "use fewer resample_groups or more tokens")
        if self.mb.n_batches < 2:
            return (f"too small for CKA intervals: {self.mb.n_batches} minibatch(es) of {self.shuffler.batch_size} "
                    f"{what}tokens; lower minibatch_size or raise max_tokens")
        left = self.grouped.n - int(self.grouped.group_sizes.max())
        if left <= self.dim:
            return (f"too small: leaving out one group leaves {left:,} {what}tokens, not more than the {self.dim} "
                    "dimensions; use fewer resample_groups or more tokens")
        return None

    def result(self) -> SubsetStats:
        if self.mb is not None and not self.exact and self.mb.n_batches == 0:
            raise FilterError(f"{self.name}: too few tokens ({self.moments.n}) for one CKA minibatch of "
                              f"{self.shuffler.batch_size}; lower minibatch_size or raise max_tokens")
        cka = linear_cka_from_moments(self.moments) if self.exact else self.mb.result()
        note = self._interval_problem()
        replicates = None
        if note is None:
            replicates = _per_layer_replicates(self.grouped, self.dim)
            rep_cka = self.mb.replicates()
            if self.exact:  # the exact CKA borrows the minibatch estimator's leave-one-out deviations
                rep_cka = cka[None] + (rep_cka - self.mb.result()[None])
            replicates["cka"] = rep_cka
        return _finalize(self.name, self.layer_ids, self.moments, cka, self.dim, replicates, note)


def check_corpus_groups(settings: AnalysisSettings, corpus: Any) -> None:
    """Refuse, before any model work, more resampling groups than the corpus has conversations."""
    from .resampling import conversation_key

    if settings.resample_groups:
        n_conv = len({conversation_key(e.id) for e in corpus.examples})
        try:
            check_groups(settings.resample_groups, n_sequences=n_conv)
        except StatsError as exc:
            raise StatsError(f"{exc} (corpus {settings.dataset!r} has {n_conv} conversations)") from None


def result_dir(model_name: str, key: str) -> Path:
    return entry_dir("results/analyze", model_name, key)


def analysis_key(target: Any, settings: AnalysisSettings) -> tuple[str, dict[str, Any]]:

    from ..data import generated_corpus_info

    params = {"format": RESULT_FORMAT, "wavesurf": __version__, "model": target.name, "source": target.source,
              "n_layers": target.n_layers, "hidden_size": target.hidden_size, "dtype": target.dtype,
              **asdict(settings)}
    corpus_info = generated_corpus_info(settings.dataset, settings.split, settings.split_seed)
    if corpus_info is not None:  # <corpus>@<model>: the key follows the generated corpus it resolves to
        params["corpus_info"] = corpus_info
    return params_key(params), params


def analyze(
    target: Any,
    settings: AnalysisSettings | None = None,
    *,
    use_cache: bool = True,
    progress: bool = True,
    shard: Any = None,
    **overrides: Any,
) -> LayerStats:
    """Statistics of every layer of ``target`` (a loaded :class:`~wavesurf.models.Target`).

    ``settings`` (or keyword overrides of :class:`AnalysisSettings`) fix corpus, token budget,
    roles, filter and estimator. A cached result for the same parameters is returned as is;
    nothing is written until the run completes, so an interrupted run leaves no entry behind.
    ``shard`` (:class:`wavesurf.distributed.Shard`, from ``init_from_env``): this process's share
    of a run split over several processes; every process gets the summed result and the first
    one writes the cache.
    """
    from ..distributed import Shard, barrier
    from ..capture import capture
    from ..data import load_corpus

    settings = replace(settings or AnalysisSettings(), **overrides)
    settings.check()
    key, params = analysis_key(target, settings)
    out = result_dir(target.name, key)
    if use_cache and out.exists() and verify_directory(out) is None:
        return load_stats(out)
    t0 = time.perf_counter()
    corpus = load_corpus(settings.dataset, split=settings.split, seed=settings.split_seed)
    check_corpus_groups(settings, corpus)
    shard = shard if shard is not None else Shard()
    batches = capture(target, corpus, settings.max_tokens, max_len=settings.max_len,
                      batch_tokens=settings.batch_tokens, progress=progress, shard=shard)
    stats = analyze_batches(batches, target.n_layers, target.hidden_size, settings, key=key, params=params,
                            shard=shard, corpus_order=[e.id for e in corpus.examples])
    stats.meta["seconds"] = round(time.perf_counter() - t0, 1)
    if use_cache:
        if shard.is_main:
            save_stats(stats, out)
        barrier()  # the others return once the entry exists
        stats.path = out
    return stats


def analyze_batches(
    batches: Iterable[Any],
    n_layers: int,
    hidden_size: int,
    settings: AnalysisSettings | None = None,
    *,
    key: str = "",
    params: dict[str, Any] | None = None,
    shard: Any = None,
    corpus_order: Sequence[str] | None = None,
) -> LayerStats:
    """The statistics of :func:`analyze` from any iterable of :class:`~wavesurf.capture.CaptureBatch`
    carrying every layer id 0..``n_layers`` (one pass; nothing cached). With a ``shard``, only the
    batches it owns are accumulated (the others are pilot batches of a quantile filter) and the
    accumulators are summed over all processes at the end. ``corpus_order`` (the corpus's example
    ids) fixes the resampling groups independently of batching; without it conversations are dealt
    to the groups in the order they appear."""
    from ..distributed import Shard, all_reduce_ints

    shard = shard if shard is not None else Shard()
    settings = settings or AnalysisSettings()
    settings.check()
    fspec = TokenFilter.parse(settings.filter, settings.pilot_tokens)
    L, d = n_layers + 1, hidden_size
    layer_ids = list(range(L))
    estimator = settings.estimator
    if estimator == "auto":
        estimator = choose_cka_estimator(L, d, int(settings.memory_budget_gb * 2**30))
    exact = estimator == "exact"
    min_tokens = settings.min_tokens or d + 1
    merge_meta = {"key": key or params_key(asdict(settings))}  # accumulators of other settings never merge
    subsets = [_Accumulator("filtered" if fspec.active else "all", layer_ids, d, exact, settings, merge_meta)]
    if fspec.active:
        subsets.append(_Accumulator("random", layer_ids, d, exact, settings, merge_meta))
    fstate = FilterState(fspec, seed=settings.seed)
    assigner = GroupAssigner(settings.resample_groups, corpus_order) if settings.resample_groups else None
    if fspec.kind == "quantile":
        shard.pilot_done = False  # every process runs the pilot batches until the threshold is fixed

    def candidates(batch):
        mask = batch.stat_mask(settings.roles)
        if settings.include_position0:
            mask = mask | (batch.attention_mask & (batch.positions == 0))
        return mask

    def consume(batch):
        if not shard.owns(batch.index):
            return
        kept, control = fstate.masks(candidates(batch), batch.token_entropy, batch.index)
        groups = assigner.row_groups(batch.example_ids, tuple(kept.shape)) if assigner else None
        subsets[0].update(batch.hidden, kept, groups)
        if control is not None:
            subsets[1].update(batch.hidden, control, groups)

    pilot: list = []  # a quantile filter holds its first batches until the threshold is fixed
    pilot_count = 0
    for batch in batches:
        if fspec.kind == "quantile" and fstate.threshold is None:
            pilot.append(batch)
            pilot_count += int(candidates(batch).sum())
            if pilot_count < settings.pilot_tokens:
                continue
            _fix_threshold(fstate, pilot, candidates)
            shard.pilot_done = True
            for b in pilot:
                consume(b)
            pilot = []
            continue
        consume(batch)
    if pilot:
        _fix_threshold(fstate, pilot, candidates)
        shard.pilot_done = True
        for b in pilot:
            consume(b)
    for sub in subsets:
        sub.finish()
    if shard.active:
        fstate.candidates, fstate.kept = all_reduce_ints(fstate.candidates, fstate.kept)
    kept = subsets[0].moments.n
    if kept < min_tokens:
        raise FilterError(
            f"filter {fspec.label!r} kept {kept:,} of {fstate.candidates:,} tokens; the statistics need at least "
            f"{min_tokens:,} ({'min_tokens' if settings.min_tokens else 'hidden size + 1'}). "
            "Loosen the filter or raise max_tokens."
        )
    results = [s.result() for s in subsets]
    meta = {**(params or {"n_layers": n_layers, "hidden_size": hidden_size, "model": "?", **asdict(settings)}),
            "key": key, "layer_convention": "vllm (0 = embeddings, N = last block before the final norm)",
            "estimator_used": estimator, "filter": fstate.summary(), "processes": shard.world,
            "tokens": {s.name: s.n_tokens for s in results},
            "intervals": {"method": "grouped jackknife over sequences (conversations dealt to groups in corpus order)",
                          "groups": settings.resample_groups, "level": DEFAULT_LEVEL,
                          "exact_cka": "exact value +- the minibatch estimator's leave-one-group-out deviations"
                          if exact else "minibatch estimator's own leave-one-group-out values",
                          "notes": {s.name: s.interval_note for s in results if s.interval_note}}}
    if len(results) > 1:  # stability check: do filtered and random tokens give the same compartments?
        meta["compartment_agreement_with_control"] = round(
            compartment_stability(results[0].compartments, results[1].compartments, L), 4)
    return LayerStats(key, meta, results[0], results[1] if len(results) > 1 else None)


def _fix_threshold(fstate: FilterState, pilot: list, candidates) -> None:
    import torch

    ent = torch.cat([b.token_entropy[candidates(b)] for b in pilot])
    fstate.set_threshold_from(ent)


# ---------------------------------------------------------------------------------------------
_ARRAYS = ("entropy", "entropy2", "normalized_entropy", "purity", "trace", "cka")


def save_stats(stats: LayerStats, out: Path) -> None:
    """Write a LayerStats into ``out`` atomically (npz, tidy CSVs, meta, cross-covariance blocks)."""
    with atomic_directory(out, overwrite=True) as tmp:
        arrays: dict[str, np.ndarray] = {}
        subs = [stats.main] + ([stats.control] if stats.control else [])
        for sub in subs:
            for name in _ARRAYS:
                arrays[f"{sub.name}.{name}"] = getattr(sub, name)
            arrays[f"{sub.name}.layer_ids"] = np.asarray(sub.layer_ids)
            arrays[f"{sub.name}.compartments"] = np.asarray(sub.compartments, dtype=np.int64).reshape(-1, 2)
            if sub.cross is not None:
                np.save(tmp / f"cross_{sub.name}.npy", sub.cross.blocks)
            for rname, arr in (sub.replicates or {}).items():
                arrays[f"{sub.name}.rep.{rname}"] = arr
        np.savez(tmp / "stats.npz", **arrays)
        meta = {**stats.meta, "subsets": {s.name: s.n_tokens for s in subs},
                "interval_notes": {s.name: s.interval_note for s in subs}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        write_rows_csv(tmp / "layers.csv", stats.layer_rows())
        write_rows_csv(tmp / "cka.csv", stats.cka_rows())
        write_manifest(tmp, {"kind": "analyze", "key": stats.key}, hash_files=False)


def load_stats(path: Path) -> LayerStats:
    path = Path(path)
    problem = verify_directory(path)
    if problem is not None:
        raise WavesurfError(f"statistics in {path} are damaged ({problem}); delete the directory to recompute")
    meta = json.loads((path / "meta.json").read_text())
    data = np.load(path / "stats.npz")
    subs = []
    for name, n in meta["subsets"].items():
        ids = [int(i) for i in data[f"{name}.layer_ids"]]
        cross_path = path / f"cross_{name}.npy"
        cross = BlockCovariances(np.load(cross_path, mmap_mode="r"), ids, n) if cross_path.exists() else None
        prefix = f"{name}.rep."
        reps = {k[len(prefix):]: data[k] for k in data.files if k.startswith(prefix)} or None
        subs.append(SubsetStats(name, int(n), ids, *(data[f"{name}.{a}"] for a in _ARRAYS[:-1]),
                                cka=data[f"{name}.cka"],
                                compartments=[tuple(map(int, r)) for r in data[f"{name}.compartments"]], cross=cross,
                                replicates=reps, interval_note=meta.get("interval_notes", {}).get(name)))
    return LayerStats(meta["key"], meta, subs[0], subs[1] if len(subs) > 1 else None, path)
