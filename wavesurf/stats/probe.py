"""A predictive probe for every layer set: how much a set's features tell about what a drafter
must predict, in closed form (ridge regression, no optimizer).

An EAGLE-3 drafter at position t reads the target's streams of its layer set at t plus the
embedding of the next token x_(t+1), and must produce something whose unembedding gives x_(t+2):
the target's own last-layer state at t+1. The probe asks the linear version of that question:

    h_N(t+1)  ~  W [z_l1(t), ..., z_lk(t), e(x_(t+1))] + b

with h_N the output of the last block *before* the final norm (vLLM id N), z_l each stream reduced
to its top principal components and whitened (unit variance per component, so one ridge penalty
treats every stream alike), e(x_(t+1)) the stream of id 0 at t+1 (the target's input embedding of
the next token) reduced the same way. Because every set uses the same reduced features, one
streamed pass accumulates the float64 moments of all of them together (means, the cross products
of every layer's components, the embedding and the target, on training conversations; the same on
held-out conversations); any set's ridge fit and its held-out error are then matrix algebra on
sub-blocks of those moments:

    B_S = (Szz[S,S] + lambda I)^-1 Szy[S]            (training moments, centred, divided by n)
    MSE_j = Hyy_j - 2 B_S[:,j]' Hzy[S,j] + B_S[:,j]' Hzz[S,S] B_S[:,j]   (held-out, around the training means)

and with per-coordinate weights w the summed error is
``sum_j w_j Hyy_j - 2 tr(A^-1 M1[S,S]) + tr(A^-1 Hzz[S,S] A^-1 M2[S,S])``, ``A = Szz[S,S] + lambda I``,
``M1 = Szy W Hzy'``, ``M2 = Szy W Szy'``: no pass over the data per set.

Two held-out scores per set: ``r2`` = the mean over the d target coordinates of each coordinate's
R² (every coordinate counts alike, so the few massive-activation coordinates of a pre-norm state
do not decide it) and ``r2_raw`` = 1 - total squared error / total variance. For a short list of
sets, :func:`top1_agreement` applies the target's own final norm and unembedding to the
prediction and counts how often its top token is the target's own top token at t+1.

Held-out positions are whole conversations (every ``heldout_every``-th by a hash of the
conversation id, independent of batching). The principal components come from the training
positions of the first batches (``pilot_tokens``), so held-out data never shapes the features.

Ridge regression for probing representations: Hewitt & Liang 2019 ("Designing and Interpreting
Probes with Control Tasks") discuss why a probe's power must be read against controls; here the
controls are the other layer sets, all probed alike.

Over ~450 lines because the moments pass, the closed-form fit and its held-out scoring share one
layout of the accumulated blocks; split, each part would re-derive it.
"""
from __future__ import annotations

import json
import math
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._version import __version__
from ..cache import atomic_directory, entry_dir, params_key, verify_directory, write_manifest, write_rows_csv
from ..errors import StatsError, is_int

if TYPE_CHECKING:
    from ..models import Target

PROBE_FORMAT = 2  # 2: entries named <kind>.npz
#: Sets solved together in one batched linear-algebra call while scoring.
SCORE_CHUNK = 128
#: The ridge penalty lambda by default (on whitened, unit-variance features).
DEFAULT_RIDGE = 1e-2


