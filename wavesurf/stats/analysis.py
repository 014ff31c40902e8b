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
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..capture import check_roles
from ..cache import atomic_directory, entry_dir, params_key, verify_directory, write_manifest, write_rows_csv
from ..errors import WavesurfError
from .cka import DEFAULT_MEMORY_BUDGET, MinibatchCKA, TokenShuffler, choose_cka_estimator, cka_to_last, linear_cka_from_moments, neighbour_cka
from .compartments import compartment_stability, compartments
from .entropy import aggregate_entropy as _aggregate_entropy
from .entropy import effective_rank, max_entropy, purity, redundancy as _redundancy, renyi_entropy
from .filtering import FilterError, FilterState, TokenFilter
from .moments import LayerMoments, gather_layer_rows, l2_normalize_rows_

ESTIMATORS = ("auto", "exact", "minibatch")
RESULT_FORMAT = 1


@dataclass(frozen=True)
class AnalysisSettings:
    """Every parameter that changes the statistics (all of them enter the cache key)."""

    dataset: str = "sharegpt"
    split: str | None = "stats"
    split_seed: int = 0
    max_tokens: int = 100_000
    max_len: int = 512
    batch_tokens: int = 4096
    roles: str = "all"  # "all" tokens or "assistant" tokens only
    filter: str = "none"  # token-entropy filter, see TokenFilter.parse
    pilot_tokens: int = 8192  # positions that fix a quantile threshold
    include_position0: bool = False  # keep position 0 (BOS / attention sink) in the statistics
    l2_normalize: bool = False  # unit-norm rows per layer before accumulation (cosine variant)
    estimator: str = "auto"  # CKA: "exact" full-data, "minibatch" unbiased, "auto" by memory budget
    memory_budget_gb: float = DEFAULT_MEMORY_BUDGET / 2**30
    minibatch_size: int = 512
    seed: int = 0  # random control subset and minibatch shuffling
    min_tokens: int | None = None  # kept positions the statistics need; default d + 1

    def check(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise WavesurfError(f"estimator={self.estimator!r} is not one of {', '.join(ESTIMATORS)}")
        check_roles(self.roles)
        if self.minibatch_size < 4:
            raise WavesurfError(f"minibatch_size={self.minibatch_size} must be >= 4 (unbiased HSIC needs n >= 4)")
        if self.memory_budget_gb <= 0:
            raise WavesurfError(f"memory_budget_gb={self.memory_budget_gb} must be > 0")
        TokenFilter.parse(self.filter)


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

    def layer_rows(self) -> list[dict[str, Any]]:
        """Tidy per-layer rows (one per subset and layer id) as written to ``layers.csv``."""
        rows = []
        for sub in [self.main] + ([self.control] if self.control else []):
            block_of = {lid: b for b, (s, e) in enumerate(sub.compartments) for lid in range(s, e + 1)}
            nxt, last = neighbour_cka(sub.cka), cka_to_last(sub.cka)
            for k, lid in enumerate(sub.layer_ids):
                rows.append({
                    "model": self.meta["model"], "subset": sub.name, "filter": self.meta["filter"]["filter"],
                    "layer_id": lid, "sglang_layer_id": lid - 1 if lid > 0 else "",
                    "relative_depth": round(lid / self.n_layers, 4), "tokens": sub.n_tokens,
                    "entropy_nats": sub.entropy[k], "entropy2_nats": sub.entropy2[k],
                    "normalized_entropy": sub.normalized_entropy[k], "effective_rank": float(sub.effective_rank[k]),
                    "purity": sub.purity[k], "trace": sub.trace[k],
                    "cka_next": nxt[k] if k < len(nxt) else "", "cka_to_last": last[k],
                    "compartment": block_of.get(lid, ""),
                })
        return rows

    def cka_rows(self) -> list[dict[str, Any]]:
        rows = []
        for sub in [self.main] + ([self.control] if self.control else []):
            for a, la in enumerate(sub.layer_ids):
                for b, lb in enumerate(sub.layer_ids):
                    rows.append({"subset": sub.name, "layer_i": la, "layer_j": lb, "cka": sub.cka[a, b]})
        return rows


# ---------------------------------------------------------------------------------------------
def _finalize(name: str, layer_ids: list[int], moments: LayerMoments, cka: np.ndarray, dim: int) -> SubsetStats:
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
                       np.array(tr), np.asarray(cka, dtype=np.float64), blocks, cross)


