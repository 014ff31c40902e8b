"""N-gram lookup drafts: propose the tokens that followed the latest earlier occurrence of the
context's last n tokens (n = ``max_ngram`` .. 1, the longest that occurs).

This is prompt lookup decoding's rule (huggingface/transformers
``src/transformers/generation/candidate_generator.py``, ``PromptLookupCandidateGenerator``), except
that the most recent occurrence wins and the index is kept incrementally, so drafting at every
cycle of a decode costs a few dictionary operations instead of a scan of the context.

Why a drafter needs it: a small target's greedy answers repeat themselves (loops, earlier turns
restated), and a head trained on a CPU budget cannot learn to copy; lookup drafts the repeats
exactly. :class:`~wavesurf.drafter.decode.SpeculativeDecoder` (``lookup_ngram``) drafts a chain's
first tokens by lookup where the context has a match and lets the EAGLE-3 head continue after
them; :func:`~wavesurf.drafter.acceptance.offline_acceptance` scores the same rule exactly.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import DecodeError, is_int

#: the longest n-gram matched by default (prompt lookup's usual setting)
DEFAULT_LOOKUP_NGRAM = 3
#: the longest n-gram a setting may ask for
MAX_LOOKUP_NGRAM = 8
#: a match of n tokens proposes at most this many tokens per matched token. Short matches are
#: weak evidence: on SmolLM2-135M's greedy MT-bench answers the first proposed token was right
#: 17% of the time after a 1-token match, 38% after 2 and 81% after 3, so long drafts after short
#: matches mostly buy verify cost. A cap proportional to n (not to the draft length) keeps the
#: drafts of a shorter draft length prefixes of the longer ones, which the offline walk needs.
DEFAULT_PER_MATCH = 2


def check_lookup_ngram(lookup_ngram: Any, *, allow_zero: bool = True, tree: Any = None, name: str = "lookup_ngram",
                       error: type[Exception] = DecodeError) -> int:
    """Refuse an n-gram length that is not an integer in 0..:data:`MAX_LOOKUP_NGRAM` (0 = no lookup
    drafting), and lookup drafting with a ``tree`` (a :class:`~wavesurf.drafter.tree.TreeSpec`)
    that is not a chain; ``name`` and ``error`` are how the caller's setting and refusal are called."""
    lo = 0 if allow_zero else 1
    if not is_int(lookup_ngram, lo, MAX_LOOKUP_NGRAM):
        raise error(f"{name}={lookup_ngram!r} must be an integer in {lo}..{MAX_LOOKUP_NGRAM}: the longest context "
                    "suffix matched by n-gram lookup drafting" + (" (0 = no lookup, the head alone)" if allow_zero else ""))
    if lookup_ngram and tree is not None and not tree.is_chain:
        raise error(f"{name}={lookup_ngram} drafts a chain's first tokens; it needs a chain (mode 'chain' or 'auto', "
                    f"TreeSpec.chain(n)), not the tree {tree.describe()}; or set {name}=0")
    return int(lookup_ngram)


class NgramIndex:
    """Latest occurrence of every n-gram (n = 1..``max_ngram``) of a growing token sequence that
    already has a following token; :meth:`draft` proposes the continuation of the current end,
    at most ``per_match`` tokens per matched token (None: no such cap)."""

    def __init__(self, max_ngram: int = DEFAULT_LOOKUP_NGRAM, tokens: Iterable[int] = (),
                 per_match: int | None = DEFAULT_PER_MATCH):
        self.max_ngram = check_lookup_ngram(max_ngram, allow_zero=False)
        if per_match is not None and not is_int(per_match, 1):
            raise DecodeError(f"per_match={per_match!r} must be a positive integer or None (no cap)")
        self.per_match = per_match
        self.tokens: list[int] = []
        self.match_length = 0  # n of the match the last draft() used (0: none)
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram + 1)]
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for tok in tokens:
            self.tokens.append(int(tok))
            length = len(self.tokens)
            for n in range(1, self.max_ngram + 1):  # n-grams that now have a following token
                start = length - 1 - n
                if start >= 0:
                    self._last[n][tuple(self.tokens[start:start + n])] = start

    def draft(self, max_draft_len: int) -> list[int]:
        """Up to ``max_draft_len`` (and ``per_match`` x n) tokens that followed the latest earlier
        occurrence of the longest suffix of n <= ``max_ngram`` tokens that occurred before; [] if
        none did."""
        seq, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, length), 0, -1):
            start = self._last[n].get(tuple(seq[length - n:]))
            if start is not None:
                k = max_draft_len if self.per_match is None else min(max_draft_len, self.per_match * n)
                self.match_length = n
                return seq[start + n:min(start + n + k, length)]
        self.match_length = 0
        return []


def lookup_drafts(tokens: Iterable[int], max_draft_len: int, max_ngram: int = DEFAULT_LOOKUP_NGRAM,
                  per_match: int | None = DEFAULT_PER_MATCH) -> list[list[int]]:
    """Entry p: the lookup draft after ``tokens[:p + 1]`` (what a decoder holding that context drafts)."""
    index = NgramIndex(max_ngram, per_match=per_match)
    out: list[list[int]] = []
    for tok in tokens:
        index.extend((tok,))
        out.append(index.draft(max_draft_len))
    return out


__all__ = ["DEFAULT_LOOKUP_NGRAM", "DEFAULT_PER_MATCH", "MAX_LOOKUP_NGRAM", "NgramIndex", "check_lookup_ngram", "lookup_drafts"]