@dataclass(frozen=True)
class ProbeSettings:
    """Everything that changes the probe's moments (all of it enters the cache key)."""

    dataset: str = "sharegpt"
    split: str | None = "stats"
    split_seed: int = 0
    max_tokens: int = 20_000
    max_len: int = 512
    batch_tokens: int = 4096
    roles: str = "all"  # positions t that count: "all" or "assistant" tokens
    dims: int = 32  # principal components kept (whitened) per layer stream
    embedding_dims: int = 128  # principal components kept of the next token's embedding
    pilot_tokens: int = 4096  # training positions the principal components are computed from
    heldout_every: int = 5  # every 5th conversation (by a hash of its id) is held out
    top1_positions: int = 1024  # held-out positions kept for top-1 agreement (the first ones seen)

    def check(self, hidden_size: int | None = None) -> None:
        from ..capture import check_roles

        check_roles(self.roles)
        top = hidden_size if hidden_size is not None else None
        for name in ("dims", "embedding_dims"):
            v = getattr(self, name)
            if not is_int(v, 1, top):
                raise StatsError(f"{name}={v!r} is out of range: allowed are 1..{top if top else 'd'} "
                                 "(principal components of a d-dimensional stream)")
        if not is_int(self.pilot_tokens, 2):
            raise StatsError(f"pilot_tokens={self.pilot_tokens!r} must be an integer >= 2")
        if not is_int(self.heldout_every, 2):
            raise StatsError(f"heldout_every={self.heldout_every!r} must be an integer >= 2 "
                             "(1 in heldout_every conversations is held out)")
        if not is_int(self.top1_positions, 0):
            raise StatsError(f"top1_positions={self.top1_positions!r} must be an integer >= 0")
        if not is_int(self.max_tokens, 1):
            raise StatsError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")


def check_ridge(ridge: Any) -> float:
    """The ridge penalty lambda: a finite number > 0 (relative to unit-variance features)."""
    if isinstance(ridge, bool) or not isinstance(ridge, int | float | np.floating) or not math.isfinite(ridge) or ridge <= 0:
        raise StatsError(f"ridge={ridge!r} must be a finite number > 0 (the penalty on whitened, unit-variance features)")
    return float(ridge)


def check_probe_k(k: Any, n_layers: int) -> int:
    if not is_int(k, 1, n_layers + 1):
        raise StatsError(f"k={k!r} is out of range: allowed are 1..{n_layers + 1} (N+1 layer ids for this model)")
    return int(k)


def is_heldout(example_id: str, every: int) -> bool:
    """Whether an example's conversation is held out (a stable hash of the conversation id)."""
    from .resampling import conversation_key

    return zlib.crc32(conversation_key(example_id).encode()) % every == 0