class _Accumulator:
    """Moments (+ minibatch CKA) of one token subset."""

    def __init__(self, name: str, layer_ids: list[int], dim: int, exact: bool, settings: AnalysisSettings, meta: dict):
        import torch

        self.name, self.layer_ids, self.dim, self.exact = name, layer_ids, dim, exact
        self.moments = LayerMoments(layer_ids, dim, pairs=exact, l2_normalize=settings.l2_normalize,
                                    meta={**meta, "subset": name})
        self.mb = None if exact else MinibatchCKA(layer_ids, meta={**meta, "subset": name}, gram_dtype=torch.float32)
        self.shuffler = None if exact else TokenShuffler(8 * settings.minibatch_size, settings.minibatch_size,
                                                         seed=settings.seed + (0 if name != "random" else 7))
        self.l2 = settings.l2_normalize

    def update(self, hidden: dict[int, Any], mask: Any) -> None:
        if mask is None or not bool(mask.any()):
            return
        self.moments.update(hidden, mask)
        if self.mb is not None:
            rows = gather_layer_rows(hidden, self.layer_ids, mask)
            if self.l2:
                rows = [l2_normalize_rows_(r) for r in rows]  # r is a fresh copy (masked rows)
            for minibatch in self.shuffler.add({lid: r for lid, r in zip(self.layer_ids, rows)}):
                self.mb.update(minibatch)

    def finish(self) -> None:
        """Flush the last minibatches and sum the accumulators over all processes (if several)."""
        if self.mb is not None:
            for minibatch in self.shuffler.flush():
                self.mb.update(minibatch)
            self.mb.all_reduce_()
        self.moments.all_reduce_()

    def result(self) -> SubsetStats:
        if self.mb is not None:
            if self.mb.n_batches == 0:
                raise FilterError(f"{self.name}: too few tokens ({self.moments.n}) for one CKA minibatch of "
                                  f"{self.shuffler.batch_size}; lower minibatch_size or raise max_tokens")
            cka = self.mb.result()
        else:
            cka = linear_cka_from_moments(self.moments)
        return _finalize(self.name, self.layer_ids, self.moments, cka, self.dim)


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
    shard = shard if shard is not None else Shard()
    batches = capture(target, corpus, settings.max_tokens, max_len=settings.max_len,
                      batch_tokens=settings.batch_tokens, progress=progress, shard=shard)
    stats = analyze_batches(batches, target.n_layers, target.hidden_size, settings, key=key, params=params,
                            shard=shard)
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
) -> LayerStats:
    """The statistics of :func:`analyze` from any iterable of :class:`~wavesurf.capture.CaptureBatch`
    carrying every layer id 0..``n_layers`` (one pass; nothing cached). With a ``shard``, only the
    batches it owns are accumulated (the others are pilot batches of a quantile filter) and the
    accumulators are summed over all processes at the end."""
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
        subsets[0].update(batch.hidden, kept)
        if control is not None:
            subsets[1].update(batch.hidden, control)

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
            "tokens": {s.name: s.n_tokens for s in results}}
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
        np.savez(tmp / "stats.npz", **arrays)
        meta = {**stats.meta, "subsets": {s.name: s.n_tokens for s in subs}}
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
        subs.append(SubsetStats(name, int(n), ids, *(data[f"{name}.{a}"] for a in _ARRAYS[:-1]),
                                cka=data[f"{name}.cka"],
                                compartments=[tuple(map(int, r)) for r in data[f"{name}.compartments"]], cross=cross))
    return LayerStats(meta["key"], meta, subs[0], subs[1] if len(subs) > 1 else None, path)
