"""Linear CKA between layers: exact from streamed covariances, or the unbiased minibatch estimator.

Why: linear CKA ``||C_ij||_F^2 / (||C_ii||_F ||C_jj||_F)`` says how much two layers carry the same
(linearly aligned) information. The exact full-data value needs the ``(L*d)^2`` cross-moment matrix of
:class:`~wavesurf.stats.moments.LayerMoments`; when that does not fit, :class:`MinibatchCKA`
(Nguyen, Raghu & Kornblith 2021) averages unbiased HSIC estimates over token minibatches, with memory
``O(L n^2)`` independent of the width d. Biased CKA of independent layers is far from 0 when
n is not much larger than d; the unbiased estimator is ~0 there.

Over ~450 lines because the exact and the minibatch estimators, and the choice between them by
memory, are compared with each other in every test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from wavesurf.errors import StatsError
from wavesurf.stats.moments import (Counted, LayerMoments, States, all_finite, config_differences, gather_layer_rows,
                                    masked_group_ids, state_config)

DEFAULT_MEMORY_BUDGET = 8 * 2**30  # bytes
_MB_FORMAT = "wavesurf.stats.MinibatchCKA/1"
# Elements of U-centred Gram rows (all layers) held at once in MinibatchCKA.update (256 MiB float64).
_GRAM_CHUNK_ELEMENTS = 2**25
# Elements of covariance row strips held at once in linear_cka_from_moments (256 MiB float64).
_STRIP_ELEMENTS = 2**25


def _np64(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def linear_cka_from_moments(moments: LayerMoments) -> np.ndarray:
    """Exact full-data (biased) linear CKA of all layer pairs, float64 ``[L, L]`` in ``layer_ids`` order.

    Computed from row strips of the covariance in one vectorised reduction per strip. A layer with zero
    variance gets NaN in its row and column.
    """
    if not moments.pairs:
        raise StatsError("linear_cka_from_moments needs a LayerMoments with pairs=True (cross-covariances)")
    L, d = len(moments.layer_ids), moments.dim
    fro2 = np.zeros((L, L), dtype=np.float64)
    per = max(1, _STRIP_ELEMENTS // (d * L * d))  # layers per strip
    with torch.no_grad():
        for s in range(0, L, per):
            e = min(L, s + per)
            C = moments.covariance_rows(s, e, ddof=0).view(e - s, d, L, d)
            f = C.square_().sum(dim=(1, 3)).cpu().numpy()  # [e-s, L]: ||C_ij||_F^2
            for i in range(s, e):
                fro2[i, i:] = f[i - s, i:]
            del C
    fro2 = np.triu(fro2) + np.triu(fro2, 1).T
    diag = np.sqrt(np.diag(fro2))
    with np.errstate(divide="ignore", invalid="ignore"):
        cka = fro2 / np.outer(diag, diag)
    bad = diag <= 0
    cka[bad, :] = np.nan
    cka[:, bad] = np.nan
    return cka


def linear_cka(X: Any, Y: Any) -> float:
    """Brute-force (biased) linear CKA of two ``[n, d]`` arrays in float64 (columns centred here)."""
    X, Y = _np64(X), _np64(Y)
    if X.ndim != 2 or Y.ndim != 2 or X.shape[0] != Y.shape[0]:
        raise StatsError(f"linear_cka needs [n, d1] and [n, d2] arrays with equal n, got {X.shape} and {Y.shape}")
    X = X - X.mean(axis=0)
    Y = Y - Y.mean(axis=0)
    n = X.shape[0]
    if n < min(X.shape[1], Y.shape[1]):  # Gram form is cheaper
        K, Lg = X @ X.T, Y @ Y.T
        num, dx, dy = np.sum(K * Lg), np.linalg.norm(K), np.linalg.norm(Lg)
    else:
        num = np.linalg.norm(Y.T @ X) ** 2
        dx, dy = np.linalg.norm(X.T @ X), np.linalg.norm(Y.T @ Y)
    if dx == 0 or dy == 0:
        return float("nan")
    return float(num / (dx * dy))


def neighbour_cka(cka: Any) -> np.ndarray:
    """CKA of consecutive layers: ``[L-1]`` with entry i = CKA(i, i+1)."""
    K = np.asarray(cka, dtype=np.float64)
    return np.diagonal(K, offset=1).copy()


def cka_to_last(cka: Any) -> np.ndarray:
    """CKA of every layer with the last one: ``[L]``."""
    K = np.asarray(cka, dtype=np.float64)
    return K[:, -1].copy()


def choose_cka_estimator(n_layers_plus_one: int, dim: int, memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET) -> str:
    """``"exact"`` if the float64 ``(L*d)^2`` cross-moment matrix, with 1.5x working space, fits the budget.

    ``n_layers_plus_one`` is the number of accumulated layers (all blocks plus the embedding output).
    Otherwise ``"minibatch"`` (unbiased minibatch CKA, memory independent of d).
    """
    L, d, budget = int(n_layers_plus_one), int(dim), int(memory_budget_bytes)
    if L <= 0 or d <= 0 or budget <= 0:
        raise StatsError(f"n_layers_plus_one, dim and memory_budget_bytes must be > 0, got {L}, {d}, {budget}")
    need = 1.5 * 8 * float(L * d) ** 2
    return "exact" if need <= budget else "minibatch"


def grouped_unbiased_hsic(xs: list[torch.Tensor], groups: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased linear HSIC of all layer pairs on one minibatch, and on the minibatch without each group.

    ``xs``: per layer ``[n, d]`` rows (any float dtype; centred here); ``groups``: ``[n]`` ids in
    ``0..n_groups-1``. Returns ``(H [L, L], H_without [G, L, L])`` in float64; a group whose removal
    leaves fewer than 4 rows gets zeros (that minibatch then counts for nothing in that replicate).

    Uses the closed form (Song et al. 2012, eq. 5) with ``K~`` the Gram with zero diagonal:
    ``HSIC = [tr(K~ L~) + 1'K~1 1'L~1 / ((m-1)(m-2)) - 2/(m-2) 1'K~L~1] / (m(m-3))``; each term of the
    subset without group g is the full term minus what rows/columns of g add, from per-group row and
    block sums of the Grams, so the G replicates cost one extra ``n^2/G``-sized GEMM per group.
    """
    L = len(xs)
    n = xs[0].shape[0]
    G = int(n_groups)
    dev, dt = xs[0].device, xs[0].dtype
    order = torch.argsort(groups, stable=True)
    g_sorted = groups[order]
    counts = torch.bincount(g_sorted, minlength=G)
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    K = torch.empty(L, n, n, dtype=dt, device=dev)
    for k, x in enumerate(xs):
        x = x[order]
        x = x - x.mean(dim=0)
        torch.mm(x, x.T, out=K[k])
        K[k].fill_diagonal_(0.0)
    M = torch.zeros(n, G, dtype=dt, device=dev)
    M[torch.arange(n, device=dev), g_sorted] = 1.0
    r = K.sum(dim=2)                                   # [L, n] row sums (= column sums)
    R = torch.matmul(K, M)                             # [L, n, G]: sum over columns in group g
    flat = K.reshape(L, n * n)
    A = torch.mm(flat, flat.T).double()                # tr(K~_i K~_j)
    B = r.double().sum(dim=1)                          # 1'K~1
    C = torch.mm(r, r.T).double()                      # 1'K~_i K~_j 1
    A_row = torch.zeros(G, L, L, dtype=torch.float64, device=dev)
    A_blk = torch.zeros(G, L, L, dtype=torch.float64, device=dev)
    for g in range(G):
        a, b = bounds[g], bounds[g + 1]
        if b == a:
            continue
        rows = K[:, a:b, :].reshape(L, -1)
        A_row[g] = torch.mm(rows, rows.T).double()
        blk = K[:, a:b, a:b].reshape(L, -1)
        A_blk[g] = torch.mm(blk, blk.T).double()
    Md = M.double()
    rg = torch.mm(r.double(), Md)                      # [L, G]: sum_{rows in g} row sums
    Rd = R.double()
    Kgg = torch.einsum("lng,ng->lg", Rd, Md)          # [L, G]: sum over the (g, g) block
    A_wo = A[None] - 2 * A_row + A_blk
    B_wo = B[None, :] - 2 * rg.T + Kgg.T               # [G, L]
    keep = (1.0 - Md).T                                 # [G, n]: columns outside g
    U = (r.double()[None] - Rd.permute(2, 0, 1)) * keep[:, None, :]   # [G, L, n]
    C_wo = torch.bmm(U, U.transpose(1, 2))              # [G, L, L]

    def combine(A_, B_, C_, m):
        return (A_ + B_[..., :, None] * B_[..., None, :] / ((m - 1) * (m - 2)) - 2 * C_ / (m - 2)) / (m * (m - 3))

    H = combine(A, B, C, float(n))
    m_wo = (n - counts).double()
    ok = m_wo >= 4
    m_safe = torch.where(ok, m_wo, torch.full_like(m_wo, 8.0))[:, None, None]
    H_wo = combine(A_wo, B_wo, C_wo, m_safe)
    H_wo[~ok] = 0.0
    return 0.5 * (H + H.T), 0.5 * (H_wo + H_wo.transpose(1, 2))