# ---------------------------------------------------------------------------------------------
def _top_eigen(cov: Any, r: int, iters: int = 10, oversample: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """The ``r`` largest eigenpairs of a symmetric PSD float64 torch matrix, descending, by seeded
    randomized subspace iteration (Halko, Martinsson & Tropp 2011, "Finding structure with
    randomness", Alg. 4.4) and a Rayleigh-Ritz step: a few matrix products instead of a full
    eigendecomposition (which costs ~10x more on a shared 2-core machine). Exact when
    ``r + oversample >= d``."""
    import torch

    d = cov.shape[0]
    q = min(d, r + oversample)
    if q == d:
        eig, vec = torch.linalg.eigh(cov)
    else:
        gen = torch.Generator().manual_seed(0)
        basis = torch.linalg.qr(cov @ torch.randn(d, q, generator=gen, dtype=cov.dtype)).Q
        for _ in range(iters):
            basis = torch.linalg.qr(cov @ basis).Q
        eig, u = torch.linalg.eigh(basis.T @ cov @ basis)
        vec = basis @ u
    return eig.flip(0)[:r].numpy(), vec.flip(1)[:, :r].numpy()


@dataclass
class Basis:
    """Whitened principal components of one stream: ``z = (x - mean) @ proj``, ``proj = V / sqrt(eig)``."""

    mean: np.ndarray  # [d]
    proj: np.ndarray  # [d, r]
    variance: np.ndarray  # [r] eigenvalues kept
    total_variance: float  # trace of the covariance

    @classmethod
    def fit(cls, rows: np.ndarray, r: int) -> Basis:
        x = np.asarray(rows, dtype=np.float64)
        if x.shape[0] <= r:
            raise StatsError(f"{x.shape[0]} pilot positions cannot give {r} principal components; raise "
                             "pilot_tokens / max_tokens or lower dims / embedding_dims")
        import torch

        mean = x.mean(axis=0)
        xc = torch.from_numpy(x - mean)
        cov = xc.T @ xc / (len(x) - 1)
        eig, vec = _top_eigen(cov, r)
        floor = max(float(eig[0]), 1e-300) * 1e-10  # a direction with no variance is not scaled up
        return cls(mean, vec / np.sqrt(np.maximum(eig, floor)), eig, float(torch.trace(cov)))


@dataclass
class ProbeMoments:
    """Float64 sums over training and held-out positions of the reduced features ``z`` (layer
    streams at t in id order 0..N, then the embedding of x_(t+1)) and the target ``y`` = h_N(t+1)
    (shifted by its pilot mean). ``sample_*``: the first held-out rows, for top-1 agreement."""

    n_layers: int
    dims: int
    embedding_dims: int
    hidden_size: int
    n: np.ndarray = field(default=None)  # [2] positions (train, held-out)
    sz: np.ndarray = field(default=None)  # [2, P]
    sy: np.ndarray = field(default=None)  # [2, d]
    zz: np.ndarray = field(default=None)  # [2, P, P]
    zy: np.ndarray = field(default=None)  # [2, P, d]
    yy: np.ndarray = field(default=None)  # [2, d] per-coordinate sums of squares
    y_shift: np.ndarray = field(default=None)  # [d] added back to predictions
    sample_z: np.ndarray = field(default=None)  # [m, P] float32
    sample_y: np.ndarray = field(default=None)  # [m, d] float32 (shifted)
    key: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        P, d = self.n_features, self.hidden_size
        if self.n is None:
            self.n = np.zeros(2)
            self.sz, self.sy = np.zeros((2, P)), np.zeros((2, d))
            self.zz, self.zy, self.yy = np.zeros((2, P, P)), np.zeros((2, P, d)), np.zeros((2, d))
            self.y_shift = np.zeros(d)
            self.sample_z, self.sample_y = np.zeros((0, P), np.float32), np.zeros((0, d), np.float32)

    @property
    def n_features(self) -> int:
        return (self.n_layers + 1) * self.dims + self.embedding_dims

    def columns(self, layer_ids: Sequence[int]) -> np.ndarray:
        """Feature columns of a layer set: its streams' components, then the embedding's."""
        r = self.dims
        cols = [np.arange(i * r, (i + 1) * r) for i in layer_ids]
        cols.append(np.arange((self.n_layers + 1) * r, self.n_features))
        return np.concatenate(cols)

    def add(self, z: np.ndarray, y: np.ndarray, heldout: np.ndarray, sample_cap: int = 0) -> None:
        """Accumulate rows ``z`` [n, P], ``y`` [n, d] (float64), split by the bool ``heldout`` [n]."""
        for part, rows in ((0, ~heldout), (1, heldout)):
            if not rows.any():
                continue
            zr, yr = z[rows], y[rows]
            self.n[part] += len(zr)
            self.sz[part] += zr.sum(axis=0)
            self.sy[part] += yr.sum(axis=0)
            self.zz[part] += zr.T @ zr
            self.zy[part] += zr.T @ yr
            self.yy[part] += (yr * yr).sum(axis=0)
        room = sample_cap - len(self.sample_z)
        if room > 0 and heldout.any():
            self.sample_z = np.concatenate([self.sample_z, z[heldout][:room].astype(np.float32)])
            self.sample_y = np.concatenate([self.sample_y, y[heldout][:room].astype(np.float32)])

    # -------------------------------------------------------------- the fitted quantities
    def _centred(self) -> dict[str, np.ndarray]:
        """Training moments centred and divided by n; held-out ones around the training means."""
        if self.n[0] < 2 or self.n[1] < 2:
            raise StatsError(f"the probe needs training and held-out positions, got {int(self.n[0])} and "
                             f"{int(self.n[1])}; raise max_tokens or lower heldout_every")
        n, m = self.n
        mz, my = self.sz[0] / n, self.sy[0] / n
        szz = self.zz[0] / n - np.outer(mz, mz)
        szy = self.zy[0] / n - np.outer(mz, my)
        hz, hy = self.sz[1] / m, self.sy[1] / m  # held-out means
        hzz = self.zz[1] / m - np.outer(hz, mz) - np.outer(mz, hz) + np.outer(mz, mz)
        hzy = self.zy[1] / m - np.outer(hz, my) - np.outer(mz, hy) + np.outer(mz, my)
        hyy = self.yy[1] / m - 2 * hy * my + my * my
        var_h = self.yy[1] / m - hy * hy  # held-out variance per coordinate (around its own mean)
        return {"mz": mz, "my": my, "szz": szz, "szy": szy, "hzz": hzz, "hzy": hzy, "hyy": hyy, "var_h": var_h}

    def weights(self, var_h: np.ndarray) -> dict[str, np.ndarray]:
        """Per-coordinate weights of the two scores: 1 - sum_j w_j MSE_j with w normalising by variance."""
        ok = var_h > 1e-12 * var_h.max()
        per = np.where(ok, 1.0 / np.where(ok, var_h, 1.0), 0.0) / max(int(ok.sum()), 1)
        return {"r2": per, "r2_raw": np.full_like(var_h, 1.0 / var_h.sum())}

    def fit(self, layer_ids: Sequence[int], ridge: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ridge coefficients of one set: ``(columns, B [p, d], intercept [d])`` with prediction
        ``y = z[:, columns] @ B + intercept`` (in the unshifted target space)."""
        c = self._centred()
        cols = self.columns(layer_ids)
        A = c["szz"][np.ix_(cols, cols)] + check_ridge(ridge) * np.eye(len(cols))
        B = np.linalg.solve(A, c["szy"][cols])
        return cols, B, c["my"] - c["mz"][cols] @ B + self.y_shift


def _eliminated(moments: ProbeMoments, lam: float) -> dict[str, np.ndarray]:
    """The embedding block solved out once (it is in every set): with ``A = Szz + lambda I``,
    ``G = A[E,E]^-1``, ``K = G A[E,X]`` and ``Q = G Szy[E]`` the stream part of any set S solves
    ``(A[X,X] - A[X,E] K)[S,S] B_S = (Szy[X] - A[X,E] Q)[S]`` and its held-out error is that of the
    residuals ``Y - Z_E Q`` on ``Z_X - Z_E K`` (block elimination of the normal equations; exact)."""
    c = moments._centred()
    nx = (moments.n_layers + 1) * moments.dims
    X, E = slice(0, nx), slice(nx, moments.n_features)
    A = c["szz"] + lam * np.eye(moments.n_features)
    K = np.linalg.solve(A[E, E], A[E, X])
    Q = np.linalg.solve(A[E, E], c["szy"][E])
    hzz, hzy = c["hzz"], c["hzy"]
    HK = hzz[X, E] @ K
    return {
        "a": A[X, X] - A[X, E] @ K,
        "c": c["szy"][X] - A[X, E] @ Q,
        "hzz": hzz[X, X] - HK - HK.T + K.T @ hzz[E, E] @ K,
        "hzy": hzy[X] - hzz[X, E] @ Q - K.T @ hzy[E] + K.T @ hzz[E, E] @ Q,
        "hyy": c["hyy"] - 2 * np.einsum("ej,ej->j", Q, hzy[E]) + np.einsum("ej,ej->j", Q, hzz[E, E] @ Q),
        "var_h": c["var_h"],
    }


def score_layer_sets(moments: ProbeMoments, layer_sets: Any, ridge: float, progress: bool = False) -> dict[str, np.ndarray]:
    """Held-out ``r2`` (mean per-coordinate R²) and ``r2_raw`` (total-variance R²) of the ridge
    probe of each layer set (rows of ``[m, k]`` ids), from the moments alone (module docstring):
    per set, linear algebra of size k * dims only (:func:`_eliminated`)."""
    from ..progress import progress_bar

    lam = check_ridge(ridge)
    sets = np.asarray(layer_sets, dtype=np.int64)
    if sets.ndim == 1:
        sets = sets[None, :]
    if sets.size and (sets.min() < 0 or sets.max() > moments.n_layers):
        raise StatsError(f"layer ids must lie in 0..{moments.n_layers}, got {sets.min()}..{sets.max()}")
    el = _eliminated(moments, lam)
    w = moments.weights(el["var_h"])
    M1 = {s: (el["c"] * wj) @ el["hzy"].T for s, wj in w.items()}
    M2 = {s: (el["c"] * wj) @ el["c"].T for s, wj in w.items()}
    base = {s: float(wj @ el["hyy"]) for s, wj in w.items()}
    out = {s: np.empty(len(sets)) for s in w}
    r = moments.dims
    bar = progress_bar(total=len(sets), desc="probe layer sets", unit="set", disable=not progress, smoothing=0.1)
    for start in range(0, len(sets), SCORE_CHUNK):
        chunk = sets[start : start + SCORE_CHUNK]
        cols = (chunk[:, :, None] * r + np.arange(r)).reshape(len(chunk), -1)  # [b, k * dims]
        ix = (cols[:, :, None], cols[:, None, :])
        Ainv = np.linalg.inv(el["a"][ix])
        T = Ainv @ el["hzz"][ix] @ Ainv
        for s in w:  # tr(A^-1 M1) and tr(A^-1 Hzz A^-1 M2), all matrices symmetric but M1
            mse = base[s] - 2 * (Ainv * M1[s][ix].transpose(0, 2, 1)).sum(axis=(1, 2)) + (T * M2[s][ix]).sum(axis=(1, 2))
            out[s][start : start + len(chunk)] = 1.0 - mse
        bar.update(len(chunk))
    bar.close()
    return out


def top1_agreement(target: Target, moments: ProbeMoments, layer_sets: Iterable[Sequence[int]], ridge: float) -> dict[tuple[int, ...], float]:
    """For each set, the share of the kept held-out positions where the target's own final norm
    and unembedding put the same top token on the probe's prediction of h_N(t+1) as on h_N(t+1)
    itself (the target's prediction of x_(t+2))."""
    import torch

    from ..taps import decoder_blocks

    if len(moments.sample_z) == 0:
        raise StatsError("no held-out positions were kept for top-1 agreement (top1_positions=0)")
    model = target.model
    norm, head = decoder_blocks(model).norm, model.get_output_embeddings()

    def top1(states: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            x = torch.from_numpy(np.ascontiguousarray(states, dtype=np.float32)).to(head.weight.device, head.weight.dtype)
            return head(norm(x)).argmax(dim=-1).cpu().numpy()

    z = moments.sample_z.astype(np.float64)
    truth = top1(moments.sample_y.astype(np.float64) + moments.y_shift)
    out = {}
    for ids in layer_sets:
        cols, B, b0 = moments.fit(list(ids), ridge)
        out[tuple(int(i) for i in ids)] = float(np.mean(top1(z[:, cols] @ B + b0) == truth))
    return out


# ---------------------------------------------------------------------------------------------
class ProbeAccumulator:
    """Feeds :class:`ProbeMoments` from captured batches (every layer id 0..N): holds the first
    batches until ``pilot_tokens`` training positions fix the principal components, then reduces
    and accumulates every batch."""

    def __init__(self, n_layers: int, hidden_size: int, settings: ProbeSettings):
        settings.check(hidden_size)
        self.settings, self.n_layers, self.d = settings, n_layers, hidden_size
        self.moments = ProbeMoments(n_layers, settings.dims, settings.embedding_dims, hidden_size)
        self.bases: list[Basis] | None = None
        self.pilot: list[Any] = []
        self.pilot_count = 0

    def _pairs(self, batch: Any) -> tuple[Any, Any, np.ndarray]:
        """Positions t that count (statistics mask at t, a real token at t+1): ``(rows, cols, heldout)``."""
        import torch

        mask = batch.stat_mask(self.settings.roles)[:, :-1] & batch.attention_mask[:, 1:]
        b, t = torch.nonzero(mask, as_tuple=True)
        held = np.array([is_heldout(e, self.settings.heldout_every) for e in batch.example_ids], dtype=bool)
        return b, t, held[b.cpu().numpy()]

    def _fit_bases(self) -> None:
        L, s = self.n_layers + 1, self.settings
        rows: list[list[np.ndarray]] = [[] for _ in range(L + 2)]  # streams 0..N at t, embedding and target at t+1
        for batch in self.pilot:
            b, t, held = self._pairs(batch)
            keep = ~held
            for i in range(L):
                rows[i].append(batch.layer(i)[b, t].double().cpu().numpy()[keep])
            rows[L].append(batch.layer(0)[b, t + 1].double().cpu().numpy()[keep])
            rows[L + 1].append(batch.layer(self.n_layers)[b, t + 1].double().cpu().numpy()[keep])
        data = [np.concatenate(r) for r in rows]
        self.bases = [Basis.fit(data[i], s.dims) for i in range(L)] + [Basis.fit(data[L], s.embedding_dims)]
        self.moments.y_shift = data[L + 1].mean(axis=0)

    def _consume(self, batch: Any) -> None:
        import torch

        b, t, held = self._pairs(batch)
        if len(held) == 0:
            return
        parts = []
        for i, basis in enumerate(self.bases[:-1]):
            x = batch.layer(i)[b, t].double().cpu()
            parts.append(((x - torch.from_numpy(basis.mean)) @ torch.from_numpy(basis.proj)))
        e = batch.layer(0)[b, t + 1].double().cpu()
        parts.append((e - torch.from_numpy(self.bases[-1].mean)) @ torch.from_numpy(self.bases[-1].proj))
        z = torch.cat(parts, dim=1).numpy()
        y = batch.layer(self.n_layers)[b, t + 1].double().cpu().numpy() - self.moments.y_shift
        self.moments.add(z, y, held, self.settings.top1_positions)

    def update(self, batch: Any) -> None:
        if self.bases is None:
            self.pilot.append(batch)
            _, _, held = self._pairs(batch)
            self.pilot_count += int((~held).sum())
            if self.pilot_count < self.settings.pilot_tokens:
                return
            self.finish_pilot()
            return
        self._consume(batch)

    def finish_pilot(self) -> None:
        if self.bases is None:
            self._fit_bases()
            pilot, self.pilot = self.pilot, []
            for batch in pilot:
                self._consume(batch)

    def result(self) -> ProbeMoments:
        self.finish_pilot()
        self.moments.meta["explained_variance"] = [float(b.variance.sum() / b.total_variance) for b in self.bases]
        return self.moments


# ---------------------------------------------------------------------------------------------
def moments_key(target: Target, settings: ProbeSettings) -> tuple[str, dict[str, Any]]:
    from ..data import generated_corpus_info

    params = {"format": PROBE_FORMAT, "wavesurf": __version__, "model": target.name, "source": target.source,
              "n_layers": target.n_layers, "hidden_size": target.hidden_size, "dtype": target.dtype, **asdict(settings)}
    info = generated_corpus_info(settings.dataset, settings.split, settings.split_seed)
    if info is not None:
        params["corpus_info"] = info
    return params_key(params), params


_MOMENT_ARRAYS = ("n", "sz", "sy", "zz", "zy", "yy", "y_shift", "sample_z", "sample_y")


def _write_entry(out: Path, kind: str, key: str, arrays: dict[str, np.ndarray], meta: dict[str, Any],
                 rows: list[dict[str, Any]] | None = None) -> None:
    """One cache entry, atomically: ``<kind>.npz``, ``meta.json``, optional tidy ``<kind>.csv``, manifest."""
    with atomic_directory(out, overwrite=True) as tmp:
        np.savez(tmp / f"{kind}.npz", **arrays)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        if rows is not None:
            write_rows_csv(tmp / f"{kind}.csv", rows)
        write_manifest(tmp, {"kind": kind, "key": key}, hash_files=False)


def _read_entry(path: Path, kind: str) -> tuple[dict[str, Any], Any]:
    problem = verify_directory(path)
    if problem is not None:
        raise StatsError(f"{kind} entry {path} is damaged ({problem}); delete the directory to recompute")
    return json.loads((Path(path) / "meta.json").read_text()), np.load(Path(path) / f"{kind}.npz")


def save_moments(moments: ProbeMoments, out: Path) -> None:
    meta = {**moments.meta, "n_layers": moments.n_layers, "dims": moments.dims,
            "embedding_dims": moments.embedding_dims, "hidden_size": moments.hidden_size, "key": moments.key}
    _write_entry(out, "probe-moments", moments.key, {a: getattr(moments, a) for a in _MOMENT_ARRAYS}, meta)


def load_moments(path: Path) -> ProbeMoments:
    meta, data = _read_entry(path, "probe-moments")
    return ProbeMoments(int(meta["n_layers"]), int(meta["dims"]), int(meta["embedding_dims"]), int(meta["hidden_size"]),
                        **{a: data[a] for a in _MOMENT_ARRAYS}, key=meta["key"], meta=meta)


def probe_moments(target: Target, settings: ProbeSettings | None = None, *, use_cache: bool = True,
                  progress: bool = True, **overrides: Any) -> ProbeMoments:
    """The probe's moments of ``target`` on a corpus: one capture pass (every layer), cached by
    every setting; nothing is written until the pass completes."""
    from ..capture import capture
    from ..data import load_corpus

    settings = replace(settings or ProbeSettings(), **overrides)
    settings.check(target.hidden_size)
    key, params = moments_key(target, settings)
    out = entry_dir("results/probe-moments", target.name, key)
    if use_cache and out.exists() and verify_directory(out) is None:
        return load_moments(out)
    t0 = time.perf_counter()
    corpus = load_corpus(settings.dataset, split=settings.split, seed=settings.split_seed)
    acc = ProbeAccumulator(target.n_layers, target.hidden_size, settings)
    for batch in capture(target, corpus, settings.max_tokens, max_len=settings.max_len,
                         batch_tokens=settings.batch_tokens, progress=progress):
        acc.update(batch)
    moments = acc.result()
    moments.key = key
    moments.meta.update(params=params, seconds=round(time.perf_counter() - t0, 1),
                        positions={"train": int(moments.n[0]), "heldout": int(moments.n[1])})
    if use_cache:
        save_moments(moments, out)
    return moments


# ---------------------------------------------------------------------------------------------
@dataclass
class ProbeResult:
    """Held-out probe scores of many k-sets of one target (ids in the vLLM convention)."""

    key: str
    n_layers: int
    k: int
    ridge: float
    layer_sets: np.ndarray  # [m, k] sorted ids
    r2: np.ndarray  # [m] mean per-coordinate held-out R²
    r2_raw: np.ndarray  # [m] total-variance held-out R²
    over: str  # "all" or "sampled"
    top1: dict[tuple[int, ...], float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def _row(self, layer_ids: Sequence[int]) -> int:
        ids = tuple(sorted(int(i) for i in layer_ids))
        hit = np.flatnonzero((self.layer_sets == np.array(ids)).all(axis=1)) if len(ids) == self.k else []
        if len(hit) == 0:
            raise StatsError(f"layer set {list(ids)} was not probed ({len(self.layer_sets):,} {self.over} {self.k}-sets)")
        return int(hit[0])

    def score(self, layer_ids: Sequence[int]) -> float:
        return float(self.r2[self._row(layer_ids)])

    def rank(self, layer_ids: Sequence[int]) -> int:
        """1-based rank of a set by ``r2`` among the probed sets (1 = best)."""
        return int((self.r2 > self.r2[self._row(layer_ids)]).sum()) + 1

    def best(self, n: int = 1) -> list[list[int]]:
        return [[int(i) for i in self.layer_sets[j]] for j in np.argsort(-self.r2, kind="stable")[:n]]

    def rows(self) -> list[dict[str, Any]]:
        order = np.argsort(-self.r2, kind="stable")
        return [{"rank": r + 1, "layer_ids": [int(i) for i in self.layer_sets[j]], "r2": float(self.r2[j]),
                 "r2_raw": float(self.r2_raw[j]),
                 "top1_agreement": self.top1.get(tuple(int(i) for i in self.layer_sets[j]), "")}
                for r, j in enumerate(order)]


def probe_sets(n_layers: int, k: int, max_sets: int = 10_000, sample: int = 1000, include: Iterable[Sequence[int]] = (),
               seed: int = 0) -> tuple[np.ndarray, str]:
    """The k-sets of ids 0..N to probe: all of them when there are at most ``max_sets``, else a
    seeded sample of ``sample`` (>= 500) plus ``include``; ``(sets, "all" | "sampled")``."""
    from .layer_sets import all_subsets

    k = check_probe_k(k, n_layers)
    extra = [sorted(int(i) for i in s) for s in include]
    for s in extra:
        if len(s) != k or len(set(s)) != k or min(s) < 0 or max(s) > n_layers:
            raise StatsError(f"include set {s} must be {k} different ids in 0..{n_layers}")
    if math.comb(n_layers + 1, k) <= max_sets:
        return all_subsets(range(n_layers + 1), k), "all"
    if not is_int(sample, 500):
        raise StatsError(f"sample={sample!r} must be an integer >= 500 (sets probed when not all fit)")
    rng = np.random.default_rng(seed)
    rows: set[tuple[int, ...]] = {tuple(s) for s in extra}
    drawn: set[tuple[int, ...]] = set()
    while len(drawn) < sample:  # distinct sets, in the order drawn
        drawn.add(tuple(sorted(int(i) for i in rng.choice(n_layers + 1, size=k, replace=False))))
    return np.array(sorted(rows | drawn), dtype=np.int64).reshape(-1, k), "sampled"


def probe_layer_sets(target: Target, k: int = 3, settings: ProbeSettings | None = None, *, ridge: float = DEFAULT_RIDGE,
                     max_sets: int = 10_000, sample: int = 1000, include: Iterable[Sequence[int]] = (),
                     top1_sets: Iterable[Sequence[int]] = (), seed: int = 0, use_cache: bool = True,
                     progress: bool = True, **overrides: Any) -> ProbeResult:
    """Probe every k-set of ids 0..N of ``target`` (or a seeded sample, :func:`probe_sets`) and
    score each on held-out conversations; top-1 agreement for ``top1_sets`` (always probed too).
    Moments and scores are cached separately (a new ``ridge`` or ``k`` reuses the capture)."""
    lam = check_ridge(ridge)
    k = check_probe_k(k, target.n_layers)
    settings = replace(settings or ProbeSettings(), **overrides)
    settings.check(target.hidden_size)
    top1_list = [sorted(int(i) for i in s) for s in top1_sets]
    sets, over = probe_sets(target.n_layers, k, max_sets, sample, [*include, *top1_list], seed)
    mkey, _ = moments_key(target, settings)
    params = {"moments": mkey, "k": k, "ridge": lam, "max_sets": max_sets, "sample": sample, "seed": seed,
              "sets": params_key({"sets": sets.tolist()}), "top1": top1_list}
    key = params_key(params)
    out = entry_dir("results/probe", target.name, key)
    if use_cache and out.exists() and verify_directory(out) is None:
        return load_result(out)
    moments = probe_moments(target, settings, use_cache=use_cache, progress=progress)
    t0 = time.perf_counter()
    scores = score_layer_sets(moments, sets, lam, progress=progress)
    top1 = top1_agreement(target, moments, top1_list, lam) if top1_list else {}
    meta = {"params": params, "settings": asdict(settings), "score_seconds": round(time.perf_counter() - t0, 1),
            "moments_seconds": moments.meta.get("seconds"), "positions": moments.meta.get("positions"),
            "top1_positions": int(len(moments.sample_z)), "model": target.name,
            "explained_variance": moments.meta.get("explained_variance")}
    result = ProbeResult(key, target.n_layers, k, lam, sets, scores["r2"], scores["r2_raw"], over, top1, meta)
    if use_cache:
        save_result(result, out)
    return result


def save_result(result: ProbeResult, out: Path) -> None:
    meta = {**result.meta, "key": result.key, "n_layers": result.n_layers, "k": result.k, "ridge": result.ridge,
            "over": result.over, "top1": [[list(s), v] for s, v in result.top1.items()]}
    _write_entry(out, "probe", result.key, {"layer_sets": result.layer_sets, "r2": result.r2, "r2_raw": result.r2_raw},
                 meta, result.rows())


def load_result(path: Path) -> ProbeResult:
    meta, data = _read_entry(path, "probe")
    top1 = {tuple(s): float(v) for s, v in meta.pop("top1")}
    return ProbeResult(meta["key"], int(meta["n_layers"]), int(meta["k"]), float(meta["ridge"]), data["layer_sets"],
                       data["r2"], data["r2_raw"], meta["over"], top1, meta)
