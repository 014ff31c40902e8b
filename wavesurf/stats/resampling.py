"""Sequence-grouped jackknife intervals for the statistics of one pass.

Why: tokens of one sequence are strongly dependent, so the sampling noise of an entropy or CKA
value is set by the number of *sequences*, not tokens. Every sequence is assigned to one of ``G``
groups, conversations dealt in turn in corpus order (chunks of one long conversation share a group);
the accumulators keep their sums per group, so the statistic without group ``g`` is a subtraction,
not a second pass. The delete-a-group jackknife (Quenouille/Tukey; e.g. Efron & Tibshirani, *An
Introduction to the Bootstrap*, ch. 11) then gives a standard error from the ``G`` leave-one-group-out
values ``theta_(g)``::

    se = sqrt((G - 1) / G * sum_g (theta_(g) - mean_g theta_(g))^2)

and the interval ``theta_hat +- t_{G-1, (1+level)/2} * se`` around the full-data value.

:class:`GroupedLayerMoments` holds float64 per-layer covariance sums per group (``G * L * d^2``
float64: 0.82 GB for SmolLM2-135M at G=10), for per-layer entropy, purity and trace;
:class:`wavesurf.stats.cka.MinibatchCKA` with ``n_groups`` gives the leave-one-group-out HSIC sums
for CKA and the alpha=2 aggregate entropy of layer sets.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from wavesurf.errors import StatsError
from wavesurf.stats.moments import (States, all_finite, config_differences, gather_layer_rows, l2_normalize_rows_,
                                    masked_group_ids, shift_blocks_)

#: Resampling groups of the analyses by default: enough degrees of freedom (G - 1 = 9) for a t
#: interval, few enough that each group still holds several sequences on a 20k-token run.
DEFAULT_GROUPS = 10
DEFAULT_LEVEL = 0.95
_FORMAT = "wavesurf.stats.GroupedLayerMoments/1"


# ------------------------------------------------------------------------------------------------
# groups
def check_groups(n_groups: Any, n_sequences: int | None = None) -> int:
    """``n_groups`` as an int if it is 0 (no intervals) or in ``[2, n_sequences]``; else StatsError."""
    try:
        g = int(n_groups)
    except (TypeError, ValueError):
        raise StatsError(f"resample_groups must be an integer (0 turns intervals off, else >= 2), got {n_groups!r}") from None
    if g != n_groups or g < 0 or g == 1:
        raise StatsError(f"resample_groups={n_groups!r} is not allowed: use 0 (no intervals) or an integer >= 2 "
                         f"(the jackknife needs at least two groups of sequences; {DEFAULT_GROUPS} is the default)")
    if g and n_sequences is not None and g > n_sequences:
        raise StatsError(f"resample_groups={g} is more than the {n_sequences} sequences available; every group needs "
                         f"at least one sequence, so use at most {n_sequences} groups (or more tokens)")
    return g


def conversation_key(example_id: str) -> str:
    """The conversation an example id belongs to (``abc_3`` -> ``abc``): chunks share a group."""
    base, _, suffix = str(example_id).rpartition("_")
    return base if base and suffix.isdigit() else str(example_id)


class GroupAssigner:
    """Resampling group (``0..n_groups-1``) of each sequence: conversations are dealt to the groups
    in turn, in corpus order (``order``: the corpus's example ids) when given, else in the order
    they first appear. Dealing in turn keeps the groups' sizes within one conversation of each
    other; corpus order makes the assignment independent of batching and of how a run is split
    over processes. Chunks of one long conversation (``abc_0``, ``abc_1``) share a group."""

    def __init__(self, n_groups: int, order: Sequence[str] | None = None) -> None:
        self.n_groups = int(n_groups)
        if self.n_groups < 2:
            raise StatsError(f"GroupAssigner needs n_groups >= 2, got {n_groups}")
        self._group: dict[str, int] = {}
        for example_id in order or ():
            self.group(example_id)

    def group(self, example_id: str) -> int:
        key = conversation_key(example_id)
        g = self._group.get(key)
        if g is None:
            g = self._group[key] = len(self._group) % self.n_groups
        return g

    def row_groups(self, example_ids: Sequence[str], shape: tuple[int, int]) -> torch.Tensor:
        """``[B, T]`` int64 group of every position of a padded batch whose row b is ``example_ids[b]``."""
        B, T = shape
        if len(example_ids) != B:
            raise StatsError(f"{len(example_ids)} example ids for a batch of {B} sequences")
        g = torch.tensor([self.group(e) for e in example_ids], dtype=torch.int64)
        return g[:, None].expand(B, T)


# ------------------------------------------------------------------------------------------------
# jackknife
def t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t with ``df`` degrees of freedom (:func:`wavesurf.tdist.t_critical`,
    the one home of the t distribution, exact in the far tail too)."""
    from ..tdist import t_critical

    if not 0.0 < p < 1.0:
        raise StatsError(f"p={p} must be in (0, 1)")
    if df < 1:
        raise StatsError(f"df={df} must be >= 1")
    if p == 0.5:
        return 0.0
    t = float(t_critical(2.0 * min(p, 1.0 - p), df, error=StatsError))
    return t if p > 0.5 else -t


@dataclass(frozen=True)
class Jackknife:
    """Arrays (same shape as the statistic) of a grouped-jackknife interval."""

    estimate: np.ndarray  # full-data value
    se: np.ndarray  # jackknife standard error
    low: np.ndarray
    high: np.ndarray
    n_groups: int
    level: float

    def excludes_zero(self) -> np.ndarray:
        """True where the interval lies wholly above or below 0 (for differences)."""
        return (self.low > 0) | (self.high < 0)


def jackknife(estimate: Any, replicates: Any, level: float = DEFAULT_LEVEL) -> Jackknife:
    """Grouped-jackknife interval from the full-data ``estimate`` (any shape) and the leave-one-group-out
    ``replicates`` (``[G, *shape]``). NaN replicates (a group that removed all data) give NaN."""
    est = np.asarray(estimate, dtype=np.float64)
    reps = np.asarray(replicates, dtype=np.float64)
    if reps.ndim < 1 or reps.shape[1:] != est.shape:
        raise StatsError(f"replicates of shape {reps.shape} do not match an estimate of shape {est.shape}; "
                         "expected [n_groups, *estimate.shape]")
    G = reps.shape[0]
    if G < 2:
        raise StatsError(f"a jackknife needs at least 2 groups, got {G}")
    if not 0.0 < level < 1.0:
        raise StatsError(f"level={level} must be in (0, 1)")
    dev = reps - reps.mean(axis=0)
    se = np.sqrt((G - 1) / G * (dev * dev).sum(axis=0))
    half = t_quantile(0.5 + level / 2, G - 1) * se
    return Jackknife(est, se, est - half, est + half, G, level)


# ------------------------------------------------------------------------------------------------
class GroupedLayerMoments:
    """Float64 per-layer first and second moments of token vectors, kept separately for ``n_groups``
    groups, so that the covariance of every layer *without* one group is a subtraction.

    Rows are shifted by a fixed reference (the mean of the first chunk seen) before accumulation, as
    in :class:`~wavesurf.stats.moments.LayerMoments`, so nothing cancels catastrophically. The
    cost per row equals a ``pairs=False`` LayerMoments (one ``d x d`` rank update per layer), which
    it can replace (``covariance(layer_id)`` over all groups); memory is ``n_groups * L * d^2``
    float64. (Float32 rank updates were tried and measured slower: the conversion copy costs more
    than the GEMM saves at these sizes.)
    """

    pairs = False  # per-layer blocks only, like LayerMoments(pairs=False)

    def __init__(self, layer_ids: Sequence[int], dim: int, n_groups: int, l2_normalize: bool = False,
                 meta: dict | None = None) -> None:
        self.layer_ids = [int(x) for x in layer_ids]
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise StatsError(f"layer_ids must be non-empty and distinct, got {list(layer_ids)}")
        if int(dim) <= 0:
            raise StatsError(f"dim must be a positive int, got {dim}")
        self.n_groups = check_groups(n_groups)
        if self.n_groups == 0:
            raise StatsError("GroupedLayerMoments needs n_groups >= 2")
        self.dim, self.l2_normalize = int(dim), bool(l2_normalize)
        self.meta = dict(meta) if meta else {}
        G, L, d = self.n_groups, len(self.layer_ids), self.dim
        self._pos = {lid: k for k, lid in enumerate(self.layer_ids)}
        self._count = np.zeros(G, dtype=np.int64)
        self._shift: torch.Tensor | None = None  # [L, d]
        self._sum = torch.zeros(G, L, d, dtype=torch.float64)
        self._outer = torch.zeros(G, L, d, d, dtype=torch.float64)

    @property
    def group_sizes(self) -> np.ndarray:
        """Token rows per group."""
        return self._count.copy()

    @property
    def n(self) -> int:
        return int(self._count.sum())

    def config(self) -> dict[str, Any]:
        return {"layer_ids": self.layer_ids, "dim": self.dim, "n_groups": self.n_groups,
                "l2_normalize": self.l2_normalize, "meta": self.meta}

    @torch.no_grad()
    def update(self, states: States, groups: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add token rows (``states`` per layer as for LayerMoments) with their group ids
        (``groups``: int ``[B, T]`` or ``[n]``, same leading shape as the states; values in
        ``0..n_groups-1``)."""
        if groups is None:
            raise StatsError(f"GroupedLayerMoments keeps {self.n_groups} resampling groups; pass every row's group id")
        rows = gather_layer_rows(states, self.layer_ids, mask, dim=self.dim)
        g = masked_group_ids(groups, mask, "cpu")  # the sums live on the CPU, whatever device the rows come from
        n = rows[0].shape[0]
        if g.numel() != n:
            raise StatsError(f"{g.numel()} group ids for {n} selected rows")
        if n == 0:
            return
        if int(g.min()) < 0 or int(g.max()) >= self.n_groups:
            raise StatsError(f"group ids must be in 0..{self.n_groups - 1}, got {int(g.min())}..{int(g.max())}")
        # rows sorted by group once, so every group is a contiguous slice (one gather per layer)
        order = torch.argsort(g, stable=True)
        counts = torch.bincount(g, minlength=self.n_groups).tolist()
        X = torch.empty(n, len(self.layer_ids), self.dim, dtype=torch.float64)
        for k, r in enumerate(rows):
            X[:, k].copy_(r.index_select(0, order.to(r.device)))
        if not all_finite(X):
            bad = [lid for k, lid in enumerate(self.layer_ids) if not all_finite(X[:, k])]
            more = f" (and layers {bad[1:]})" if len(bad) > 1 else ""
            raise StatsError(f"layer {bad[0]}{more} has non-finite values (NaN/inf); nothing from this batch was accumulated")
        if self.l2_normalize:
            l2_normalize_rows_(X.view(-1, self.dim))
        if self._shift is None:
            self._shift = X.mean(dim=0)
        X.sub_(self._shift)
        a = 0
        for grp, c in enumerate(counts):
            if c == 0:
                continue
            Xg = X[a:a + c].transpose(0, 1)  # [L, n_g, d] view
            a += c
            self._sum[grp].add_(Xg.sum(dim=1))
            self._outer[grp].baddbmm_(Xg.transpose(1, 2), Xg)
            self._count[grp] += c

    @torch.no_grad()
    def merge(self, other: "GroupedLayerMoments") -> "GroupedLayerMoments":
        """Add another accumulator (same settings) in place; exact (sums re-expressed to this shift)."""
        diffs = config_differences(self.config(), other.config())
        if diffs:
            raise StatsError("cannot merge GroupedLayerMoments with different settings: " + "; ".join(diffs))
        if other._shift is None:
            return self
        if self._shift is None:
            self._shift = other._shift.clone()
        delta = other._shift - self._shift  # [L, d]
        self._outer.add_(other._outer)
        shift_blocks_(self._outer, other._sum, delta, other._count)
        nb = torch.as_tensor(other._count, dtype=torch.float64)[:, None, None]
        self._sum.add_(other._sum + nb * delta[None])
        self._count += other._count
        return self

    @torch.no_grad()
    def all_reduce_(self) -> "GroupedLayerMoments":
        """Sum over the processes of the default ``torch.distributed`` group (no-op for one)."""
        from ..distributed import all_reduce_into_, all_reduce_sum, broadcast_, collective_device, world

        rank, size = world()
        if size == 1:
            return self
        dev = collective_device()
        has = torch.zeros(size, dtype=torch.int64, device=dev)
        has[rank] = int(self._shift is not None)
        all_reduce_sum(has)
        holders = [r for r in range(size) if int(has[r])]
        if not holders:
            return self
        shift = (self._shift if rank == holders[0] else torch.zeros(len(self.layer_ids), self.dim,
                                                                     dtype=torch.float64)).to(dev)
        broadcast_(shift, holders[0])
        common = shift.cpu()
        mine = GroupedLayerMoments(self.layer_ids, self.dim, self.n_groups, self.l2_normalize, self.meta)
        mine._shift = common.clone()
        mine.merge(self)
        self._shift, self._sum, self._outer, self._count = common, mine._sum, mine._outer, mine._count
        all_reduce_into_(self._sum)
        all_reduce_into_(self._outer)
        counts = all_reduce_sum(torch.as_tensor(self._count, device=dev))
        self._count = counts.cpu().numpy().astype(np.int64)
        return self

    def _k(self, layer_id: int) -> int:
        try:
            return self._pos[int(layer_id)]
        except KeyError:
            raise StatsError(f"layer {layer_id!r} is not accumulated; ids are {self.layer_ids}") from None

    @torch.no_grad()
    def covariance(self, layer_id: int, drop_group: int | None = None, ddof: int = 1) -> torch.Tensor:
        """Covariance of one layer over all groups, or over all but ``drop_group``: float64 ``[d, d]``."""
        k = self._k(layer_id)
        s, S, n = self._sum[:, k].sum(0), self._outer[:, k].sum(0), int(self._count.sum())
        if drop_group is not None:
            s, S, n = s - self._sum[drop_group, k], S - self._outer[drop_group, k], n - int(self._count[drop_group])
        if n - ddof <= 0:
            raise StatsError(f"covariance needs more than ddof={ddof} rows; only {n} left"
                             + ("" if drop_group is None else f" without group {drop_group}"))
        m = s / n
        C = (S - n * torch.outer(m, m)) / (n - ddof)
        return 0.5 * (C + C.T)

    def state_dict(self) -> dict[str, np.ndarray]:
        L, d = len(self.layer_ids), self.dim
        shift = self._shift if self._shift is not None else torch.zeros(L, d, dtype=torch.float64)
        return {"format": np.array(_FORMAT), "config": np.array(json.dumps(self.config(), sort_keys=True)),
                "count": self._count.copy(), "has_shift": np.array(self._shift is not None),
                "shift": shift.numpy().copy(), "sum": self._sum.numpy().copy(), "outer": self._outer.numpy().copy()}

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, Any]) -> "GroupedLayerMoments":
        if str(np.asarray(sd.get("format", ""))) != _FORMAT:
            raise StatsError(f"not a GroupedLayerMoments state dict (format {str(np.asarray(sd.get('format', '')))!r})")
        cfg = json.loads(str(np.asarray(sd["config"])))
        obj = cls(cfg["layer_ids"], cfg["dim"], cfg["n_groups"], cfg["l2_normalize"], cfg["meta"])
        obj._count = np.asarray(sd["count"], dtype=np.int64).copy()
        obj._sum = torch.as_tensor(np.array(sd["sum"], dtype=np.float64))
        obj._outer = torch.as_tensor(np.array(sd["outer"], dtype=np.float64))
        if bool(np.asarray(sd["has_shift"])):
            obj._shift = torch.as_tensor(np.array(sd["shift"], dtype=np.float64))
        return obj


# ------------------------------------------------------------------------------------------------
# quantities of a SubsetStats with replicates
#: Per-layer quantities stored with leave-one-group-out replicates ``[G, L]`` (plus ``cka`` ``[G, L, L]``).
REPLICATED = ("entropy", "entropy2", "normalized_entropy", "purity", "trace")
#: Everything :func:`values_and_replicates` derives (``mean_<q>`` averages a per-layer ``q`` over layers).
QUANTITIES = REPLICATED + ("effective_rank", "cka", "cka_next", "cka_to_last")


def values_and_replicates(sub: Any, quantity: str) -> tuple[np.ndarray, np.ndarray]:
    """``(full-data value, [G, ...] leave-one-group-out values)`` of a quantity of a
    :class:`~wavesurf.stats.results.SubsetStats` that carries replicates. ``quantity`` is one of
    :data:`QUANTITIES` or ``mean_<q>`` for a per-layer one."""
    reps = getattr(sub, "replicates", None)
    if reps is None:
        raise StatsError(f"subset {getattr(sub, 'name', '?')!r} has no resampling replicates "
                         f"({getattr(sub, 'interval_note', None) or 'computed with resample_groups=0'})")
    if quantity.startswith("mean_"):
        est, r = values_and_replicates(sub, quantity[5:])
        if est.ndim != 1:
            raise StatsError(f"{quantity!r}: only per-layer quantities can be averaged over layers")
        return np.asarray(est.mean()), r.mean(axis=1)
    if quantity in REPLICATED:
        return np.asarray(getattr(sub, quantity), dtype=np.float64), np.asarray(reps[quantity], dtype=np.float64)
    if quantity == "effective_rank":
        return np.exp(np.asarray(sub.entropy, dtype=np.float64)), np.exp(np.asarray(reps["entropy"]))
    cka, rc = np.asarray(sub.cka, dtype=np.float64), np.asarray(reps["cka"], dtype=np.float64)
    if quantity == "cka":
        return cka, rc
    if quantity == "cka_next":
        return np.diagonal(cka, offset=1).copy(), np.diagonal(rc, offset=1, axis1=1, axis2=2).copy()
    if quantity == "cka_to_last":
        return cka[:, -1].copy(), rc[:, :, -1].copy()
    raise StatsError(f"quantity {quantity!r} is not one of {', '.join(QUANTITIES)} (or mean_<per-layer quantity>)")


def aggregate_entropy2_replicates(sub: Any, positions: Any) -> tuple[np.ndarray, np.ndarray]:
    """Alpha=2 aggregate entropy (nats) of layer sets (``[m, k]`` positions into the subset's layers):
    full-data values ``[m]`` and leave-one-group-out values ``[G, m]`` (closed form from purity and CKA)."""
    from .entropy import aggregate_entropy2_closed_form

    est_p, rep_p = values_and_replicates(sub, "purity")
    est_c, rep_c = values_and_replicates(sub, "cka")
    est = aggregate_entropy2_closed_form(est_p, est_c, positions)
    reps = np.stack([aggregate_entropy2_closed_form(p, c, positions) for p, c in zip(rep_p, rep_c)])
    return est, reps


def redundancy2_replicates(sub: Any, positions: Any) -> tuple[np.ndarray, np.ndarray]:
    """Alpha=2 redundancy (nats) of layer sets: the block-diagonal alpha=2 aggregate entropy minus
    the joint one, full-data ``[m]`` and leave-one-group-out ``[G, m]`` values."""
    from .entropy import redundancy2_closed_form

    est_p, rep_p = values_and_replicates(sub, "purity")
    est_c, rep_c = values_and_replicates(sub, "cka")
    return (redundancy2_closed_form(est_p, est_c, positions),
            np.stack([redundancy2_closed_form(p, c, positions) for p, c in zip(rep_p, rep_c)]))


def boundary_frequency(sub: Any) -> np.ndarray:
    """``[L]``: share of leave-one-group-out CKA matrices whose compartments (same rule as the full
    data) start a new compartment at each layer position (0 for the first position)."""
    from .compartments import compartments

    _, rc = values_and_replicates(sub, "cka")
    L = rc.shape[1]
    hits = np.zeros(L)
    for c in rc:
        for start, _ in compartments(c)[1:]:
            hits[start] += 1
    return hits / len(rc)


class ReplicateView:
    """The arrays selection reads, of one leave-one-group-out replicate of a LayerStats (or of the
    full data, :meth:`full`), for how often a method's choice recurs across resamples. No
    cross-covariances: aggregate selection then scores with the alpha=2 closed form only."""

    has_cross_covariance = False
    key = None

    def __init__(self, n_layers: int, layer_ids: Sequence[int], arrays: Mapping[str, Any]) -> None:
        self.n_layers, self.layer_ids = int(n_layers), list(layer_ids)
        self.entropy = np.asarray(arrays["entropy"])
        self.entropy2 = np.asarray(arrays["entropy2"])
        self.normalized_entropy = np.asarray(arrays["normalized_entropy"])
        self.purity = np.asarray(arrays["purity"])
        self.cka = np.asarray(arrays["cka"])

    @classmethod
    def replicate(cls, stats: Any, g: int) -> "ReplicateView":
        reps = stats.main.replicates
        return cls(stats.n_layers, stats.main.layer_ids, {q: reps[q][g] for q in (*REPLICATED, "cka")})

    @classmethod
    def full(cls, stats: Any) -> "ReplicateView":
        sub = stats.main
        return cls(stats.n_layers, sub.layer_ids, {q: getattr(sub, q) for q in (*REPLICATED, "cka")})
