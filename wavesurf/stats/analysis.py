"""One pass of capture -> streaming statistics -> per-layer entropy, CKA, compartments, cached.

:func:`analyze` runs the target over a corpus once and accumulates, on the statistics positions
(no padding, no position 0 unless asked, chosen roles, optional token-entropy filter), the float64
moments of every layer id 0..N. From them it derives matrix entropy per layer, purities, the
(N+1)x(N+1) linear CKA matrix (exact full-data CKA when the cross-moment matrix fits the memory
budget, else the unbiased minibatch estimator), and depth compartments. With a filter, the same
statistics of a random subset of the same size are computed in the same pass (the control).

This module is the pass (settings, accumulators, the cache key); the result it returns is a
:class:`~wavesurf.stats.results.LayerStats`, and :mod:`wavesurf.stats.store` keeps it in the
cache under a key of every parameter that changes it.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .._version import __version__
from ..capture import ROLE_FILTERS, check_roles
from ..cache import params_key, verify_directory
from ..errors import StatsError, WavesurfError
from ..settings_cli import max_len_setting, setting, split_seed_setting
from .cka import DEFAULT_MEMORY_BUDGET, MinibatchCKA, TokenShuffler, choose_cka_estimator, linear_cka_from_moments
from .compartments import compartment_stability, compartments
from .entropy import max_entropy, purity, renyi_entropy
from .filtering import FILTER_HELP, FilterError, FilterState, TokenFilter
from .moments import LayerMoments, gather_layer_rows, l2_normalize_rows_, masked_group_ids
from .resampling import DEFAULT_GROUPS, DEFAULT_LEVEL, REPLICATED, GroupAssigner, GroupedLayerMoments, check_groups
from .results import BlockCovariances, LayerStats, SubsetStats
from .store import load_stats, result_dir, save_stats

if TYPE_CHECKING:
    from ..models import Target

ESTIMATORS = ("auto", "exact", "minibatch")
RESULT_FORMAT = 2  # 2: resampling replicates


@dataclass(frozen=True)
class AnalysisSettings:
    """Every parameter that changes the statistics (all of them enter the cache key)."""

    # setting(...) adds the command-line help (wavesurf.settings_cli); the defaults are the fields' own
    dataset: str = setting("sharegpt", help="corpus: a packaged one (`wavesurf datasets`), a .jsonl path, "
                           "or <corpus>@<model> from `wavesurf distill`")
    split: str | None = setting("stats", help="ShareGPT split")
    split_seed: int = split_seed_setting()
    max_tokens: int = setting(100_000, positive=True, help="tokens fed to the model")
    max_len: int = max_len_setting()
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


# ---------------------------------------------------------------------------------------------
def layer_quantities(cov: Any, top: float) -> dict[str, float]:
    """The per-layer quantities of one covariance (float64 torch) from one eigendecomposition:
    matrix entropy at alpha=1 and alpha=2 (nats), entropy normalized by ``top`` (the largest
    possible, :func:`~wavesurf.stats.entropy.max_entropy`), purity and trace. The one place both the
    full-sample statistics and every leave-one-group-out replicate compute them."""
    import torch

    eigs = torch.linalg.eigvalsh(cov).cpu().numpy()  # one decomposition serves both alphas
    entropy = renyi_entropy(eigs, 1.0)
    return {"entropy": entropy, "entropy2": renyi_entropy(eigs, 2.0),
            "normalized_entropy": entropy / top if top > 0 else 0.0, "purity": purity(cov),
            "trace": float(cov.trace())}


def _finalize(name: str, layer_ids: list[int], moments: LayerMoments, cka: np.ndarray, dim: int,
              replicates: dict[str, np.ndarray] | None = None, interval_note: str | None = None) -> SubsetStats:
    top = max_entropy(moments.n, dim)
    per_layer = [layer_quantities(moments.covariance(lid), top) for lid in layer_ids]
    column = {q: np.array([row[q] for row in per_layer]) for q in REPLICATED}
    blocks = [(layer_ids[s], layer_ids[e]) for s, e in compartments(cka)]
    cross = BlockCovariances.from_moments(moments) if moments.pairs else None
    return SubsetStats(name, moments.n, list(layer_ids), column["entropy"], column["entropy2"],
                       column["normalized_entropy"], column["purity"], column["trace"],
                       np.asarray(cka, dtype=np.float64), blocks, cross, replicates, interval_note)


def _per_layer_replicates(grouped: GroupedLayerMoments, dim: int) -> dict[str, np.ndarray]:
    """Per-layer quantities of every leave-one-group-out covariance: ``[G, L]`` each (float64
    spectra: float32 ``eigvalsh`` is only ~1.4x faster and its noise floor on the small eigenvalues
    would add ~1e-4 nats to each replicate's entropy)."""
    G, L = grouped.n_groups, len(grouped.layer_ids)
    out = {q: np.empty((G, L)) for q in REPLICATED}
    sizes = grouped.group_sizes
    for g in range(G):
        top = max_entropy(int(sizes.sum() - sizes[g]), dim)
        for k, lid in enumerate(grouped.layer_ids):
            for q, value in layer_quantities(grouped.covariance(lid, drop_group=g), top).items():
                out[q][g, k] = value
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


def analysis_key(target: Target, settings: AnalysisSettings) -> tuple[str, dict[str, Any]]:

    from ..data import generated_corpus_info

    params = {"format": RESULT_FORMAT, "wavesurf": __version__, "model": target.name, "source": target.source,
              "n_layers": target.n_layers, "hidden_size": target.hidden_size, "dtype": target.dtype,
              **asdict(settings)}
    corpus_info = generated_corpus_info(settings.dataset, settings.split, settings.split_seed)
    if corpus_info is not None:  # <corpus>@<model>: the key follows the generated corpus it resolves to
        params["corpus_info"] = corpus_info
    return params_key(params), params


def analyze(
    target: Target,
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
    TokenFilter.parse(settings.filter, settings.pilot_tokens).check_reachable(target.vocab_size)
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
        kept, control = fstate.masks(candidates(batch), batch.token_entropy, batch.index, batch.roles)
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
        fstate.sum_over_processes(all_reduce_ints)
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