class MinibatchCKA(Counted):
    """Unbiased minibatch linear CKA of all layer pairs (Nguyen, Raghu & Kornblith 2021).

    Per minibatch of n >= 4 tokens: each layer's linear Gram ``K = X X^T`` is U-centred (Székely–Rizzo:
    zero the diagonal, subtract row/column means with the ``1/(n-2)`` and ``1/(2(n-1))`` corrections,
    zero the diagonal again); the stacked flattened Grams ``G [L, n^2]`` give all unbiased HSIC values
    as ``G G^T / (n (n-3))``. These are summed over minibatches; ``result()`` returns
    ``HSIC_ij / sqrt(HSIC_ii HSIC_jj)``. Gram rows are built in chunks, so memory is
    ``O(L * chunk * n)``, independent of d.

    Tokens in one minibatch should be shuffled across sequences (see :class:`TokenShuffler`).
    """

    def __init__(self, layer_ids: list[int], meta: dict | None = None, device: str | torch.device = "cpu",
                 gram_dtype: torch.dtype = torch.float64, n_groups: int = 0) -> None:
        """``gram_dtype=torch.float32`` builds the per-minibatch Grams in float32 (about 2x faster on
        CPU; relative error ~1e-6, far below the estimator's sampling error); HSIC sums stay float64.

        ``n_groups`` >= 2 also keeps, for each resampling group of sequences, the HSIC sums of every
        minibatch *without* that group's rows (:func:`grouped_unbiased_hsic`; ``update`` then needs
        ``groups``), from which :meth:`replicates` gives leave-one-group-out CKA matrices for the
        jackknife of :mod:`wavesurf.stats.resampling`. The whole minibatch's Grams are then held at
        once (``L * n^2`` values of ``gram_dtype``)."""
        from .resampling import check_groups

        self.gram_dtype = gram_dtype
        self.n_groups = check_groups(n_groups)
        layer_ids = [int(x) for x in layer_ids]
        if not layer_ids:
            raise StatsError("layer_ids is empty; give at least one layer id")
        if len(set(layer_ids)) != len(layer_ids):
            raise StatsError(f"layer_ids {layer_ids} contain duplicates")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise StatsError(f"meta must be json-able, got {meta!r}: {exc}") from exc
        self.layer_ids = layer_ids
        self.meta: dict = dict(meta) if meta else {}
        self.device = torch.device(device)
        L = len(layer_ids)
        self._hsic = torch.zeros(L, L, dtype=torch.float64, device=self.device)
        self._hsic_without = torch.zeros(self.n_groups, L, L, dtype=torch.float64, device=self.device)
        self._batches = 0
        self._n = 0

    def config(self) -> dict[str, Any]:
        return {"layer_ids": list(self.layer_ids), "meta": self.meta, "n_groups": self.n_groups}

    @torch.no_grad()
    def update(self, states: States, mask: torch.Tensor | None = None, groups: torch.Tensor | None = None) -> None:
        """Add one minibatch: per layer ``[n, d]`` (or ``[B, T, d]`` with ``mask``); n >= 4 tokens.
        ``groups`` (int, same leading shape as the states): each row's resampling group, needed
        exactly when the accumulator was built with ``n_groups``."""
        rows = gather_layer_rows(states, self.layer_ids, mask)
        if self.n_groups:
            if groups is None:
                raise StatsError(f"this MinibatchCKA keeps {self.n_groups} resampling groups; pass groups= with every update")
            groups = masked_group_ids(groups, mask, self.device)
            if groups.numel() != rows[0].shape[0]:
                raise StatsError(f"{groups.numel()} group ids for {rows[0].shape[0]} rows")
            if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= self.n_groups):
                raise StatsError(f"group ids must be in 0..{self.n_groups - 1}, got {int(groups.min())}..{int(groups.max())}")
        elif groups is not None:
            raise StatsError("groups= was given but this MinibatchCKA was built without n_groups")
        n = rows[0].shape[0]
        batch_no = self._batches + 1
        if n < 4:
            raise StatsError(f"minibatch CKA needs at least 4 tokens per minibatch (unbiased HSIC divides by n-3), got {n}")
        L = len(self.layer_ids)
        xs = []
        for lid, r in zip(self.layer_ids, rows):
            if not all_finite(r):
                raise StatsError(
                    f"layer {lid} in batch {batch_no} has {int((~torch.isfinite(r)).sum())} non-finite values (NaN/inf); "
                    "nothing from this batch was accumulated"
                )
            x = r.to(self.device, self.gram_dtype)
            xs.append(x - x.mean(dim=0))  # exact invariance; avoids cancellation in the Gram
        if self.n_groups:
            H, H_without = grouped_unbiased_hsic(xs, groups, self.n_groups)
            self._hsic.add_(H)
            self._hsic_without.add_(H_without)
            self._batches += 1
            self._n += n
            return
        means = []  # U-centring: row means of K with zero diagonal, corrected
        for x in xs:
            colsum = x @ x.sum(dim=0) - (x * x).sum(dim=1)  # column sums of K with zero diagonal
            mu = colsum / (n - 2)
            means.append(mu - mu.sum() / (2 * (n - 1)))
        chunk = max(1, min(n, _GRAM_CHUNK_ELEMENTS // (L * n)))
        H = torch.zeros(L, L, dtype=torch.float64, device=self.device)
        G = torch.empty(L, chunk, n, dtype=self.gram_dtype, device=self.device)
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            c = r1 - r0
            g = G[:, :c, :]
            idx = torch.arange(c, device=self.device)
            for k in range(L):
                gk = g[k]
                torch.mm(xs[k][r0:r1], xs[k].T, out=gk)
                gk.sub_(means[k][r0:r1, None]).sub_(means[k][None, :])
                gk[idx, r0 + idx] = 0.0
            flat = g.reshape(L, c * n)
            H.add_(torch.mm(flat, flat.T).double())
        H.div_(n * (n - 3))
        self._hsic.add_(0.5 * (H + H.T))
        self._batches += 1
        self._n += n

    def result(self) -> np.ndarray:
        """``[L, L]`` minibatch CKA (float64); NaN for a layer whose self-HSIC is not positive."""
        if self._batches == 0:
            raise StatsError("no minibatches accumulated; call update() first")
        H = self._hsic.cpu().numpy()
        diag = np.diag(H).copy()
        ok = diag > 0
        root = np.sqrt(np.where(ok, diag, np.nan))
        with np.errstate(invalid="ignore", divide="ignore"):
            return H / np.outer(root, root)

    def replicates(self) -> np.ndarray:
        """``[G, L, L]`` CKA of all minibatches with each resampling group's rows left out."""
        if not self.n_groups:
            raise StatsError("replicates need a MinibatchCKA built with n_groups >= 2")
        if self._batches == 0:
            raise StatsError("no minibatches accumulated; call update() first")
        H = self._hsic_without.cpu().numpy()
        diag = np.diagonal(H, axis1=1, axis2=2)
        root = np.sqrt(np.where(diag > 0, diag, np.nan))
        with np.errstate(invalid="ignore", divide="ignore"):
            return H / (root[:, :, None] * root[:, None, :])

    def hsic(self) -> np.ndarray:
        """Mean unbiased HSIC over minibatches, ``[L, L]``."""
        if self._batches == 0:
            raise StatsError("no minibatches accumulated; call update() first")
        return self._hsic.cpu().numpy() / self._batches

    def merge(self, other: "MinibatchCKA") -> "MinibatchCKA":
        """Add another accumulator's minibatches (in place; returns ``self``); refuses different settings."""
        if not isinstance(other, MinibatchCKA):
            raise StatsError(f"can only merge another MinibatchCKA, got {type(other).__name__}")
        diffs = config_differences(self.config(), other.config())
        if diffs:
            raise StatsError("cannot merge MinibatchCKA accumulated with different settings: " + "; ".join(diffs))
        self._hsic.add_(other._hsic.to(self.device))
        self._hsic_without.add_(other._hsic_without.to(self.device))
        self._batches += other._batches
        self._n += other._n
        return self

    def __iadd__(self, other: "MinibatchCKA") -> "MinibatchCKA":
        return self.merge(other)

    @torch.no_grad()
    def all_reduce_(self) -> "MinibatchCKA":
        """Sum the HSIC of every process's minibatches over the default ``torch.distributed`` group
        (in place; a no-op for one process). Each process draws its own minibatches, so the result
        is an equally valid estimate, not the single-process one."""
        from ..distributed import all_reduce_into_, all_reduce_sum, collective_device, world

        if world()[1] == 1:
            return self
        all_reduce_into_(self._hsic)
        if self.n_groups:
            all_reduce_into_(self._hsic_without)
        t = all_reduce_sum(torch.tensor([self._n, self._batches], dtype=torch.int64, device=collective_device()))
        self._n, self._batches = (int(v) for v in t.tolist())
        return self

    def state_dict(self) -> dict[str, np.ndarray]:
        """State as numpy arrays (``np.savez(path, **sd)`` works)."""
        return {
            "format": np.array(_MB_FORMAT),
            "config": np.array(json.dumps(self.config(), sort_keys=True)),
            "hsic_sum": self._hsic.cpu().numpy().copy(),
            "hsic_without_sum": self._hsic_without.cpu().numpy().copy(),
            "n_batches": np.array(self._batches, dtype=np.int64),
            "n": np.array(self._n, dtype=np.int64),
        }

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, Any], device: str | torch.device = "cpu") -> "MinibatchCKA":
        cfg = state_config(sd, "MinibatchCKA", _MB_FORMAT)
        obj = cls(cfg["layer_ids"], meta=cfg["meta"], device=device, n_groups=cfg.get("n_groups", 0))
        if obj.n_groups:
            obj._hsic_without.copy_(torch.as_tensor(np.asarray(sd["hsic_without_sum"], dtype=np.float64)))
        h = torch.as_tensor(np.asarray(sd["hsic_sum"], dtype=np.float64))
        if tuple(h.shape) != tuple(obj._hsic.shape):
            raise StatsError(f"state dict 'hsic_sum' has shape {tuple(h.shape)}, expected {tuple(obj._hsic.shape)}")
        obj._hsic.copy_(h)
        obj._batches = int(np.asarray(sd["n_batches"]))
        obj._n = int(np.asarray(sd["n"]))
        return obj


