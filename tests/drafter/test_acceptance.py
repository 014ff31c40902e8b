"""Offline acceptance: the cycle walk, the bigram floor, intervals, refusals, and that offline tau
equals the tau of real chain decoding with SpeculativeDecoder on the same greedy continuations."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.drafter.test_lookup import propose as _propose
from wavesurf.data import ROLE_ASSISTANT, ROLE_TEMPLATE, ROLE_USER, Encoded
from wavesurf.drafter.acceptance import (
    Acceptance,
    AcceptanceError,
    acceptance_from_hits,
    bootstrap_tau,
    continuations,
    count_bigrams,
    leading_hits,
    lookup_acceptance,
    offline_acceptance,
    offline_acceptances,
    walk_chain,
)

LAYERS = [2, 15, 27]


# ---- the walk ----------------------------------------------------------------------------------
def _simulate(hits: np.ndarray, length: int, draft_len: int) -> list[int]:
    """Brute force: step through the continuation token by token, as a decoder would."""
    cycles, root = [], 0  # root: index of the continuation token the cycle starts from
    while root < length - 1:
        accepted = 0
        for j in range(draft_len):
            if root + 1 + j > length - 1 or not hits[root, j]:
                break
            accepted += 1
        commit = min(accepted + 1, length - 1 - root)
        cycles.append(commit)
        root += commit
    return cycles


@pytest.mark.parametrize("seed", range(5))
def test_walk_matches_token_by_token_simulation(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        length = int(rng.integers(1, 40))
        d = int(rng.integers(1, 6))
        hits = rng.random((max(length - 1, 0), d)) < rng.random()
        for j in range(d):  # no token to predict beyond the end
            hits[max(0, length - 1 - j):, j] = False
        for dl in range(1, d + 1):
            assert walk_chain(hits, length, dl) == _simulate(hits, length, dl)
            assert sum(walk_chain(hits, length, dl)) == length - 1


def test_walk_extremes_and_leading_hits():
    assert leading_hits(np.array([[1, 1, 0], [0, 1, 1], [1, 1, 1]], dtype=bool)).tolist() == [2, 0, 3]
    never = np.zeros((9, 4), dtype=bool)
    assert walk_chain(never, 10, 4) == [1] * 9  # tau 1: one token per forward
    always = np.ones((9, 4), dtype=bool)
    assert walk_chain(always, 10, 4) == [5, 4]  # D + 1 per forward, cut at the end
    assert walk_chain(np.zeros((0, 2), dtype=bool), 1, 2) == []  # the prefill produced everything
    with pytest.raises(AcceptanceError, match="draft_len=5 is longer"):
        walk_chain(never, 10, 5)
    with pytest.raises(AcceptanceError, match="draft_len=0"):
        walk_chain(never, 10, 0)


def test_continuations_are_cut_where_the_stored_token_is_not_greedy():
    #          pos: 0  1  2  3  4  5  6  7
    loss = np.array([0, 0, 1, 1, 1, 0, 1, 1], dtype=bool)
    ids = np.array([5, 6, 7, 8, 9, 1, 2, 3])
    argmax = np.array([0, 7, 8, 4, 0, 2, 3, 0])  # greedy after pos 1 is 7 (ok), after 2 is 8 (ok), after 3 is 4 != 9
    conts, cut = continuations(loss, ids, argmax, sequence=3)
    assert [(c.sequence, c.start, c.length) for c in conts] == [(3, 2, 2), (3, 6, 2)]
    assert cut == 1


def test_bigram_table_and_its_hits():
    enc = [Encoded("a", np.array([1, 2, 3, 2, 3, 2, 4]), np.array([ROLE_USER] + [ROLE_ASSISTANT] * 6, dtype=np.int8)),
           Encoded("b", np.array([1, 2, 4, 0]), np.array([ROLE_TEMPLATE, ROLE_ASSISTANT, ROLE_ASSISTANT, ROLE_TEMPLATE],
                                                          dtype=np.int8))]
    table = count_bigrams(enc, vocab_size=6)
    # after 2: 3 twice, 4 twice -> tie to the smaller id 3; after 3: 2; after 1: 2; 0/4/5 never seen (4->0 is template)
    assert table.next_token.tolist() == [-1, 2, 3, 2, -1, -1]
    ids = torch.tensor([[1, 2, 3, 2, 4]])
    batch = {"input_ids": ids, "target_argmax": torch.tensor([[2, 3, 2, 4, 0]]),
             "attention_mask": torch.ones(1, 5, dtype=torch.bool)}
    hits = table.hits(batch, 2)[0]
    # step j at position t drafts next_token[x_{t+1+j}] and compares with argmax[t+1+j]
    for t in range(5):
        for j in range(2):
            p = t + 1 + j
            want = p < 5 and int(table.next_token[int(ids[0, p])]) == int(batch["target_argmax"][0, p])
            assert bool(hits[t, j]) == want


def _acc(name, committed, cycles):
    c, n = np.asarray(committed, dtype=np.int64)[:, None], np.asarray(cycles, dtype=np.int64)[:, None]
    return Acceptance(name, 1, [str(i) for i in range(len(c))], c, n, np.zeros(1, np.int64), np.ones(1, np.int64),
                      int(c.sum()), 0)


def test_bootstrap_paired_difference():
    rng = np.random.default_rng(0)
    cycles = rng.integers(5, 30, size=60)
    base = _acc("base", cycles * 1.5, cycles)
    same = bootstrap_tau([base], 1, baseline=[base])
    assert same["diff"] == 0 and same["diff_lo"] == 0 and same["diff_hi"] == 0
    better = _acc("better", np.round(cycles * (1.6 + rng.normal(0, 0.05, 60))), cycles)
    out = bootstrap_tau([better], 1, baseline=[base], n_boot=500)
    assert out["tau_lo"] <= out["tau"] <= out["tau_hi"]
    assert 0 < out["diff_lo"] <= out["diff"] <= out["diff_hi"]
    # pairing removes the between-sequence spread: the difference's interval is narrower than tau's
    assert out["diff_hi"] - out["diff_lo"] < out["tau_hi"] - out["tau_lo"]
    with pytest.raises(AcceptanceError, match="different continuations"):
        bootstrap_tau([better], 1, baseline=[_acc("other", cycles[:10] * 2, cycles[:10])])
    with pytest.raises(AcceptanceError, match="at least 2 held-out sequences"):
        bootstrap_tau([_acc("one", [3], [2])], 1)
    with pytest.raises(AcceptanceError, match="n_boot"):
        bootstrap_tau([base], 1, n_boot=5)


# ---- on the real model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_store(smollm, tmp_path_factory):
    """A feature store of SmolLM2's own greedy answers (HF ``generate``, batch 1) to 4 prompts."""
    from wavesurf.data import load_corpus
    from wavesurf.drafter.features import FeatureSettings, build_feature_store

    tok = smollm.tokenizer
    rows = []
    for ex in load_corpus("sharegpt", split="heldout").examples:
        user = next((m["content"] for m in ex.messages or [] if m["role"] == "user"), "")
        if not 10 < len(user) < 300:
            continue
        msgs = [{"role": "user", "content": user}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = smollm.model.generate(ids, max_new_tokens=32, do_sample=False)
        rows.append({"messages": msgs + [{"role": "assistant",
                                          "content": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}]})
        if len(rows) == 4:
            break
    where = tmp_path_factory.mktemp("greedy")
    path = where / "greedy.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tokens = 0
    from wavesurf.data import encode
    from wavesurf.data import load_corpus as lc

    for ex in lc(str(path)).examples:
        tokens += len(encode(ex, tok, True, 256))
    return build_feature_store(smollm, FeatureSettings(dataset=str(path), split=None, max_tokens=tokens, max_len=256,
                                                       batch_tokens=1024, layer_ids=LAYERS), path=where / "store",
                               progress=False)


def test_offline_tau_equals_real_chain_decoding(smollm, greedy_store, tmp_cache):
    """A head trained briefly on the same continuations (partly right) decodes them with
    SpeculativeDecoder; the tau it reports equals the offline walk's for every draft length."""
    from wavesurf.drafter.decode import SpeculativeDecoder, TreeSpec
    from wavesurf.drafter.head import load_head
    from wavesurf.drafter.train import TrainSettings, train_drafter

    res = train_drafter(smollm, greedy_store, LAYERS,
                        TrainSettings(ttt_steps=3, draft_vocab_size=1024, batch_tokens=1024, max_steps=12, lr=3e-3,
                                      warmup_steps=2, checkpoint_every=1000), progress=False)
    head, _ = load_head(res.out_dir, smollm)
    acc = offline_acceptance(smollm, head, greedy_store, max_draft_len=3, batch_tokens=1024, progress=False)
    assert acc.cut_tokens == 0 and acc.positions > 100
    assert 1.2 < acc.tau(3) < 3.5, acc.summary()  # partly right: a non-trivial check
    for dl in (1, 3):
        assert _decoded_tau(SpeculativeDecoder(smollm, head, TreeSpec.chain(dl)), greedy_store) == \
            pytest.approx(acc.tau(dl), rel=0.01)
    # cached: the same head on the same store is read back
    again = offline_acceptance(smollm, head, greedy_store, max_draft_len=3, batch_tokens=1024, progress=False)
    assert np.array_equal(again.committed, acc.committed)
    # n-gram lookup first, the head after it: offline equals real decoding too
    both = offline_acceptance(smollm, head, greedy_store, max_draft_len=3, lookup_ngram=3, batch_tokens=1024,
                              progress=False)
    assert both.info["lookup_ngram"] == 3 and not np.array_equal(both.cycles, acc.cycles)
    drafted = []
    for dl in (1, 3):
        tau = _decoded_tau(SpeculativeDecoder(smollm, head, TreeSpec.chain(dl), lookup_ngram=3), greedy_store, drafted)
        assert tau == pytest.approx(both.tau(dl), rel=0.01)
    assert sum(drafted) > 0  # lookup proposed tokens (the answers repeat), and the walk counted them
    with pytest.raises(AcceptanceError, match="lookup_ngram=9"):
        offline_acceptance(smollm, head, greedy_store, lookup_ngram=9, progress=False)
    # both scores from one unroll of the head equal the separate ones, and land under their cache keys
    alone, first = offline_acceptances(smollm, head, greedy_store, max_draft_len=3, lookup_ngrams=(0, 3),
                                       batch_tokens=1024, use_cache=False, progress=False)
    for one, separate in ((alone, acc), (first, both)):
        assert np.array_equal(one.committed, separate.committed) and np.array_equal(one.cycles, separate.cycles)
        assert np.array_equal(one.step_hits, separate.step_hits)
    fresh = offline_acceptances(smollm, head, greedy_store, max_draft_len=4, lookup_ngrams=(0, 2),
                                batch_tokens=1024, progress=False)
    for n, one in zip((0, 2), fresh):
        again = offline_acceptance(smollm, head, greedy_store, max_draft_len=4, lookup_ngram=n, batch_tokens=1024,
                                   progress=False)
        assert again.info["seconds"] == one.info["seconds"]  # read back from the cache, not recomputed
        assert np.array_equal(again.committed, one.committed)
    # scoring more draft lengths leaves tau at the shorter ones, and their intervals, as they were
    # (the default profile scores 1-4 where it scored 1-6)
    for dl in (1, 3):
        assert fresh[0].tau(dl) == acc.tau(dl)
        assert bootstrap_tau([fresh[0]], dl, n_boot=200) == bootstrap_tau([acc], dl, n_boot=200)
    with pytest.raises(AcceptanceError, match="2 names for 1 lookup"):
        offline_acceptances(smollm, head, greedy_store, lookup_ngrams=(0,), names=("a", "b"), progress=False)


def _decoded_tau(decoder, store, lookup_drafted=None) -> float:
    """tau of real chain decoding of every continuation of ``store``, checked token for token."""
    batches = store.batches(LAYERS, 1024)
    committed = cycles = 0
    for bi in range(len(batches)):
        b = batches[bi]
        for r, s in enumerate(batches.plan[batches.order[bi]]):
            n = s.length
            for c in continuations(b["loss_mask"][r, :n].numpy(), b["input_ids"][r, :n].numpy(),
                                   b["target_argmax"][r, :n].numpy(), 0)[0]:
                run = decoder.generate(b["input_ids"][r, : c.start], max_new_tokens=c.length)
                assert run.tokens == b["input_ids"][r, c.start : c.start + c.length].tolist()
                committed += sum(run.cycle_tokens)
                cycles += len(run.cycle_tokens)
                if lookup_drafted is not None:
                    lookup_drafted.extend(run.lookup_drafted)
    return committed / cycles


def test_lookup_tau_equals_a_cycle_by_cycle_lookup_decode(smollm, greedy_store, tmp_cache):
    """Decode every held-out continuation cycle by cycle with lookup drafts (prompt + answer so
    far as the context; the prefill gives the first token): tokens per cycle equal the floor's
    offline tau at every draft length."""
    acc = lookup_acceptance(smollm, greedy_store, max_draft_len=4, batch_tokens=1024, progress=False)
    batches = greedy_store.batches(LAYERS, 1024)
    for dl in (1, 2, 4):
        committed = cycles = 0
        for bi in range(len(batches)):
            b = batches[bi]
            for r, s in enumerate(batches.plan[batches.order[bi]]):
                n = s.length
                ids = b["input_ids"][r, :n].tolist()
                for c in continuations(b["loss_mask"][r, :n].numpy(), b["input_ids"][r, :n].numpy(),
                                       b["target_argmax"][r, :n].numpy(), 0)[0]:
                    i = 1  # the first token comes from the prefill, as in SpeculativeDecoder
                    while i < c.length:
                        draft = _propose(ids[: c.start + i], dl)
                        hit = 0
                        while hit < len(draft) and i + hit < c.length and draft[hit] == ids[c.start + i + hit]:
                            hit += 1
                        step = min(hit + 1, c.length - i)
                        committed, cycles, i = committed + step, cycles + 1, i + step
        assert committed / cycles == pytest.approx(acc.tau(dl), rel=1e-9)
    assert acc.tau(4) > 1.0  # greedy answers of a small model repeat: lookup drafts something
    with pytest.raises(AcceptanceError, match="max_ngram=0"):
        lookup_acceptance(smollm, greedy_store, max_ngram=0, progress=False)


def test_refusals(smollm, greedy_store, tmp_cache):
    from wavesurf.bench import untrained_head

    with pytest.raises(Exception, match=r"layer ids \[1\] are not in feature store"):
        offline_acceptance(smollm, untrained_head(smollm, [1, 15, 27], 256), greedy_store, progress=False)
    with pytest.raises(AcceptanceError, match="max_draft_len=0"):
        offline_acceptance(smollm, untrained_head(smollm, LAYERS, 256), greedy_store, max_draft_len=0, progress=False)
    other = type(greedy_store).__new__(type(greedy_store))
    other.__dict__.update(greedy_store.__dict__)
    other.params = {**greedy_store.params, "dataset": "sharegpt@gemma3-270m"}
    with pytest.raises(AcceptanceError, match="generated by 'gemma3-270m', not by the target 'smollm2-135m'"):
        offline_acceptance(smollm, untrained_head(smollm, LAYERS, 256), other, progress=False)


def test_acceptance_from_hits_counts_steps():
    hits = np.array([[1, 1], [1, 0], [0, 0]], dtype=bool)  # continuation of 4 tokens: roots 0..2
    hits[2, 1] = False
    acc = acceptance_from_hits("x", [(0, hits, 4)], ["s0"], 2)
    assert acc.step_total.tolist() == [3, 2] and acc.step_hits.tolist() == [2, 1]
    assert acc.tau(1) == pytest.approx(3 / 2)  # roots 0 (hit: commit 2), 2 (miss: commit 1)
    assert acc.tau(2) == pytest.approx(3 / 1)  # root 0: both hit -> commit 3 = everything
