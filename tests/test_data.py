import gzip
import json

import numpy as np
import pytest

from wavesurf.data import (
    ROLE_ASSISTANT, ROLE_TEMPLATE, ROLE_TEXT, ROLE_USER, SPLITS, Example, encode, encode_budget,
    iter_json_array, load_corpus, make_batches, read_user_jsonl, split_of, split_sizes,
)
from wavesurf.errors import BudgetError, DatasetError


def test_sharegpt_reader_on_cut_off_file(sharegpt):
    info = sharegpt.info
    assert 17_000 < info["conversations"] < 18_000
    assert info["items_read"] == info["conversations"] + info["skipped_empty_or_duplicate"]
    assert all(e.messages and all(m["content"].strip() for m in e.messages) for e in sharegpt.examples)
    assert {m["role"] for e in sharegpt.examples[:500] for m in e.messages} <= {"user", "assistant", "system"}


def test_json_array_stream_stops_at_truncated_item(tmp_path):
    items = [{"id": str(i), "v": "x" * (i * 7)} for i in range(50)]
    text = json.dumps(items)
    cut = text[: text.index('"id": "37"') + 4]  # inside item 37
    path = tmp_path / "cut.json"
    path.write_text(cut)
    got = list(iter_json_array(path, chunk_chars=64))  # tiny chunks: items span reads
    assert got == items[:37]
    path.write_text(text)
    assert list(iter_json_array(path, chunk_chars=50)) == items
    path.write_text('{"a": 1}')
    with pytest.raises(DatasetError, match="JSON array"):
        list(iter_json_array(path))


def test_splits_disjoint_stable_and_grouped(sharegpt):
    parts = {s: {e.id for e in load_corpus("sharegpt", split=s).examples} for s in SPLITS}
    assert not parts["train"] & parts["stats"] and not parts["train"] & parts["heldout"] and not parts["stats"] & parts["heldout"]
    assert sum(map(len, parts.values())) == len(sharegpt)
    sizes = split_sizes(sharegpt)
    assert abs(sizes["train"] / len(sharegpt) - 0.8) < 0.02 and abs(sizes["heldout"] / len(sharegpt) - 0.1) < 0.02
    # stable across runs: a hash of the id, not of file order or process state
    assert [split_of(e.id) for e in sharegpt.examples[:200]] == [split_of(e.id) for e in sharegpt.examples[:200]]
    assert split_of("QWJhYvA_0") == split_of("QWJhYvA_7")  # parts of one chat stay together
    other = [split_of(e.id, seed=1) for e in sharegpt.examples[:300]]
    assert other != [split_of(e.id) for e in sharegpt.examples[:300]]


def test_split_only_for_sharegpt():
    with pytest.raises(DatasetError, match="only 'sharegpt' has splits"):
        load_corpus("mt-bench", split="train")
    with pytest.raises(DatasetError, match="not one of"):
        load_corpus("sharegpt", split="test")


def test_mt_bench_and_humaneval():
    mt = load_corpus("mt-bench")
    assert len(mt) == 80 and all(len(e.messages) == 2 and e.meta["category"] for e in mt.examples)
    he = load_corpus("humaneval")
    assert len(he) == 164 and he.examples[0].id == "HumanEval/0"


def test_unknown_dataset_lists_names():
    with pytest.raises(DatasetError, match="sharegpt, mt-bench, humaneval"):
        load_corpus("sharegtp")


@pytest.mark.parametrize("content, match", [
    (None, "does not exist"),
    ("", "is empty"),
    ("\n\n", "is empty"),
    ('{"text": "ok"}\n{"text": "broken"\n', "line 2: not valid JSON"),
    ('[1, 2]\n', "line 1: expected a JSON object"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}\n', "role 'bot'; allowed roles: system, user, assistant"),
    ('{"messages": []}\n', "non-empty list"),
    ('{"text": 3}\n', "'text' must be a non-empty string"),
    ('{"prompt": "x"}\n', "expected a 'messages' or a 'text' field"),
])
def test_user_jsonl_errors(tmp_path, content, match):
    path = tmp_path / "corpus.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError, match=match) as err:
        load_corpus(str(path))
    assert str(path) in str(err.value)


