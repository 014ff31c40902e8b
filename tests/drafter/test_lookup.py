"""N-gram lookup drafts: the incremental index against a backward search, and refusals."""
from __future__ import annotations

import numpy as np
import pytest

from wavesurf.drafter.lookup import NgramIndex, check_lookup_ngram, lookup_drafts
from wavesurf.errors import DecodeError


def propose(context, draft_len, max_ngram=3, per_match=2):
    """Brute force: the latest earlier occurrence of the longest suffix, searched backwards; a
    match of n tokens proposes at most per_match * n tokens."""
    for n in range(max_ngram, 0, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if n <= len(context) and context[start:start + n] == context[len(context) - n:]:
                k = draft_len if per_match is None else min(draft_len, per_match * n)
                return context[start + n:start + n + k]
    return []


@pytest.mark.parametrize("seed,max_ngram,per_match", [(0, 3, 2), (1, 3, None), (2, 1, 3), (3, 5, 1)])
def test_lookup_drafts_match_a_backward_search(seed, max_ngram, per_match):
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, 6, size=80).tolist()  # a small alphabet: many repeats
    drafts = lookup_drafts(seq, 4, max_ngram, per_match)
    assert drafts == [propose(seq[:p + 1], 4, max_ngram, per_match) for p in range(len(seq))]
    assert lookup_drafts([5], 3) == [[]]
    if per_match == 2:  # a 1-token match proposes at most 2 tokens, and some did
        assert 2 in {len(d) for d in drafts} and max(len(d) for d in drafts) == 4


def test_index_grows_in_chunks_like_a_decoder():
    """Extending by whole cycles (as SpeculativeDecoder commits tokens) gives the same drafts as
    one token at a time."""
    rng = np.random.default_rng(7)
    seq = rng.integers(0, 4, size=60).tolist()
    index, p = NgramIndex(3, seq[:5]), 5
    while p < len(seq):
        assert index.draft(6) == propose(seq[:p], 6)
        step = int(rng.integers(1, 5))
        index.extend(seq[p:p + step])
        p += step
    assert NgramIndex(2, [1, 2, 3, 1, 2]).draft(4) == [3, 1, 2]  # the copy may run up to the end of the context
    assert NgramIndex(3, [5, 6, 1, 2, 3, 4, 9, 1, 2]).draft(6) == [3, 4, 9, 1]  # a 2-token match: at most 4
    assert NgramIndex(3, [7, 1, 2, 8, 7]).draft(6) == [1, 2]  # a 1-token match: at most 2
    assert NgramIndex(3, [7, 1, 2, 8, 7], per_match=None).draft(6) == [1, 2, 8, 7]
    with pytest.raises(DecodeError, match="per_match=0"):
        NgramIndex(3, per_match=0)


@pytest.mark.parametrize("bad", [-1, 9, 2.5, True, "3"])
def test_bad_ngram_is_refused(bad):
    with pytest.raises(DecodeError, match="lookup_ngram="):
        check_lookup_ngram(bad)
    with pytest.raises(DecodeError, match="lookup_ngram=0"):
        NgramIndex(0)
