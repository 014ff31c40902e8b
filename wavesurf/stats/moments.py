"""Streaming, mergeable first and second moments of layer activations, in float64.

Why: matrix entropy, aggregate entropy and exact linear CKA all derive from the per-layer and
cross-layer covariances of token vectors. Accumulating them in feature space makes the cost
independent of the number of tokens, and the accumulators of several workers can be summed.

Numerics: residual streams have large means and a few huge dimensions, so the naive
``sum(x x^T)/n - m m^T`` cancels catastrophically. Every row is first shifted by a fixed reference
vector (the mean of the first chunk of data seen, per feature), and the sums and outer products of the
shifted rows are accumulated in float64. The covariance is then ``(S - n m m^T)/(n - ddof)`` with ``m``
the mean of the *shifted* rows, which is small, so nothing cancels.

Over ~450 lines because the shifted float64 accumulators, their merge and all-reduce and the cross-
layer blocks are one numerical scheme, tested together against brute force.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch

from wavesurf.errors import StatsError

Tensor = torch.Tensor
States = Union[Mapping[int, Tensor], Sequence[Tensor]]

_FORMAT = "wavesurf.stats.LayerMoments/1"
# One GEMM chunk holds at most this many float64 elements of concatenated rows (512 MiB).
_CHUNK_ELEMENTS = 2**26
# Default number of column panels for the pairs=True update. Measured on a 2-core AVX-512 CPU, one
# update of 4096 rows x 31 layers x 576 dims (float64 result): one full GEMM 36.7-45 s, 8 layer-aligned
# panels (~56 % of the FLOPs) 30-34 s, a float32 GEMM added into float64 31-41 s and only ~2e-7
# accurate (the tests ask for 1e-8), so the update is float64 GEMMs.
DEFAULT_GEMM_PANELS = 8


def masked_group_ids(groups: Tensor, mask: Tensor | None = None, device: torch.device | str | None = None) -> Tensor:
    """Return the group ids of the rows ``mask`` selects (all rows, flattened, without a mask),
    in the row order of :func:`gather_layer_rows`, on ``device`` (default: where ``groups`` is).

    Group ids are made on the CPU while masks come from the model's device (a GPU in a CUDA run),
    so the mask is moved to the ids before indexing.
    """
    groups = torch.as_tensor(groups)
    picked = groups[torch.as_tensor(mask).to(groups.device)] if mask is not None else groups.reshape(-1)
    return picked if device is None else picked.to(device)


def gather_layer_rows(
    states: States,
    layer_ids: Sequence[int],
    mask: Tensor | None = None,
    dim: int | None = None,
) -> list[Tensor]:
    """Return, per layer id, the selected rows as a 2-D ``[n, d]`` tensor (dtype and device unchanged).

    ``states`` is a dict keyed by layer id (extra keys are ignored) or a list in ``layer_ids`` order;
    each tensor is ``[B, T, d]`` or ``[n, d]``. ``mask`` (bool, ``[B, T]`` or ``[n]``) selects the same
    rows for every layer.
    """
    layer_ids = list(layer_ids)
    if isinstance(states, Mapping):
        missing = [lid for lid in layer_ids if lid not in states]
        if missing:
            raise StatsError(
                f"states lack layer ids {missing}; expected every id in {layer_ids}, got keys {sorted(states)}"
            )
        tensors = [states[lid] for lid in layer_ids]
    else:
        tensors = list(states)
        if len(tensors) != len(layer_ids):
            raise StatsError(
                f"got {len(tensors)} state tensors for {len(layer_ids)} layer ids {layer_ids}; "
                "pass one tensor per layer, in layer_ids order, or a dict keyed by layer id"
            )
    lead_shape = None
    out: list[Tensor] = []
    for lid, x in zip(layer_ids, tensors):
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(np.asarray(x))
        if x.dim() not in (2, 3):
            raise StatsError(f"layer {lid}: states must be [B, T, d] or [n, d], got shape {tuple(x.shape)}")
        if dim is not None and x.shape[-1] != dim:
            raise StatsError(f"layer {lid}: last dimension is {x.shape[-1]}, expected dim={dim}")
        if not x.is_floating_point():
            raise StatsError(f"layer {lid}: states must be a float tensor, got dtype {x.dtype}")
        if lead_shape is None:
            lead_shape = tuple(x.shape[:-1])
        elif tuple(x.shape[:-1]) != lead_shape:
            raise StatsError(
                f"layer {lid}: leading shape {tuple(x.shape[:-1])} differs from the first layer's {lead_shape}; "
                "every layer must hold the same token rows"
            )
        x = x.detach()
        if mask is not None:
            m = torch.as_tensor(mask)
            if m.dtype != torch.bool:
                raise StatsError(f"mask must be a bool tensor, got dtype {m.dtype}")
            if tuple(m.shape) != lead_shape:
                raise StatsError(f"mask shape {tuple(m.shape)} does not match the states' leading shape {lead_shape}")
            x = x[m.to(x.device)]
        else:
            x = x.reshape(-1, x.shape[-1])
        out.append(x)
    return out


def all_finite(x: Tensor) -> bool:
    """Whether every value of ``x`` is finite, from one float64 sum (NaN and inf propagate through
    it): a read of the data instead of a full-size ``isfinite`` mask, which cost as much as the
    rank update itself on the statistics' batches."""
    return bool(torch.isfinite(x.sum(dtype=torch.float64)))


