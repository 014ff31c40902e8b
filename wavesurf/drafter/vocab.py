"""The reduced draft vocabulary of an EAGLE-3 head: the ``draft_vocab_size`` target token ids
the drafter most often has to predict.

As in EAGLE-3 (SafeAILab/EAGLE ``eagle/traineagle3``, the ``d2t``/``t2d`` maps; the book's methods chapter), token ids are counted over the encoded training
split at the positions the drafter is trained on: assistant tokens. A corpus without assistant
turns (plain text) counts every non-template (content) token instead; :attr:`DraftVocab.roles`
says which rule was used. The most frequent ids are taken (ties broken by the smaller id), padded
with the lowest unused ids if fewer distinct ids occur, and sorted ascending, so that
``draft id i -> target id ids[i]`` is the head's ``d2t`` map.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._version import __version__
from ..cache import atomic_directory, entry_dir, params_key, read_manifest, verify_directory, write_manifest
from ..data import ROLE_ASSISTANT, ROLE_TEMPLATE, Encoded
from .head import DrafterError

if TYPE_CHECKING:
    from ..models import Target

VOCAB_FORMAT = 1
#: Tokens tokenized for counting by default (tokenization only: ~1 s per 300k tokens).
DEFAULT_VOCAB_TOKENS = 2_000_000
DEFAULT_VOCAB_MAX_LEN = 2048
#: Held-out tokens counted for the coverage a drafter meets when decoding.
HELDOUT_VOCAB_TOKENS = 200_000


@dataclass
class DraftVocab:
    """A draft vocabulary: ``ids`` (int64, ascending target ids, length ``draft_vocab_size``),
    ``counts`` (how often each id occurred at counted positions) and ``coverage`` (fraction of
    counted tokens whose id is in ``ids``)."""

    ids: np.ndarray
    counts: np.ndarray
    coverage: float
    counted_tokens: int
    roles: str  # "assistant" or "content" (no assistant turns in the corpus)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def summary(self) -> dict[str, Any]:
        return {"draft_vocab_size": self.size, "coverage": round(self.coverage, 6),
                "counted_tokens": self.counted_tokens, "roles": self.roles, **self.info}


def check_draft_vocab_size(draft_vocab_size: Any, target_vocab_size: int) -> int:
    """1 <= draft_vocab_size <= the target's vocabulary size."""
    if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, (int, np.integer)):
        raise DrafterError(f"draft_vocab_size must be an integer, got {draft_vocab_size!r}")
    if not 1 <= int(draft_vocab_size) <= target_vocab_size:
        raise DrafterError(f"draft_vocab_size={draft_vocab_size} is not allowed: it must be between 1 and the "
                           f"target's vocabulary size {target_vocab_size}")
    return int(draft_vocab_size)


def count_tokens(encoded: list[Encoded], vocab_size: int) -> tuple[np.ndarray, str]:
    """Histogram [vocab_size] of ids at assistant positions, or at content (non-template)
    positions when no example has an assistant token. Returns (counts, roles rule)."""
    has_assistant = any(bool((e.roles == ROLE_ASSISTANT).any()) for e in encoded)
    rule = "assistant" if has_assistant else "content"
    counts = np.zeros(vocab_size, dtype=np.int64)
    for e in encoded:
        keep = e.roles == ROLE_ASSISTANT if has_assistant else e.roles != ROLE_TEMPLATE
        ids = e.input_ids[keep]
        if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
            raise DrafterError(f"token id {int(ids.max())} is outside the target vocabulary 0..{vocab_size - 1}")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts, rule


def select_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, float]:
    """The ``draft_vocab_size`` most frequent ids (ties: smaller id first; ids never seen fill up
    from the lowest), ascending, and the fraction of counted tokens they cover."""
    n = check_draft_vocab_size(draft_vocab_size, counts.shape[0])
    order = np.lexsort((np.arange(counts.shape[0]), -counts))  # by count desc, then id asc
    ids = np.sort(order[:n]).astype(np.int64)
    total = int(counts.sum())
    coverage = float(counts[ids].sum() / total) if total else 0.0
    return ids, coverage


def vocab_dir(model_name: str, key: str) -> Path:
    return entry_dir("drafter/vocab", model_name, key)