def test_user_jsonl_reads_both_kinds(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n\n')
        fh.write('{"id": "doc", "text": "plain text"}\n')
    ex = read_user_jsonl(path)
    assert [e.id for e in ex] == ["c.jsonl/1", "doc"] and ex[1].text == "plain text"


def test_encode_roles_follow_messages(smollm):
    tok = smollm.tokenizer
    ex = Example("t", messages=[{"role": "user", "content": "What is two plus two?"},
                                {"role": "assistant", "content": "Two plus two is four."}])
    enc = encode(ex, tok, True, 512)
    assert tok.decode(enc.input_ids[enc.roles == ROLE_ASSISTANT]).strip() == "Two plus two is four."
    assert tok.decode(enc.input_ids[enc.roles == ROLE_USER]).strip() == "What is two plus two?"
    assert enc.roles[0] == ROLE_TEMPLATE and tok.decode(enc.input_ids[:1]) == "<|im_start|>"
    short = encode(ex, tok, True, 10)
    assert len(short) == 10 and np.array_equal(short.input_ids, enc.input_ids[:10])
    plain = encode(ex, tok, False, 512)  # base-model fallback format
    assert tok.decode(plain.input_ids).startswith("User: What is two plus two?")
    assert tok.decode(plain.input_ids[plain.roles == ROLE_ASSISTANT]).strip() == "Two plus two is four."
    text = encode(Example("d", text="Just text."), tok, True, 512)
    assert set(text.roles.tolist()) <= {ROLE_TEXT, ROLE_TEMPLATE}


def test_budget_is_exact_and_checked(smollm):
    mt = load_corpus("mt-bench")
    enc = encode_budget(mt, smollm.tokenizer, True, 3000, max_len=128)
    assert sum(len(e) for e in enc) == 3000 and max(len(e) for e in enc) <= 128
    for bad in (0, -5):
        with pytest.raises(BudgetError, match="positive integer"):
            encode_budget(mt, smollm.tokenizer, True, bad)
    with pytest.raises(BudgetError) as err:
        encode_budget(mt, smollm.tokenizer, True, 10**7, max_len=128)
    assert "ask for at most" in str(err.value) and "'mt-bench'" in str(err.value)


def test_budget_for_role_positions_matches_brute_force(smollm):
    """The budget whose tokens hold n assistant positions: encode_budget of it holds exactly n
    (position 0 never counts), and a corpus with fewer gives all its tokens."""
    from wavesurf.data import tokens_for_role_positions

    mt = load_corpus("mt-bench")
    tok = smollm.tokenizer
    for n in (1, 37, 400):
        budget = tokens_for_role_positions(mt, tok, True, n, role=ROLE_USER, max_len=128)
        enc = encode_budget(mt, tok, True, budget, max_len=128)
        assert sum(int((e.roles[1:] == ROLE_USER).sum()) for e in enc) == n
        assert enc[-1].roles[-1] == ROLE_USER  # the budget ends on the n-th position, not after it
    everything = sum(len(e) for e in (encode(x, tok, True, 128) for x in mt.examples) if len(e) >= 2)
    assert tokens_for_role_positions(mt, tok, True, 10**7, role=ROLE_USER, max_len=128) == everything
    assert tokens_for_role_positions(mt, tok, True, 5, role=ROLE_ASSISTANT, max_len=128) == everything  # none


def test_batches_respect_token_limit(smollm):
    enc = encode_budget(load_corpus("humaneval"), smollm.tokenizer, True, 5000, max_len=200)
    batches = make_batches(enc, batch_tokens=1000)
    assert sorted(e.example_id for b in batches for e in b) == sorted(e.example_id for e in enc)
    assert all(max(map(len, b)) * len(b) <= 1000 for b in batches)
    assert [[e.example_id for e in b] for b in batches] == [[e.example_id for e in b] for b in make_batches(enc, 1000)]