def shift_blocks_(outer: Tensor, sums: Tensor, delta: Tensor, n: Any) -> None:
    """Re-express per-layer shifted second-moment blocks relative to a shift ``delta`` lower, in
    place: ``outer += s delta^T + delta s^T + n delta delta^T`` for every layer (rows y shifted by
    the old reference are y + delta against the new one). ``outer`` ``[..., L, d, d]``, ``sums``
    ``[..., L, d]``, ``delta`` ``[L, d]``, ``n`` a count or one count per leading index."""
    counts = torch.as_tensor(n, dtype=outer.dtype, device=outer.device)
    outer.add_(sums[..., :, None] * delta[:, None, :])
    outer.add_(delta[:, :, None] * sums[..., None, :])
    outer.add_((delta[:, :, None] * delta[:, None, :]) * counts.reshape(counts.shape + (1, 1, 1)))


def l2_normalize_rows_(x: Tensor) -> Tensor:
    """Scale every row of ``x`` to unit L2 norm, in place (all-zero rows stay zero)."""
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    return x.div_(norms.clamp_min(torch.finfo(x.dtype).tiny))


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human-readable list of differing configuration keys (meta keys listed one by one)."""
    diffs: list[str] = []
    for key in a:
        if key == "meta":
            ma, mb = a["meta"] or {}, b["meta"] or {}
            for mk in sorted(set(ma) | set(mb), key=str):
                va, vb = ma.get(mk, "<absent>"), mb.get(mk, "<absent>")
                if va != vb:
                    diffs.append(f"meta[{mk!r}] ({va!r} vs {vb!r})")
        elif a[key] != b[key]:
            diffs.append(f"{key} ({a[key]!r} vs {b[key]!r})")
    return diffs


def state_config(sd: Mapping[str, Any], kind: str, expected_format: str) -> dict[str, Any]:
    """The ``config`` of an accumulator's state dict (or loaded npz), after checking that it is a
    ``kind`` state of ``expected_format``; a :class:`StatsError` naming what is wrong otherwise."""
    try:
        fmt = str(np.asarray(sd["format"]))
        cfg = json.loads(str(np.asarray(sd["config"])))
    except KeyError as exc:
        raise StatsError(f"not a {kind} state dict: missing key {exc}") from None
    if fmt != expected_format:
        raise StatsError(f"not a {kind} state dict: format {fmt!r}, expected {expected_format!r}")
    return cfg


class Counted:
    """What every streaming accumulator reports: token rows (``_n``) and ``update`` calls
    (``_batches``; merged accumulators add theirs) so far."""

    _n: int
    _batches: int

    @property
    def n(self) -> int:
        """Number of token rows accumulated."""
        return self._n

    @property
    def n_batches(self) -> int:
        """Number of ``update`` calls so far (merged accumulators add theirs)."""
        return self._batches


class LayerMoments(Counted):
    """Float64 streaming means and (cross-)covariances of token vectors for a fixed set of layers.

    ``pairs=True`` keeps the second-moment matrix of the concatenation of all layers, ``(L*d)^2``
    float64 (2.5 GB for 31 layers x 576), needed for cross-covariances, CKA and aggregate entropy.
    Only the block upper triangle (blocks (i, j) with i <= j, position in ``layer_ids``) is updated:
    the update is a few large column-panel GEMMs ``S[:, panel] += X[:, :end]^T X[:, panel]``
    (``gemm_panels=1`` is one full GEMM ``S += X^T X``; more panels skip most of the lower triangle).
    ``pairs=False`` keeps only the L per-layer ``d x d`` blocks (one batched GEMM per chunk).

    ``l2_normalize=True`` scales every row to unit L2 norm per layer before accumulation (cosine
    variant; all-zero rows stay zero). ``meta`` is any json-able dict describing what was accumulated
    (model, corpus, filters); accumulators only merge when it is equal.
    """

    def __init__(
        self,
        layer_ids: list[int],
        dim: int,
        pairs: bool = True,
        l2_normalize: bool = False,
        meta: dict | None = None,
        device: str | torch.device = "cpu",
        *,
        gemm_panels: int | None = None,
    ) -> None:
        layer_ids = [int(x) for x in layer_ids]
        if not layer_ids:
            raise StatsError("layer_ids is empty; give at least one layer id")
        if len(set(layer_ids)) != len(layer_ids):
            raise StatsError(f"layer_ids {layer_ids} contain duplicates")
        if int(dim) <= 0:
            raise StatsError(f"dim must be a positive int, got {dim}")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise StatsError(f"meta must be json-able, got {meta!r}: {exc}") from exc
        self.layer_ids: list[int] = layer_ids
        self.dim: int = int(dim)
        self.pairs: bool = bool(pairs)
        self.l2_normalize: bool = bool(l2_normalize)
        self.meta: dict = dict(meta) if meta else {}
        self.device = torch.device(device)
        L, d = len(layer_ids), self.dim
        self._pos = {lid: k for k, lid in enumerate(layer_ids)}
        self._n = 0
        self._batches = 0
        self._shift: Tensor | None = None  # [L*d]
        self._sum = torch.zeros(L * d, dtype=torch.float64, device=self.device)
        if self.pairs:
            self._outer = torch.zeros(L * d, L * d, dtype=torch.float64, device=self.device)
        else:
            self._outer = torch.zeros(L, d, d, dtype=torch.float64, device=self.device)
        panels = DEFAULT_GEMM_PANELS if gemm_panels is None else int(gemm_panels)
        if panels < 1:
            raise StatsError(f"gemm_panels must be >= 1, got {gemm_panels}")
        panels = min(panels, L)
        bounds = [round(L * k / panels) for k in range(panels + 1)]
        # Column ranges (in features) of the panels, aligned to layer boundaries.
        self._panels = [(bounds[k] * d, bounds[k + 1] * d) for k in range(panels)]

    # ------------------------------------------------------------------ properties
    def config(self) -> dict[str, Any]:
        """The settings two accumulators must share to be merged."""
        return {
            "layer_ids": list(self.layer_ids),
            "dim": self.dim,
            "pairs": self.pairs,
            "l2_normalize": self.l2_normalize,
            "meta": self.meta,
        }

    def _index(self, layer_id: int) -> int:
        try:
            return self._pos[int(layer_id)]
        except (KeyError, TypeError, ValueError):
            raise StatsError(f"layer {layer_id!r} is not accumulated; accumulated layer ids are {self.layer_ids}") from None

    def _slice(self, k: int) -> slice:
        return slice(k * self.dim, (k + 1) * self.dim)

    # ------------------------------------------------------------------ accumulation
    @torch.no_grad()
    def update(self, states: States, mask: Tensor | None = None) -> None:
        """Add a batch of token vectors: ``states`` per layer ``[B, T, d]`` or ``[n, d]``, ``mask`` selects rows.

        Raises StatsError (naming the layer id and the 1-based batch number) if a selected value is
        NaN/inf; nothing is accumulated from such a batch. Empty selections are ignored.
        """
        self._batches += 1
        rows = gather_layer_rows(states, self.layer_ids, mask, dim=self.dim)
        n = rows[0].shape[0]
        if n == 0:
            return
        for lid, r in zip(self.layer_ids, rows):
            if not all_finite(r):
                bad = int((~torch.isfinite(r)).sum())
                raise StatsError(
                    f"layer {lid} in batch {self._batches} has {bad} non-finite values (NaN/inf) "
                    f"among {n} selected rows x {self.dim} dims; nothing from this batch was accumulated"
                )
        L, d = len(self.layer_ids), self.dim
        step = max(1, _CHUNK_ELEMENTS // (L * d))
        for start in range(0, n, step):
            stop = min(n, start + step)
            m = stop - start
            X = torch.empty(m, L * d, dtype=torch.float64, device=self.device)
            for k, r in enumerate(rows):
                blk = X[:, self._slice(k)]
                blk.copy_(r[start:stop])
                if self.l2_normalize:
                    l2_normalize_rows_(blk)
            if self._shift is None:
                self._shift = X.mean(dim=0)
            X.sub_(self._shift)
            self._sum.add_(X.sum(dim=0))
            self._n += m
            if self.pairs:
                for a, b in self._panels:
                    self._outer[:b, a:b].addmm_(X[:, :b].T, X[:, a:b])
            else:
                Xv = X.view(m, L, d).transpose(0, 1)  # [L, m, d]
                self._outer.baddbmm_(Xv.transpose(1, 2), Xv)
            del X

    @torch.no_grad()
    def merge(self, other: "LayerMoments") -> "LayerMoments":
        """Add ``other``'s data into this accumulator (in place; returns ``self``). Exact.

        The other accumulator's sums are re-expressed relative to this one's shift:
        with ``delta = shift_b - shift_a``, ``s += s_b + n_b delta`` and
        ``S += S_b + s_b delta^T + delta s_b^T + n_b delta delta^T``.
        Refuses (StatsError listing the differing keys) unless layer_ids, dim, pairs, l2_normalize
        and meta are equal.
        """
        if not isinstance(other, LayerMoments):
            raise StatsError(f"can only merge another LayerMoments, got {type(other).__name__}")
        diffs = config_differences(self.config(), other.config())
        if diffs:
            raise StatsError("cannot merge LayerMoments accumulated with different settings: " + "; ".join(diffs))
        self._batches += other._batches
        if other._n == 0:
            return self
        o_sum = other._sum.to(self.device)
        o_outer = other._outer.to(self.device)
        o_shift = other._shift.to(self.device)
        if self._n == 0:
            self._shift = o_shift.clone()
            self._sum.copy_(o_sum)
            self._outer.copy_(o_outer)
            self._n = other._n
            return self
        nb = other._n
        delta = o_shift - self._shift
        self._outer.add_(o_outer)
        if self.pairs:
            self._outer.addr_(o_sum, delta)
            self._outer.addr_(delta, o_sum)
            self._outer.addr_(delta, delta, alpha=float(nb))
        else:
            L, d = len(self.layer_ids), self.dim
            shift_blocks_(self._outer, o_sum.view(L, d), delta.view(L, d), nb)
        self._sum.add_(o_sum + nb * delta)
        self._n += nb
        return self

    def __iadd__(self, other: "LayerMoments") -> "LayerMoments":
        return self.merge(other)

    @torch.no_grad()
    def all_reduce_(self) -> "LayerMoments":
        """Sum this accumulator over the processes of the default ``torch.distributed`` group, in
        place (every process ends with the total; a no-op for one process). Exact, like
        :meth:`merge`: each process re-expresses its sums relative to the shift of the first
        process that has data, then the sums are added (see :mod:`wavesurf.distributed`)."""
        from ..distributed import all_reduce_into_, all_reduce_sum, broadcast_, collective_device, world

        rank, size = world()
        if size == 1:
            return self
        dev = collective_device()
        counts = torch.zeros(size, dtype=torch.int64, device=dev)
        counts[rank] = self._n
        all_reduce_sum(counts)
        has_data = [r for r in range(size) if int(counts[r]) > 0]
        L, d = len(self.layer_ids), self.dim
        if has_data:
            src = has_data[0]
            shift = (self._shift if rank == src else torch.zeros(L * d, dtype=torch.float64)).to(dev)
            broadcast_(shift, src)
            common = shift.to(self.device)
            if self._n > 0:
                delta = self._shift - common
                if self.pairs:
                    self._outer.addr_(self._sum, delta)
                    self._outer.addr_(delta, self._sum)
                    self._outer.addr_(delta, delta, alpha=float(self._n))
                else:
                    shift_blocks_(self._outer, self._sum.view(L, d), delta.view(L, d), self._n)
                self._sum.add_(self._n * delta)
            self._shift = common
            all_reduce_into_(self._sum)
            all_reduce_into_(self._outer)
        n, batches = (int(v) for v in all_reduce_sum(torch.tensor([self._n, self._batches], dtype=torch.int64,
                                                                    device=dev)).tolist())
        self._n, self._batches = n, batches
        return self

    # ------------------------------------------------------------------ results
    def _check_n(self, ddof: int) -> None:
        if self._n - ddof <= 0:
            raise StatsError(f"covariance needs more than ddof={ddof} rows; only {self._n} accumulated")

    def _outer_block(self, ka: int, kb: int) -> Tensor:
        """Shifted second-moment block (a, b), using only the valid block upper triangle."""
        if not self.pairs:
            return self._outer[ka]
        if ka <= kb:
            return self._outer[self._slice(ka), self._slice(kb)]
        return self._outer[self._slice(kb), self._slice(ka)].T

    @torch.no_grad()
    def covariance(self, i: int, j: int | None = None, ddof: int = 1) -> Tensor:
        """Covariance ``C_ii`` (or cross-covariance ``C_ij``) of layers ``i``, ``j``: float64 ``[d, d]``.

        ``ddof=1`` matches ``np.cov`` (divide by n-1); the scale cancels in entropy and CKA.
        Cross-covariances need ``pairs=True``.
        """
        ka = self._index(i)
        kb = ka if j is None else self._index(j)
        if ka != kb and not self.pairs:
            raise StatsError(
                f"cross-covariance of layers {i} and {j} needs pairs=True; this accumulator keeps only per-layer blocks"
            )
        self._check_n(ddof)
        n = self._n
        ma = self._sum[self._slice(ka)] / n
        mb = self._sum[self._slice(kb)] / n
        C = (self._outer_block(ka, kb) - n * torch.outer(ma, mb)) / (n - ddof)
        if ka == kb:
            C = 0.5 * (C + C.T)
        return C

    def covariance_rows(self, start: int, stop: int, ddof: int = 1) -> Tensor:
        """Covariance rows of the layers at positions ``start:stop`` against all layers: ``[(stop-start)*d, L*d]``.

        Only the column blocks of positions ``>= start`` are valid (block upper triangle). Internal
        helper for batched CKA; needs ``pairs=True``.
        """
        if not self.pairs:
            raise StatsError("covariance_rows needs pairs=True")
        self._check_n(ddof)
        n, d = self._n, self.dim
        rows = slice(start * d, stop * d)
        mr = self._sum[rows] / n
        m = self._sum / n
        C = self._outer[rows, :].clone()
        C.addr_(mr, m, alpha=-float(n))
        C.div_(n - ddof)
        return C

    def mean(self, i: int) -> Tensor:
        """Mean vector of layer ``i`` (after L2 normalisation when enabled): float64 ``[d]``."""
        k = self._index(i)
        if self._n == 0:
            raise StatsError("mean is undefined: no rows accumulated")
        return self._shift[self._slice(k)] + self._sum[self._slice(k)] / self._n

    # ------------------------------------------------------------------ persistence
    @torch.no_grad()
    def _symmetrize_(self) -> None:
        """Fill the lower block triangle from the upper one (pairs=True), in place."""
        if not self.pairs:
            return
        d = self.dim
        for k in range(len(self.layer_ids) - 1):
            cols = slice(k * d, (k + 1) * d)
            self._outer[(k + 1) * d :, cols] = self._outer[cols, (k + 1) * d :].T

    def state_dict(self) -> dict[str, np.ndarray]:
        """All state as numpy arrays (strings as 0-d arrays), so ``np.savez(path, **sd)`` saves it.

        ``outer`` is the full symmetric shifted second-moment matrix (pairs=True, ``[L*d, L*d]``) or the
        per-layer blocks (``[L, d, d]``); ``sum`` and ``shift`` are ``[L*d]``. Arrays are copies.
        """
        self._symmetrize_()
        L, d = len(self.layer_ids), self.dim
        shift = self._shift if self._shift is not None else torch.zeros(L * d, dtype=torch.float64)
        return {
            "format": np.array(_FORMAT),
            "config": np.array(json.dumps(self.config(), sort_keys=True)),
            "n": np.array(self._n, dtype=np.int64),
            "n_batches": np.array(self._batches, dtype=np.int64),
            "has_shift": np.array(self._shift is not None),
            "shift": shift.cpu().numpy().copy(),
            "sum": self._sum.cpu().numpy().copy(),
            "outer": self._outer.cpu().numpy().copy(),
        }

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, Any], device: str | torch.device = "cpu") -> "LayerMoments":
        """Rebuild an accumulator from ``state_dict()`` output (or a loaded npz)."""
        cfg = state_config(sd, "LayerMoments", _FORMAT)
        obj = cls(cfg["layer_ids"], cfg["dim"], pairs=cfg["pairs"], l2_normalize=cfg["l2_normalize"],
                  meta=cfg["meta"], device=device)
        outer = torch.as_tensor(np.asarray(sd["outer"], dtype=np.float64))
        if tuple(outer.shape) != tuple(obj._outer.shape):
            raise StatsError(f"state dict 'outer' has shape {tuple(outer.shape)}, expected {tuple(obj._outer.shape)}")
        obj._outer.copy_(outer)
        obj._sum.copy_(torch.as_tensor(np.asarray(sd["sum"], dtype=np.float64)))
        obj._n = int(np.asarray(sd["n"]))
        obj._batches = int(np.asarray(sd["n_batches"]))
        if bool(np.asarray(sd["has_shift"])):
            obj._shift = torch.as_tensor(np.asarray(sd["shift"], dtype=np.float64)).to(obj.device)
        return obj

    def save_npz(self, path: str) -> None:
        """Save ``state_dict()`` to an uncompressed ``.npz`` file."""
        np.savez(path, **self.state_dict())

    @classmethod
    def load_npz(cls, path: str, device: str | torch.device = "cpu") -> "LayerMoments":
        """Load an accumulator saved with ``save_npz``."""
        with np.load(path, allow_pickle=False) as z:
            return cls.from_state_dict({k: z[k] for k in z.files}, device=device)

    def __repr__(self) -> str:
        return (
            f"LayerMoments(layers={self.layer_ids}, dim={self.dim}, pairs={self.pairs}, "
            f"l2_normalize={self.l2_normalize}, n={self._n})"
        )
