"""Exact offline acceptance length: how many tokens per target forward greedy *chain* decoding
with a head would commit on the target's own continuations, computed without running the target.

Why it is exact. At temperature 0 a chain cycle rooted at position ``m`` (the target has processed
``x_0..x_{m-1}`` and produced ``x_m``) drafts ``d_1..d_D`` and accepts the longest prefix equal to
the target's greedy tokens; the drafts after the first wrong one never matter. While every earlier
draft was right, draft step ``j`` reads exactly what training-time test feeds it under teacher
forcing (the fused target features of positions ``<= m-1``, the embeddings of the true tokens and
its own earlier outputs), so one teacher-forced unroll of the head over a stored continuation gives,
for every root position at once, the number of leading correct steps. Walking the cycles over those
numbers (commit ``a + 1`` tokens, jump ``a + 1`` positions, stop at the continuation's end) yields the
tokens committed per target forward, i.e. the ``tau`` that :class:`~wavesurf.drafter.decode.SpeculativeDecoder`
reports, for every draft length ``1..D`` from one unroll. The only differences to a real run are
floating-point ones (KV-cached vs full-sequence target forwards).

A continuation is the run of ``loss_mask`` (assistant) tokens of a feature-store sequence: the
target's answer to the prefix before it, when the store was built on a corpus the target generated
(``sharegpt@<model>``, see :mod:`wavesurf.distill`). Where a stored token differs from the target's
greedy choice at the previous position (a corpus the target did not write, or a float near-tie in
batched generation) the continuation is cut there: past that point greedy decoding would take
another path.

Units: ``tau`` is tokens per target forward after the prefill (>= 1); accuracies are fractions.
Intervals (:func:`bootstrap_tau`, :func:`acceptance_intervals`) resample held-out sequences and
training seeds; the resampling is in :mod:`wavesurf.drafter.intervals`.

Over ~450 lines because exactness rests on one unroll shared by every scorer here (head alone, after
lookup, the bigram and lookup floors) and on their one resumable cache entry; splitting them would
split that argument.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import AcceptanceError, is_int
from .._version import __version__
from ..cache import atomic_directory, cache_root, params_key, verify_directory, write_manifest
from .features import FeatureStore
from .head import DraftHead
from .intervals import TauIntervals, tau_intervals
from .lookup import check_lookup_ngram, lookup_drafts

if TYPE_CHECKING:
    from ..models import Target

ACCEPTANCE_FORMAT = 1
#: draft lengths scored by default (chain decoding with 1..6 drafted tokens per cycle)
DEFAULT_MAX_DRAFT_LEN = 6



# ---------------------------------------------------------------------------------------------
# the cycle walk
def leading_hits(hits: np.ndarray) -> np.ndarray:
    """Number of leading True values in each row of a bool [P, D] array (accepted drafts per root)."""
    hits = np.asarray(hits, dtype=bool)
    if hits.ndim != 2:
        raise AcceptanceError(f"hits must be a 2-D [positions, steps] array, got shape {hits.shape}")
    miss = ~hits
    first_miss = np.where(miss.any(axis=1), miss.argmax(axis=1), hits.shape[1])
    return first_miss.astype(np.int64)


def walk_chain(hits: np.ndarray, length: int, draft_len: int) -> list[int]:
    """Tokens committed by each target forward of greedy chain decoding with ``draft_len`` drafted
    tokens per cycle, over a continuation of ``length`` tokens whose first token came from the
    prefill. ``hits[i, j]``: draft step j is right at root i (the cycle whose root is the
    continuation's (i+1)-th token). Mirrors :meth:`SpeculativeDecoder.generate`: a cycle commits its
    accepted drafts plus the target's bonus token, cut at the end of the continuation."""
    if not is_int(draft_len, 1):
        raise AcceptanceError(f"draft_len={draft_len!r} must be a positive integer")
    if draft_len > hits.shape[1]:
        raise AcceptanceError(f"draft_len={draft_len} is longer than the {hits.shape[1]} unrolled steps")
    lead = leading_hits(hits[:, :draft_len]) if len(hits) else np.zeros(0, dtype=np.int64)
    cycles: list[int] = []
    produced, i = 1, 0
    while produced < length:
        a = int(lead[i]) if i < len(lead) else 0
        commit = min(a + 1, length - produced)
        cycles.append(commit)
        produced += commit
        i += a + 1
    return cycles


# ---------------------------------------------------------------------------------------------
# results
@dataclass
class Acceptance:
    """Offline acceptance of one drafter on one set of continuations.

    Per sequence ``s`` and draft length ``D`` (``draft_lens``): ``committed[s, D-1]`` tokens over
    ``cycles[s, D-1]`` target forwards; ``tau(D)`` is their ratio over all sequences. ``step_hits``
    / ``step_total`` [D]: teacher-forced accuracy of each draft step over every root where that
    step has a token to predict.
    """

    name: str
    max_draft_len: int
    sequence_ids: list[str]
    committed: np.ndarray  # int64 [S, D]
    cycles: np.ndarray  # int64 [S, D]
    step_hits: np.ndarray  # int64 [D]
    step_total: np.ndarray  # int64 [D]
    positions: int  # continuation tokens scored (roots + first tokens)
    cut_tokens: int  # tokens dropped after a stored token disagreed with the target's greedy choice
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def draft_lens(self) -> list[int]:
        return list(range(1, self.max_draft_len + 1))

    def tau(self, draft_len: int) -> float:
        c = self.cycles[:, draft_len - 1].sum()
        return float(self.committed[:, draft_len - 1].sum() / c) if c else float("nan")

    def sequence_tau(self, draft_len: int) -> np.ndarray:
        """tau of each sequence alone (NaN where a sequence has no cycle)."""
        c = self.cycles[:, draft_len - 1].astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(c > 0, self.committed[:, draft_len - 1] / np.maximum(c, 1), np.nan)

    @property
    def step_accuracy(self) -> list[float]:
        return [float(h / t) if t else float("nan") for h, t in zip(self.step_hits, self.step_total)]

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "sequences": len(self.sequence_ids), "positions": self.positions,
                "cut_tokens": self.cut_tokens,
                **{f"tau_{d}": round(self.tau(d), 5) for d in self.draft_lens},
                **{f"step_accuracy_{j}": round(a, 5) for j, a in enumerate(self.step_accuracy)}, **self.info}

    # ---- disk ---------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        np.savez(directory / "acceptance.npz", committed=self.committed, cycles=self.cycles,
                 step_hits=self.step_hits, step_total=self.step_total)
        meta = {k: v for k, v in asdict(self).items() if k not in ("committed", "cycles", "step_hits", "step_total")}
        (directory / "acceptance.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: Path) -> Acceptance:
        meta = json.loads((directory / "acceptance.json").read_text())
        with np.load(directory / "acceptance.npz") as z:
            arrays = {k: z[k] for k in ("committed", "cycles", "step_hits", "step_total")}
        return cls(**meta, **arrays)


def acceptance_from_hits(name: str, segments: Sequence[tuple[int, np.ndarray, int]], sequence_ids: Sequence[str],
                         max_draft_len: int, cut_tokens: int = 0, info: dict | None = None) -> Acceptance:
    """Collect per-sequence committed tokens and cycles from ``segments`` = (sequence index,
    hits [length-1, D], length) of each continuation."""
    s, d = len(sequence_ids), max_draft_len
    committed = np.zeros((s, d), dtype=np.int64)
    cycles = np.zeros((s, d), dtype=np.int64)
    step_hits = np.zeros(d, dtype=np.int64)
    step_total = np.zeros(d, dtype=np.int64)
    positions = 0
    for seq, hits, length in segments:
        positions += length
        for j in range(d):
            valid = max(0, length - 1 - j)  # roots whose step j has a token to predict
            step_hits[j] += int(hits[:valid, j].sum())
            step_total[j] += valid
        for dl in range(1, d + 1):
            cyc = walk_chain(hits, length, dl)
            committed[seq, dl - 1] += sum(cyc)
            cycles[seq, dl - 1] += len(cyc)
    return Acceptance(name, d, list(sequence_ids), committed, cycles, step_hits, step_total, positions,
                      int(cut_tokens), dict(info or {}))


# ---------------------------------------------------------------------------------------------
# continuations in a feature store
@dataclass
class Continuation:
    sequence: int  # index into the store's sequences
    start: int  # position of the continuation's first token in the sequence
    length: int  # tokens, after any cut


def continuations(loss_mask: np.ndarray, input_ids: np.ndarray, target_argmax: np.ndarray,
                  sequence: int) -> tuple[list[Continuation], int]:
    """The continuations (maximal runs of ``loss_mask`` not starting at position 0) of one sequence,
    each cut where a stored token is not the target's greedy choice at the previous position.
    Returns them and the number of tokens cut."""
    out, cut = [], 0
    n = len(loss_mask)
    i = 0
    while i < n:
        if not loss_mask[i] or i == 0:
            i += 1
            continue
        j = i
        while j < n and loss_mask[j]:
            j += 1
        agree = input_ids[i:j] == target_argmax[i - 1 : j - 1]
        length = int(agree.argmin()) if not agree.all() else j - i
        cut += (j - i) - length
        if length >= 1:
            out.append(Continuation(sequence, i, length))
        i = j
    return out, cut


def _hits_for(hits_all: np.ndarray, c: Continuation) -> np.ndarray:
    """Rows of a [T, D] hits array of the roots of continuation ``c``: root k (the continuation's
    (k+1)-th token) sits at position ``start + k``, and the head drafts for it at the previous
    position (features f_{m-1}, embedding of x_m), as ``SpeculativeDecoder`` does."""
    rows = hits_all[c.start - 1 : c.start - 1 + c.length - 1].copy()
    d = rows.shape[1]
    for j in range(d):  # step j at root k predicts continuation token k+2+j (1-based): beyond the end = no hit
        last_valid = c.length - 1 - j
        rows[max(0, last_valid):, j] = False
    return rows


def _check_store(store: FeatureStore, target: Target, layer_ids: Sequence[int] | None) -> None:
    store.check_target(target)
    if layer_ids is not None:
        store.check_layer_ids(layer_ids)
    generated_by = (store.params.get("corpus_info") or {}).get("generated_by") or _generated_by(store.params.get("dataset"))
    if generated_by and generated_by != target.name:
        raise AcceptanceError(f"continuations in {store.path.name} were generated by {generated_by!r}, not by the "
                              f"target {target.name!r}; distill the corpus with {target.name!r}")


def _generated_by(dataset: Any) -> str | None:
    """The model of a ``corpus@model`` dataset name, else None."""
    if isinstance(dataset, str) and "@" in dataset:
        return dataset.rsplit("@", 1)[1]
    return None


def head_hits(head: DraftHead, batch: dict[str, Any], embed: Any, max_draft_len: int) -> Any:
    """Teacher-forced unroll of ``head`` over one feature batch: bool [B, T, D], entry (b, t, j)
    True iff draft step j of the head at position t (fused features of t, embedding of x_{t+1},
    its own earlier outputs) picks the target's greedy token at position t+1+j, i.e. x_{t+2+j} on a
    greedy continuation. Positions without a token to compare are False. With a ``loss_mask`` in
    the batch (a feature store's), only positions t whose next token is an answer token are read
    out (the roots a scorer reads, :func:`_hits_for`; the others stay False): the draft-vocabulary
    readout is ~40% of a step, and prompt positions, whose keys every root attends to, need none."""
    import torch

    from .train import ttt_unroll

    ids, attn = batch["input_ids"], batch["attention_mask"]
    b, t = ids.shape
    d2t = head.draft_to_target.to(ids.device)
    arg = batch["target_argmax"]
    roots = batch["loss_mask"].to(ids.device).bool() & attn.bool() if "loss_mask" in batch else attn.bool()
    hits = torch.zeros(b, t, max_draft_len, dtype=torch.bool)
    with torch.inference_mode():
        features = batch["features"].to(head.fc.weight.dtype)
        for j, out in ttt_unroll(head, features, embed(ids), attn, max_draft_len, with_logits=False):
            n = t - 1 - j  # positions t whose step j compares against argmax at t+1+j
            read = roots[:, 1 : 1 + n] & attn[:, 1 + j : 1 + j + n].bool()  # a root at t+1, a token at t+1+j
            draft = d2t[head.readout(out.hidden[:, :n][read]).argmax(-1)]
            step = torch.zeros(b, n, dtype=torch.bool, device=ids.device)
            step[read] = draft == arg[:, 1 + j : 1 + j + n][read]
            hits[:, :n, j] = step.cpu()
    return hits


def _scan(store: FeatureStore, layer_ids: Sequence[int], batch_tokens: int, hits_fn: Any, max_draft_len: int,
          progress: bool, desc: str) -> tuple[list[tuple[int, np.ndarray, int]], list[str], int]:
    """Hits of one drafter on every continuation of ``store``: (segments, sequence ids, tokens cut)."""
    (segments,), ids, cut = _scan_variants(store, layer_ids, batch_tokens, lambda batch: (hits_fn(batch),), 1,
                                           progress, desc)
    return segments, ids, cut


def _scan_variants(store: FeatureStore, layer_ids: Sequence[int], batch_tokens: int, hits_fn: Any, n_variants: int,
                   progress: bool, desc: str) -> tuple[list[list[tuple[int, np.ndarray, int]]], list[str], int]:
    """:func:`_scan` for ``n_variants`` drafters whose hits one pass computes together (``hits_fn``
    returns a tuple of [B, T, D] arrays): one segment list per variant."""
    from ..progress import progress_bar

    batches = store.batches(layer_ids, batch_tokens)
    seq_index = {(s.shard, s.start): i for i, s in enumerate(store.sequences)}
    segments: list[list[tuple[int, np.ndarray, int]]] = [[] for _ in range(n_variants)]
    cut_total = 0
    for bi in progress_bar(range(len(batches)), desc=desc, unit="batch", disable=not progress):
        batch = batches[bi]
        hits = [h.numpy() for h in hits_fn(batch)]
        for r, s in enumerate(batches.plan[batches.order[bi]]):
            n = s.length
            conts, cut = continuations(batch["loss_mask"][r, :n].numpy(), batch["input_ids"][r, :n].numpy(),
                                       batch["target_argmax"][r, :n].numpy(), seq_index[(s.shard, s.start)])
            cut_total += cut
            for c in conts:
                for v in range(n_variants):
                    segments[v].append((c.sequence, _hits_for(hits[v][r, :n], c), c.length))
    ids = [f"{store.path.name}/{i}" for i in range(len(store.sequences))]
    return segments, ids, cut_total


def _entry_params(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """What a cached score is keyed by and its manifest records: the format, version and kind too."""
    return {"format": ACCEPTANCE_FORMAT, "wavesurf": __version__, "kind": kind, **params}


def _cache_dir(kind: str, params: dict[str, Any]) -> Path:
    return cache_root() / "drafter" / "acceptance" / f"{kind}-{params_key(_entry_params(kind, params))}"


def _load_cached(kind: str, params: dict[str, Any], result_type: Any = None) -> Any:
    """The cached result of ``kind`` under ``params`` (an :class:`Acceptance`, or ``result_type``:
    any class with ``load(directory)``/``save(directory)``), None where missing or unreadable."""
    where = _cache_dir(kind, params)
    if verify_directory(where) is None:
        try:
            return (result_type or Acceptance).load(where)
        except (OSError, KeyError, ValueError, TypeError):
            pass
    return None


def _store_cached(kind: str, params: dict[str, Any], result: Any) -> None:
    with atomic_directory(_cache_dir(kind, params), overwrite=True) as tmp:
        result.save(tmp)
        write_manifest(tmp, _entry_params(kind, params))


def _cached(kind: str, params: dict[str, Any], compute: Any, use_cache: bool) -> Acceptance:
    if use_cache and (found := _load_cached(kind, params)) is not None:
        return found
    t0 = time.perf_counter()
    result: Acceptance = compute()
    result.info["seconds"] = round(time.perf_counter() - t0, 2)
    if use_cache:
        _store_cached(kind, params, result)
    return result


def check_max_draft_len(max_draft_len: Any) -> int:
    if not is_int(max_draft_len, 1, 32):
        raise AcceptanceError(f"max_draft_len={max_draft_len!r} must be an integer between 1 and 32")
    return int(max_draft_len)


def offline_acceptance(
    target: Target,
    head: DraftHead,
    store: FeatureStore,
    *,
    max_draft_len: int = DEFAULT_MAX_DRAFT_LEN,
    lookup_ngram: int = 0,
    batch_tokens: int = 4096,
    name: str = "",
    use_cache: bool = True,
    progress: bool = True,
) -> Acceptance:
    """Chain acceptance of ``head`` on the continuations stored in ``store`` (held-out target
    answers), for draft lengths 1..``max_draft_len``; cached by the head's weights and the store.
    ``lookup_ngram > 0``: the chain's first tokens come from n-gram lookup where the context has a
    match (:func:`lookup_first`), as ``SpeculativeDecoder(lookup_ngram=...)`` drafts."""
    (result,) = offline_acceptances(target, head, store, max_draft_len=max_draft_len, lookup_ngrams=(lookup_ngram,),
                                    batch_tokens=batch_tokens, names=(name,), use_cache=use_cache, progress=progress)
    return result


def offline_acceptances(
    target: Target,
    head: DraftHead,
    store: FeatureStore,
    *,
    max_draft_len: int = DEFAULT_MAX_DRAFT_LEN,
    lookup_ngrams: Sequence[int] = (0,),
    batch_tokens: int = 4096,
    names: Sequence[str] | None = None,
    use_cache: bool = True,
    progress: bool = True,
    floor: BigramTable | None = None,
) -> list[Acceptance]:
    """:func:`offline_acceptance` of ``head`` alone (``0`` in ``lookup_ngrams``) and after n-gram
    lookup of each other order, from one unroll of the head over the store (the head's own hits do
    not depend on what drafts before it, :func:`lookup_first`); each result is cached under the
    key :func:`offline_acceptance` gives it, and only the missing ones are computed. With a bigram
    ``floor`` (and the cache on), the same unroll's step-0 hits also make the head's
    :func:`~wavesurf.drafter.diagnostics.floor_miss_accuracy` entry, which then needs no scan of its own."""
    from .diagnostics import floor_miss_params, floor_misses_from_segments, load_floor_misses, store_floor_misses
    from .head import head_fingerprint

    max_draft_len = check_max_draft_len(max_draft_len)
    lookup_ngrams = list(lookup_ngrams)
    for n in lookup_ngrams:
        check_lookup_ngram(n, error=AcceptanceError)
    names = list(names) if names is not None else [""] * len(lookup_ngrams)
    if len(names) != len(lookup_ngrams):
        raise AcceptanceError(f"{len(names)} names for {len(lookup_ngrams)} lookup orders {lookup_ngrams}")
    head.config.check_target(target)
    _check_store(store, target, head.config.layer_ids)
    head = head.to(target.device).eval()
    embed = target.model.get_input_embeddings()
    fp = head_fingerprint(head)

    def params_for(lookup_ngram: int) -> dict[str, Any]:
        params = {"head": fp, "store": store.key, "max_draft_len": max_draft_len}
        if lookup_ngram:  # only when set: the head-alone scores keep their cache keys
            params["lookup_ngram"] = lookup_ngram
        return params

    results: list[Acceptance | None] = [_load_cached("head", params_for(n)) if use_cache else None
                                        for n in lookup_ngrams]
    todo = [i for i, r in enumerate(results) if r is None]
    if todo:
        orders = [lookup_ngrams[i] for i in todo]
        floor_params = floor_miss_params(fp, floor, store) if floor is not None and use_cache else None
        with_floor = floor_params is not None and load_floor_misses(floor_params) is None

        def hits_fn(batch: dict[str, Any]) -> tuple[Any, ...]:
            alone = head_hits(head, {k: v.to(target.device) for k, v in batch.items()}, embed, max_draft_len)
            scored = tuple(lookup_first(alone, batch, max_draft_len, n) if n else alone for n in orders)
            return (*scored, alone[..., :1], floor.hits(batch, 1)) if with_floor else scored

        t0 = time.perf_counter()
        label = names[todo[0]] or fp
        segments, ids, cut = _scan_variants(store, head.config.layer_ids, batch_tokens, hits_fn,
                                            len(todo) + 2 * with_floor, progress, f"acceptance {label}")
        seconds = round(time.perf_counter() - t0, 2)
        if with_floor:
            store_floor_misses(floor_params, floor_misses_from_segments(
                names[todo[0]] or fp, segments[-2], segments[-1], ids,
                {"layer_ids": list(head.config.layer_ids), "store": store.key, "cut_tokens": cut}))
        for v, i in enumerate(todo):
            n = lookup_ngrams[i]
            extra = {"lookup_ngram": n} if n else {}
            result = acceptance_from_hits(names[i] or fp, segments[v], ids, max_draft_len, cut,
                                          {"head": fp, "layer_ids": list(head.config.layer_ids), "store": store.key,
                                           **extra, "seconds": seconds})
            if use_cache:
                _store_cached("head", params_for(n), result)
            results[i] = result
    return [r for r in results if r is not None]


# ---------------------------------------------------------------------------------------------
# the bigram floor
@dataclass
class BigramTable:
    """The most frequent next token after each token in the training corpus (``-1``: never seen):
    a drafter that needs no target features, as a floor for any trained head."""

    next_token: np.ndarray  # int64 [V]
    counted_pairs: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        """sha256 (16 hex) of the table itself: what a cached score of this floor is keyed by."""
        import hashlib

        return hashlib.sha256(self.next_token.tobytes()).hexdigest()[:16]

    def hits(self, batch: dict[str, Any], max_draft_len: int) -> Any:
        """Same contract as :func:`head_hits`: step j at position t drafts ``next_token`` of the
        (teacher-forced) token x_{t+1+j} and compares it with the target's greedy token there."""
        import torch

        ids, arg, attn = batch["input_ids"], batch["target_argmax"], batch["attention_mask"]
        b, t = ids.shape
        table = torch.from_numpy(self.next_token)
        guess = table[ids]  # guess[p] = draft of the token after x_p
        ok_at = (guess == arg) & attn  # the target's greedy token after x_p
        hits = torch.zeros(b, t, max_draft_len, dtype=torch.bool)
        for j in range(max_draft_len):
            n = t - 1 - j
            if n <= 0:
                break
            hits[:, :n, j] = ok_at[:, 1 + j : 1 + j + n]
        return hits


def count_bigrams(encoded: Sequence[Any], vocab_size: int) -> BigramTable:
    """Count (previous, next) pairs whose next token is an assistant token (every content token
    for plain text) and keep the most frequent next token per previous token (ties: smaller id)."""
    from ..data import ROLE_ASSISTANT, ROLE_TEMPLATE

    has_assistant = any(bool((e.roles == ROLE_ASSISTANT).any()) for e in encoded)
    codes = []
    for e in encoded:
        keep = (e.roles[1:] == ROLE_ASSISTANT) if has_assistant else (e.roles[1:] != ROLE_TEMPLATE)
        prev, nxt = e.input_ids[:-1][keep], e.input_ids[1:][keep]
        codes.append(prev.astype(np.int64) * vocab_size + nxt.astype(np.int64))
    allc = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int64)
    uniq, counts = np.unique(allc, return_counts=True)
    prev, nxt = uniq // vocab_size, uniq % vocab_size
    order = np.lexsort((nxt, -counts, prev))  # per prev: highest count first, then smaller id
    prev_sorted = prev[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = prev_sorted[1:] != prev_sorted[:-1]
    table = np.full(vocab_size, -1, dtype=np.int64)
    table[prev_sorted[first]] = nxt[order][first]
    return BigramTable(table, int(allc.size), {"distinct_previous": int(first.sum()),
                                               "roles": "assistant" if has_assistant else "content"})


def build_bigram_table(target: Target, dataset: str, split: str | None = "train", split_seed: int = 0,
                       max_tokens: int | None = None, max_len: int = 2048) -> BigramTable:
    """Bigram table of ``max_tokens`` tokens (None: all) of a corpus, encoded as for training."""
    from ..data import encode, encode_budget, load_corpus

    corpus = load_corpus(dataset, split=split, seed=split_seed)
    if max_tokens is None:
        encoded = [e for e in (encode(x, target.tokenizer, target.has_chat_template, max_len) for x in corpus.examples)
                   if len(e) >= 2]
    else:
        encoded = encode_budget(corpus, target.tokenizer, target.has_chat_template, max_tokens, max_len)
    table = count_bigrams(encoded, target.vocab_size)
    table.info.update(dataset=dataset, split=split, split_seed=split_seed, max_tokens=max_tokens, max_len=max_len,
                      tokens=int(sum(len(e) for e in encoded)))
    return table


def bigram_acceptance(target: Target, table: BigramTable, store: FeatureStore, *,
                      max_draft_len: int = DEFAULT_MAX_DRAFT_LEN, batch_tokens: int = 4096, name: str = "bigram",
                      use_cache: bool = True, progress: bool = True) -> Acceptance:
    """Chain acceptance of the bigram floor on the same continuations as :func:`offline_acceptance`."""
    max_draft_len = check_max_draft_len(max_draft_len)
    _check_store(store, target, None)
    fp = table.fingerprint
    ids = [target.n_layers]  # any stored id: the floor reads no features

    def compute() -> Acceptance:
        segments, seq_ids, cut = _scan(store, ids, batch_tokens, lambda batch: table.hits(batch, max_draft_len),
                                       max_draft_len, progress, f"acceptance {name}")
        return acceptance_from_hits(name, segments, seq_ids, max_draft_len, cut,
                                    {"bigram": fp, "store": store.key, **table.info})

    return _cached("bigram", {"bigram": fp, "store": store.key, "max_draft_len": max_draft_len}, compute, use_cache)


def lookup_hits(batch: dict[str, Any], max_draft_len: int, max_ngram: int = 3, *,
                with_available: bool = False) -> Any:
    """Same contract as :func:`head_hits` for n-gram lookup: the drafts at position t come from the
    context x_0..x_{t+1} (what the decoder holds when position t's cycle starts), step j compared
    with the target's greedy token at position t+1+j. With ``with_available`` also a bool [B, T, D]
    array of where lookup proposed a token at all (what the head does not have to draft)."""
    import torch

    ids, arg, attn = batch["input_ids"], batch["target_argmax"], batch["attention_mask"]
    b, t = ids.shape
    hits = torch.zeros(b, t, max_draft_len, dtype=torch.bool)
    available = torch.zeros(b, t, max_draft_len, dtype=torch.bool)
    for r in range(b):
        n = int(attn[r].sum())
        drafts = lookup_drafts(ids[r, :n].tolist(), max_draft_len, max_ngram)
        for pos in range(n - 1):
            draft = drafts[pos + 1]
            available[r, pos, :len(draft)] = True
            for j, tok in enumerate(draft):
                if pos + 1 + j >= n or tok != int(arg[r, pos + 1 + j]):
                    break
                hits[r, pos, j] = True
    return (hits, available) if with_available else hits


def lookup_first(head_part: Any, batch: dict[str, Any], max_draft_len: int, lookup_ngram: int) -> Any:
    """Hits of chain drafting with n-gram lookup first and the head after it (see
    :class:`~wavesurf.drafter.decode.SpeculativeDecoder`, ``lookup_ngram``), from the head's own
    hits [B, T, D] (:func:`head_hits`) and a CPU ``batch``: step j is lookup's token where lookup
    proposed one, else the head's. Exact because while every earlier draft was right the head's step
    j reads the same inputs whichever drafter proposed those tokens (the true tokens' embeddings and
    its own earlier hidden states), so one unroll of the head serves both ways of drafting."""
    import torch

    lookup_part, available = lookup_hits(batch, max_draft_len, lookup_ngram, with_available=True)
    return torch.where(available, lookup_part, head_part)


def lookup_acceptance(target: Target, store: FeatureStore, *, max_draft_len: int = DEFAULT_MAX_DRAFT_LEN,
                      max_ngram: int = 3, batch_tokens: int = 4096, name: str = "lookup", use_cache: bool = True,
                      progress: bool = True) -> Acceptance:
    """Chain acceptance of n-gram lookup drafting (prompt + answer so far as the context) on the
    same continuations as :func:`offline_acceptance`: the floor a copy mechanism sets, which
    matters because a small target's greedy answers repeat themselves."""
    max_draft_len = check_max_draft_len(max_draft_len)
    if not is_int(max_ngram, 1):
        raise AcceptanceError(f"max_ngram={max_ngram!r} must be a positive integer")
    _check_store(store, target, None)
    ids = [target.n_layers]  # any stored id: lookup reads no features

    def compute() -> Acceptance:
        segments, seq_ids, cut = _scan(store, ids, batch_tokens, lambda batch: lookup_hits(batch, max_draft_len, max_ngram),
                                       max_draft_len, progress, f"acceptance {name}")
        return acceptance_from_hits(name, segments, seq_ids, max_draft_len, cut,
                                    {"lookup_max_ngram": max_ngram, "store": store.key})

    return _cached("lookup", {"max_ngram": max_ngram, "store": store.key, "max_draft_len": max_draft_len}, compute,
                   use_cache)


# ---------------------------------------------------------------------------------------------
# intervals (the resampling itself lives in :mod:`wavesurf.drafter.intervals`)
def _check_runs(groups: Sequence[Sequence[Acceptance]], draft_len: int) -> None:
    if not groups or any(not g for g in groups):
        raise AcceptanceError("intervals need at least one acceptance run per drafter")
    ref = groups[0][0]
    for g in groups:
        for r in g:
            if r.sequence_ids != ref.sequence_ids:
                raise AcceptanceError(f"acceptance runs {ref.name!r} and {r.name!r} are on different continuations; "
                                      "paired intervals need the same held-out store")
            if not is_int(draft_len, 1) or draft_len > r.max_draft_len:
                raise AcceptanceError(f"draft_len={draft_len} is not one run {r.name!r} scored (1..{r.max_draft_len})")


def acceptance_arrays(groups: Sequence[Sequence[Acceptance]], draft_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Committed tokens and cycles per drafter, seed and held-out sequence at ``draft_len``,
    ``[G, K, S]`` each (``groups``: one list of runs per drafter, one run per seed, checked to be on
    the same continuations). Drafters may have different numbers of seeds: run k of every drafter
    is seed k (the same seed value; paired by index), and a drafter's missing seeds are NaN rows
    up to the largest count ``K`` (:func:`wavesurf.drafter.intervals.seed_counts`)."""
    _check_runs(groups, draft_len)
    k_max, s = max(len(g) for g in groups), len(groups[0][0].sequence_ids)
    committed = np.full((len(groups), k_max, s), np.nan)
    cycles = np.full((len(groups), k_max, s), np.nan)
    for i, g in enumerate(groups):
        for k, r in enumerate(g):
            committed[i, k], cycles[i, k] = r.committed[:, draft_len - 1], r.cycles[:, draft_len - 1]
    return committed, cycles


def acceptance_intervals(groups: Sequence[Sequence[Acceptance]], draft_len: int, *, reference: int | None = None,
                         family: Sequence[int] = (), level: float = 0.95, family_level: float | None = None,
                         n_boot: int = 2000, seed: int = 0, pool_seeds: bool = True) -> TauIntervals:
    """Intervals of tau at ``draft_len`` for several drafters (``groups``: one list of runs per
    drafter, one run per training seed, all on the same held-out continuations), resampling
    held-out sequences and training seeds (:func:`wavesurf.drafter.intervals.tau_intervals`:
    differences against ``reference``, simultaneous ones for ``family``). A deterministic drafter
    (a floor) is passed as the same run repeated once per seed."""
    committed, cycles = acceptance_arrays(groups, draft_len)
    return tau_intervals(committed, cycles, reference=reference, family=family, level=level,
                         family_level=family_level, n_boot=n_boot, seed=seed, pool_seeds=pool_seeds)


def acceptance_null_percentiles(groups: Sequence[Sequence[Acceptance]], draft_len: int, subjects: Sequence[int],
                                null: Sequence[int], *, level: float = 0.95, n_boot: int = 2000,
                                seed: int = 0) -> list[dict[str, float]]:
    """Percentile of each drafter of ``subjects`` among the ``null`` drafters (random layer sets),
    with two-level intervals (:func:`wavesurf.drafter.intervals.null_percentiles`)."""
    from .intervals import null_percentiles

    committed, cycles = acceptance_arrays(groups, draft_len)
    return null_percentiles(committed, cycles, subjects, null, level=level, n_boot=n_boot, seed=seed)


#: what :func:`bootstrap_tau` returns besides tau and its interval
_DIFF_KEYS = ("diff", "diff_lo", "diff_hi", "diff_se", "diff_se_seed", "diff_se_seq", "diff_df", "diff_seq_lo",
              "diff_seq_hi", "diff_seed_min", "diff_seed_max")


def bootstrap_tau(runs: Sequence[Acceptance], draft_len: int, *, baseline: Sequence[Acceptance] | None = None,
                  n_boot: int = 2000, seed: int = 0, level: float = 0.95, pool_seeds: bool = True) -> dict[str, float]:
    """tau at ``draft_len`` averaged over ``runs`` (one per training seed) with its interval; with
    ``baseline`` (runs of another drafter on the same continuations, as many seeds) also the
    **paired** difference ``runs - baseline`` and its interval: each replicate draws one set of
    sequences (and of seeds, paired by index) and scores every drafter on it, so the sampling
    noise of the continuations cancels in the difference.

    Why two levels: a head's tau depends on the held-out sequences *and* on its training run, so
    with 2 or more seeds the interval resamples both (``tau_se``/``diff_se`` with their
    Satterthwaite ``*_df``; ``diff_se_seed``/``diff_se_seq`` are the two parts); ``diff_seq_lo``/
    ``diff_seq_hi`` are the sequence-only interval, which under-covers when seeds differ. With one
    seed the interval is the sequence percentile interval (seed variance not estimated; label it
    with :func:`wavesurf.drafter.intervals.basis` of ``seeds`` and ``sequences``). Details:
    :mod:`wavesurf.drafter.intervals`."""
    if not runs:
        raise AcceptanceError("bootstrap_tau needs at least one acceptance run")
    if baseline is not None and len(baseline) == 0:
        baseline = None
    groups = [list(runs)] + ([list(baseline)] if baseline else [])
    iv = acceptance_intervals(groups, draft_len, reference=1 if baseline else None, level=level, n_boot=n_boot,
                              seed=seed, pool_seeds=pool_seeds)
    row = iv.rows[0]
    out = {k: row[k] for k in ("tau", "tau_lo", "tau_hi", "tau_se", "tau_df", "tau_seed_std")}
    out.update(seeds=iv.seeds_per_drafter[0], sequences=iv.sequences)
    if baseline:
        out.update({k: row[k] for k in _DIFF_KEYS})
    return out


__all__ = ["Acceptance", "AcceptanceError", "BigramTable", "acceptance_arrays", "acceptance_intervals", "acceptance_null_percentiles", "bigram_acceptance", "bootstrap_tau", "build_bigram_table",
           "continuations", "count_bigrams", "head_hits", "lookup_first", "offline_acceptances", "lookup_acceptance", "lookup_hits", "leading_hits", "offline_acceptance", "walk_chain"]
