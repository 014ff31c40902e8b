"""Draft vocabulary: most frequent assistant tokens of the real training split, cached."""
from __future__ import annotations

import json

import numpy as np
import pytest

from wavesurf.data import ROLE_ASSISTANT, ROLE_TEMPLATE, encode_budget, load_corpus
from wavesurf.drafter import DrafterError
from wavesurf.drafter.vocab import build_draft_vocab, count_tokens, select_vocab


def test_select_breaks_ties_by_id_pads_with_unused_ids_and_sorts():
    counts = np.array([0, 5, 3, 5, 0, 3, 1, 0])  # ids 1 and 3 tie, ids 2 and 5 tie
    ids, coverage = select_vocab(counts, 3)
    assert ids.tolist() == [1, 2, 3]  # 1, 3 (count 5), then 2 before 5
    assert coverage == pytest.approx(13 / 17)
    ids, coverage = select_vocab(counts, 7)  # 5 distinct ids seen: pad with the lowest unused (0, 4)
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert coverage == 1.0


@pytest.mark.parametrize("size", [0, -3, 49153])
def test_size_out_of_range_is_refused(smollm, size):
    with pytest.raises(DrafterError, match=f"draft_vocab_size={size}.*49152"):
        build_draft_vocab(smollm, size, max_tokens=1000, use_cache=False)


def test_counts_assistant_tokens_of_the_train_split_and_caches(smollm, isolated_cache):
    vocab = build_draft_vocab(smollm, 300, max_tokens=4000, max_len=256)
    encoded = encode_budget(load_corpus("sharegpt", split="train"), smollm.tokenizer, True, 4000, 256)
    ids = np.concatenate([e.input_ids[e.roles == ROLE_ASSISTANT] for e in encoded])
    hist = np.bincount(ids, minlength=smollm.vocab_size)
    assert vocab.roles == "assistant"
    assert vocab.counted_tokens == ids.size < 4000
    assert vocab.size == 300 and np.all(np.diff(vocab.ids) > 0)
    assert vocab.counts.tolist() == hist[vocab.ids].tolist()
    # nothing outside the vocabulary is more frequent than the rarest id inside
    outside = np.setdiff1d(np.arange(smollm.vocab_size), vocab.ids)
    assert hist[outside].max() <= vocab.counts.min()
    assert vocab.coverage == pytest.approx(vocab.counts.sum() / ids.size)
    assert 0.5 < vocab.coverage < 1.0
    # the counts are cached per corpus budget: another size reuses them
    entries = list((isolated_cache / "drafter" / "vocab").iterdir())
    assert len(entries) == 1 and json.loads((entries[0] / "wavesurf-manifest.json").read_text())["roles"] == "assistant"
    bigger = build_draft_vocab(smollm, 600, max_tokens=4000, max_len=256)
    assert len(list((isolated_cache / "drafter" / "vocab").iterdir())) == 1
    assert set(vocab.ids) <= set(bigger.ids) and bigger.coverage > vocab.coverage


def test_plain_text_corpus_counts_content_tokens(smollm, isolated_cache, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"Document {i}: the quick brown fox jumps over {i} lazy dogs."})
                              for i in range(40)))
    vocab = build_draft_vocab(smollm, 50, dataset=str(path), split=None, max_tokens=300, max_len=64)
    encoded = encode_budget(load_corpus(str(path)), smollm.tokenizer, True, 300, 64)
    counts, rule = count_tokens(encoded, smollm.vocab_size)
    assert vocab.roles == rule == "content"
    assert vocab.counted_tokens == sum(int((e.roles != ROLE_TEMPLATE).sum()) for e in encoded) == counts.sum()