def build_draft_vocab(
    target: Target,
    draft_vocab_size: int,
    *,
    dataset: str = "sharegpt",
    split: str | None = "train",
    split_seed: int = 0,
    max_tokens: int | None = None,
    max_len: int = DEFAULT_VOCAB_MAX_LEN,
    use_cache: bool = True,
    heldout_split: str | None = "heldout",
) -> DraftVocab:
    """Count ids over ``max_tokens`` tokens of the encoded training split (None: the whole split,
    up to :data:`DEFAULT_VOCAB_TOKENS`) and keep the ``draft_vocab_size`` most frequent. Cached
    under ``cache_root()/drafter/vocab/<model>-<key>/`` (the counts are stored, so other sizes of
    the same corpus budget reuse them). With ``heldout_split`` (a split of the same corpus that
    exists), the summary also reports ``heldout_coverage``: the fraction of held-out tokens the
    vocabulary covers, which is what a drafter meets when it decodes."""
    from ..data import load_corpus

    check_draft_vocab_size(draft_vocab_size, target.vocab_size)
    params = {"format": VOCAB_FORMAT, "wavesurf": __version__, "model": target.name, "source": target.source,
              "vocab_size": target.vocab_size, "chat_template": target.has_chat_template, "dataset": dataset,
              "split": split, "split_seed": split_seed, "max_tokens": max_tokens, "max_len": max_len}
    key = params_key(params)
    where = vocab_dir(target.name, key)
    counts = rule = None
    if use_cache and verify_directory(where) is None:
        try:
            counts = np.load(where / "counts.npy")
            rule = read_manifest(where)["roles"]
        except (OSError, KeyError, ValueError):
            counts = None
    held = None
    if counts is not None and heldout_split:
        try:
            held = np.load(where / "heldout_counts.npy")
        except OSError:
            held = None
    if counts is None or counts.shape != (target.vocab_size,):
        t0 = time.perf_counter()
        corpus = load_corpus(dataset, split=split, seed=split_seed)
        encoded = _encode_upto(corpus, target, max_tokens, max_len)
        counts, rule = count_tokens(encoded, target.vocab_size)
        if heldout_split and heldout_split != split:
            held_corpus = _heldout_corpus(dataset, heldout_split, split_seed)
            if held_corpus is not None and len(held_corpus):
                held, _ = count_tokens(_encode_upto(held_corpus, target, None, max_len, cap=HELDOUT_VOCAB_TOKENS),
                                       target.vocab_size)
        if use_cache:
            with atomic_directory(where, overwrite=True) as tmp:
                np.save(tmp / "counts.npy", counts)
                if held is not None:
                    np.save(tmp / "heldout_counts.npy", held)
                write_manifest(tmp, {**params, "roles": rule, "counted_tokens": int(counts.sum()),
                                     "seconds": round(time.perf_counter() - t0, 2)})
    ids, coverage = select_vocab(counts, draft_vocab_size)
    info = {"dataset": dataset, "split": split, "split_seed": split_seed, "max_tokens": max_tokens,
            "max_len": max_len, "distinct_ids": int((counts > 0).sum()), "key": key}
    if held is not None and held.sum():
        info.update(heldout_split=heldout_split, heldout_tokens=int(held.sum()),
                    heldout_coverage=round(float(held[ids].sum() / held.sum()), 6))
    return DraftVocab(ids, counts[ids], coverage, int(counts.sum()), str(rule), info)


def _heldout_corpus(dataset: str, split: str, split_seed: int) -> Any:
    """The held-out split the coverage is measured on: the same corpus, or for a generated one
    (``sharegpt@model#key``: the key names the training entry only) the model's default held-out
    entry, else the source corpus's own held-out split; None when none exists."""
    from ..data import load_corpus, parse_generated_name

    names = [dataset]
    parsed = parse_generated_name(dataset)
    if parsed is not None:
        base, model, _ = parsed
        names = [f"{base}@{model}", base]
    for name in names:
        try:
            return load_corpus(name, split=split, seed=split_seed)
        except Exception:  # noqa: BLE001 - a corpus without that split: try the next, else no coverage
            continue
    return None


def _encode_upto(corpus: Any, target: Target, max_tokens: int | None, max_len: int,
                 cap: int = DEFAULT_VOCAB_TOKENS) -> list[Encoded]:
    """``max_tokens`` tokens exactly (an error if the corpus holds fewer), or with None the whole
    corpus up to ``cap`` tokens."""
    from ..data import encode, encode_budget

    if max_tokens is not None:
        return encode_budget(corpus, target.tokenizer, target.has_chat_template, max_tokens, max_len)
    out, total = [], 0
    for ex in corpus.examples:
        enc = encode(ex, target.tokenizer, target.has_chat_template, max_len)
        if len(enc) >= 2:
            out.append(enc)
            total += len(enc)
        if total >= cap:
            break
    return out


__all__ = ["DraftVocab", "build_draft_vocab", "check_draft_vocab_size", "count_tokens", "select_vocab"]