class TokenShuffler:
    """Reservoir-style shuffle buffer: turns streams of token rows into shuffled minibatches.

    Why: tokens of one sequence are strongly dependent; minibatch CKA wants each minibatch drawn from
    many sequences. ``add(rows)`` stores rows (a tensor ``[n, ...]`` such as ``[n, L, d]``, or a dict of
    per-layer ``[n, d]`` tensors with equal n) and yields minibatches of exactly ``batch_size`` rows,
    drawn uniformly at random from the buffer, whenever it holds ``buffer_tokens`` rows. ``flush()``
    yields the remaining full minibatches; fewer than ``batch_size`` leftover rows are dropped and
    counted in ``dropped``. Batches have the same type (tensor or dict) as the input. Deterministic for
    a given ``seed`` and input sequence.
    """

    def __init__(self, buffer_tokens: int, batch_size: int, seed: int = 0) -> None:
        if int(batch_size) < 1:
            raise StatsError(f"batch_size must be >= 1, got {batch_size}")
        if int(buffer_tokens) < int(batch_size):
            raise StatsError(f"buffer_tokens ({buffer_tokens}) must be >= batch_size ({batch_size})")
        self.buffer_tokens = int(buffer_tokens)
        self.batch_size = int(batch_size)
        self._gen = torch.Generator().manual_seed(int(seed))
        self._buf: dict[Any, torch.Tensor] | None = None
        self._is_dict: bool | None = None
        self._count = 0
        self.dropped = 0

    def _as_dict(self, rows: Any) -> dict[Any, torch.Tensor]:
        is_dict = isinstance(rows, Mapping)
        if self._is_dict is None:
            self._is_dict = is_dict
        elif self._is_dict != is_dict:
            raise StatsError("TokenShuffler got a dict after a tensor (or vice versa); keep one input type")
        d = {k: torch.as_tensor(v) for k, v in rows.items()} if is_dict else {None: torch.as_tensor(rows)}
        ns = {int(v.shape[0]) for v in d.values()}
        if len(ns) != 1:
            raise StatsError(f"all per-layer row tensors must have the same number of rows, got {sorted(ns)}")
        if self._buf is not None and set(d) != set(self._buf):
            raise StatsError(f"row keys {sorted(d, key=str)} differ from the first call's {sorted(self._buf, key=str)}")
        return d

    def _emit(self) -> Any:
        m, b = self._count, self.batch_size
        idx = torch.randperm(m, generator=self._gen)[:b]
        out = {k: v[idx].clone() for k, v in self._buf.items()}
        # fill holes below the new end with the unselected rows of the tail
        taken = torch.zeros(m, dtype=torch.bool)
        taken[idx] = True
        new_m = m - b
        holes = idx[idx < new_m]
        tail = torch.arange(new_m, m)[~taken[new_m:]]
        if holes.numel():
            for v in self._buf.values():
                v[holes] = v[tail]
        self._count = new_m
        return out if self._is_dict else out[None]

    def add(self, rows: Any) -> Iterator[Any]:
        """Store ``rows``; yield every minibatch that becomes available (consume the iterator)."""
        d = self._as_dict(rows)
        n = next(iter(d.values())).shape[0]
        if self._buf is None:
            self._buf = {
                k: torch.empty((self.buffer_tokens, *v.shape[1:]), dtype=v.dtype, device=v.device) for k, v in d.items()
            }
        pos = 0
        while pos < n:
            take = min(n - pos, self.buffer_tokens - self._count)
            for k, v in d.items():
                self._buf[k][self._count : self._count + take] = v[pos : pos + take]
            self._count += take
            pos += take
            while self._count >= self.buffer_tokens:
                yield self._emit()

    def flush(self) -> Iterator[Any]:
        """Yield the remaining full minibatches in random order; leftover rows are dropped."""
        while self._buf is not None and self._count >= self.batch_size:
            yield self._emit()
        self.dropped += self._count
        self._count = 0
