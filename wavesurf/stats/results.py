"""The result of one analysis: per-layer statistics of every token subset and what is computed
from them (set scores, pair matrices, depth curves, intervals). :mod:`wavesurf.stats.analysis`
makes them in one pass; :mod:`wavesurf.stats.store` writes and reads them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import WavesurfError
from .cka import cka_to_last, neighbour_cka
from .entropy import aggregate_entropy as _aggregate_entropy
from .entropy import aggregate_entropy2_closed_form, effective_rank, max_entropy, redundancy as _redundancy
from .entropy import redundancy2_closed_form
from .moments import LayerMoments
from .resampling import (DEFAULT_LEVEL, Jackknife, ReplicateView, aggregate_entropy2_replicates, boundary_frequency,
                         jackknife, redundancy2_replicates, values_and_replicates)


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


def control_view(stats: "LayerStats") -> "LayerStats":
    """The random control subset of a filtered LayerStats, as a LayerStats of its own (so
    selection and plots treat it like the filtered one)."""
    if stats.control is None:
        raise WavesurfError("these statistics have no random control (no token-entropy filter)")
    return LayerStats(stats.key + ":random", {**stats.meta, "subset": "random"}, stats.control, None, stats.path)
