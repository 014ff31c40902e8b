"""Speculative decoding on the real targets: token-identical to HF greedy ``generate`` for chain
and tree drafting, tau counted right, bad settings refused, the sampling rule exact in law.

Two drafters: an untrained head (what losslessness must survive) and the oracle head of
:mod:`wavesurf.drafter.oracle`, which makes long accepted paths, non-first siblings and
non-contiguous cache rows happen, which an untrained head never does.
"""
from __future__ import annotations

import pytest
import torch

from wavesurf.bench import BenchPrompt, bench_prompts, prompt_ids
from wavesurf.drafter.decode import (
    DEFAULT_TIE_EPS, DecodeError, SpeculativeDecoder, TreeSpec, DraftTree, default_tie_eps, greedy_generate, hf_generate,
    make_tree, speculative_generate,
)
from wavesurf.drafter.head import DraftConfig, DraftHead, DrafterError, init_head
from wavesurf.drafter.oracle import OracleHead

NEW = 32


def untrained(target, vocab=None):
    n = target.n_layers
    head = init_head(DraftHead(DraftConfig.for_target(target, [2, n // 2, n - 3], 8192)))
    head.set_vocab(torch.arange(8192) if vocab is None else vocab)
    return head.eval()


@pytest.fixture(scope="module")
def prompts(smollm):
    mt = bench_prompts("mt-bench", 2, smollm)
    he = bench_prompts("humaneval", 1, smollm)
    return [mt[0], he[0], mt[1]]


def _ids(target, p: BenchPrompt):
    return prompt_ids(target, p, [])


_REFS: dict = {}


def hf_ref(target, ids, n: int) -> list[int]:
    """HF greedy output, computed once per (target, prompt) for the whole module (greedy outputs
    of different lengths are prefixes of each other)."""
    key = (target.name, tuple(map(int, ids)))
    if key not in _REFS or _REFS[key][0] < n:
        _REFS[key] = (max(n, NEW), hf_generate(target, ids, max(n, NEW)).tokens)
    return _REFS[key][1][:n]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_untrained_head_is_lossless_smollm(smollm, prompts, mode):
    head = untrained(smollm)
    dec = SpeculativeDecoder(smollm, head, make_tree(mode, draft_len=4, depth=4, top_k=3, total_tokens=10))
    for p in prompts[:1] if mode == "chain" else prompts[1:2]:  # an MT-bench and a HumanEval prompt
        ids = _ids(smollm, p)
        ref = hf_ref(smollm, ids, NEW)
        got = dec.generate(ids, NEW)
        assert got.tokens == ref, (p.id, mode)
        assert got.n_target_forwards == 1 + len(got.cycle_tokens)
        assert sum(got.cycle_tokens) == len(got.tokens) - 1


def test_lookup_drafting_is_lossless_and_drafts(smollm, prompts):
    """n-gram lookup first, an untrained head after it: token-identical to HF greedy, lookup
    proposes tokens on a prompt whose answer repeats, and a threshold still cuts only head tokens."""
    head = untrained(smollm)
    for min_confidence in (0.0, 0.5):
        dec = SpeculativeDecoder(smollm, head, TreeSpec.chain(4), lookup_ngram=3, min_confidence=min_confidence)
        for p in prompts[:2]:
            ids = _ids(smollm, p)
            got = dec.generate(ids, 48)
            assert got.tokens == hf_ref(smollm, ids, 48), (p.id, min_confidence)
            assert len(got.lookup_drafted) == len(got.accepted) and max(got.lookup_drafted) <= 4
            assert got.tau >= 1.0
    code = got  # the last run: prompts[1], HumanEval, whose code repeats its own names
    assert sum(code.lookup_drafted) > 0 and sum(code.accepted) > 0
    sampled = SpeculativeDecoder(smollm, head, TreeSpec.chain(3), lookup_ngram=2).generate(_ids(smollm, prompts[0]), 16,
                                                                                           temperature=0.8, seed=1)
    assert len(sampled.tokens) == 16
    with pytest.raises(DecodeError, match="needs a chain"):
        SpeculativeDecoder(smollm, head, make_tree("tree", depth=3, top_k=2, total_tokens=4), lookup_ngram=3)
    with pytest.raises(DecodeError, match="lookup_ngram=-1"):
        SpeculativeDecoder(smollm, head, lookup_ngram=-1)


def test_plain_loop_matches_hf(smollm, prompts):
    ids = _ids(smollm, prompts[2])
    ref = hf_generate(smollm, ids, NEW)
    got = greedy_generate(smollm, ids, NEW)
    assert got.tokens == ref.tokens
    assert got.n_target_forwards == len(got.tokens) == ref.n_target_forwards
    assert got.tau == 1.0


@pytest.mark.parametrize("mode,miss", [("chain", 0), ("chain", 4), ("tree", 4)])
def test_oracle_head_accepts_and_stays_lossless(smollm, prompts, mode, miss):
    ids = _ids(smollm, prompts[0])
    ref = hf_ref(smollm, ids, NEW)
    head = OracleHead(smollm, list(map(int, ids)) + ref, miss_every=miss)
    got = speculative_generate(smollm, head, ids, NEW, mode=mode, draft_len=4, depth=4, top_k=2, total_tokens=8)
    assert got.tokens == ref
    assert got.n_target_forwards == 1 + len(got.cycle_tokens)
    if miss == 0:  # every draft right: 4 accepted + bonus per cycle (the last cycle may be cut)
        assert all(c == 5 for c in got.cycle_tokens[:-1]) and got.tau > 4
    elif mode == "chain":  # a miss every 4th position stops the chain early
        assert 1.5 < got.tau < 5
    else:  # the tree holds the right token as the second sibling: almost every draft is accepted
        assert got.tau > 4


def test_tree_beats_chain_when_the_first_guess_misses(smollm, prompts):
    ids = _ids(smollm, prompts[1])
    ref = hf_ref(smollm, ids, 24)
    head = OracleHead(smollm, list(map(int, ids)) + ref, miss_every=3)
    chain = speculative_generate(smollm, head, ids, 24, mode="chain", draft_len=4)
    tree = speculative_generate(smollm, head, ids, 24, mode="tree", depth=4, top_k=2, total_tokens=8)
    assert chain.tokens == tree.tokens == ref
    assert tree.tau > chain.tau


def test_tau_is_one_when_every_draft_is_rejected(smollm, prompts):
    ids = _ids(smollm, prompts[0])
    ref = hf_ref(smollm, ids, 24)
    # a draft vocabulary of ids the target never emits here: every draft token is wrong
    used = set(ref) | set(map(int, ids))
    vocab = torch.tensor([i for i in range(smollm.vocab_size - 1, -1, -1) if i not in used][:8192]).sort().values
    got = speculative_generate(smollm, untrained(smollm, vocab), ids, 24, mode="tree", depth=3, top_k=2, total_tokens=5)
    assert got.tokens == ref
    assert all(a == 0 for a in got.accepted)
    assert got.tau == 1.0 and got.n_target_forwards == len(got.tokens)


def test_gemma_lossless_untrained_chain_and_oracle_tree(gemma):
    p = bench_prompts("mt-bench", 1, gemma)[0]
    ids = _ids(gemma, p)
    ref = hf_ref(gemma, ids, 24)
    got = speculative_generate(gemma, untrained(gemma), ids, 24, mode="chain", draft_len=3)
    assert got.tokens == ref
    head = OracleHead(gemma, list(map(int, ids)) + ref, miss_every=3)
    got = speculative_generate(gemma, head, ids, 24, mode="tree", depth=3, top_k=2, total_tokens=5)
    assert got.tokens == ref and got.tau > 1.5


def test_gemma_sliding_window_beyond_512_tokens(gemma):
    """Context longer than Gemma-3's 512-token window: the sliding layers need their own mask."""
    text = " ".join(f"item {i} is {i * 7 % 13}." for i in range(75))
    ids = gemma.tokenizer(text)["input_ids"]
    assert len(ids) > 512
    ref = hf_generate(gemma, ids, 12).tokens
    head = OracleHead(gemma, list(ids) + ref, miss_every=3)
    got = speculative_generate(gemma, head, ids, 12, mode="tree", depth=3, top_k=2, total_tokens=5)
    assert got.tokens == ref and got.tau > 1.5


def test_eos_stops_generation(smollm):
    ids = prompt_ids(smollm, BenchPrompt("x", ["Reply with the single word: yes"]), [])
    ref = hf_generate(smollm, ids, 64)
    assert ref.tokens[-1] == 2 and len(ref.tokens) < 64  # the chat model ends its short answer
    head = OracleHead(smollm, list(map(int, ids)) + ref.tokens)
    got = speculative_generate(smollm, head, ids, 64, mode="chain", draft_len=4)
    assert got.tokens == ref.tokens and got.stopped == "eos"


def test_bad_settings_are_refused(smollm, gemma):
    with pytest.raises(DecodeError, match="total_tokens=3 is smaller than depth=5"):
        TreeSpec(5, 2, 3)
    with pytest.raises(DecodeError, match="top_k=0"):
        make_tree("tree", depth=3, top_k=0, total_tokens=4)
    with pytest.raises(DecodeError, match="total_tokens=50 is more than the 10 candidates"):
        TreeSpec(3, 2, 50)
    with pytest.raises(DecodeError, match="mode='beam'"):
        make_tree("beam")
    with pytest.raises(DecodeError, match="draft_len=0"):
        make_tree("chain", draft_len=0)
    with pytest.raises(DrafterError, match="trained for target 'smollm2-135m'"):
        SpeculativeDecoder(gemma, untrained(smollm))
    dec = SpeculativeDecoder(smollm, untrained(smollm))
    with pytest.raises(DecodeError, match="max_new_tokens=0"):
        dec.generate([1, 2, 3], 0)
    with pytest.raises(DecodeError, match="temperature=-1"):
        dec.generate([1, 2, 3], 4, temperature=-1)
    with pytest.raises(DecodeError, match="non-empty"):
        dec.generate([], 4)


def test_sampling_rule_preserves_the_target_distribution():
    """EAGLE's multi-candidate rule on fixed logits: the law of the first two emitted tokens equals
    the target's (chi-square, 20k draws), whatever the drafts are."""
    torch.manual_seed(0)
    v, temp = 5, 0.7
    logits = torch.randn(4, v) * 1.5  # rows: root, child a, child b, grandchild under a
    logits[0] = torch.tensor([0.0, 1.0, -1.0, 0.8, -0.5])  # both drafted first tokens are likely
    tree = DraftTree(tokens=[1, 3, 2], parent=[-1, -1, 0], level=[1, 1, 2], score=[-0.1, -0.5, -0.3])
    dec = SpeculativeDecoder.__new__(SpeculativeDecoder)
    gen = torch.Generator().manual_seed(1)
    n = 20000
    counts = torch.zeros(v, v)
    row_of = {1: 1, 3: 2}  # first token -> row whose logits give the second token when accepted
    first_only = torch.zeros(v)
    for _ in range(n):
        path, bonus = dec._accept(logits, tree, temp, gen)
        toks = [tree.tokens[r - 1] for r in path[1:]] + [bonus]
        first_only[toks[0]] += 1
        if len(toks) >= 2:
            counts[toks[0], toks[1]] += 1
    p0 = torch.softmax(logits[0].double() / temp, -1)
    chi = float(((first_only - n * p0) ** 2 / (n * p0)).sum())
    assert chi < 20.5  # 99.96% quantile of chi2(4)
    for a, row in row_of.items():  # conditional law of the second token after an accepted draft
        got = counts[a]
        m = float(got.sum())
        assert m > 2000
        q = torch.softmax(logits[row].double() / temp, -1)
        chi = float(((got - m * q) ** 2 / (m * q)).sum())
        assert chi < 20.5, (a, got, m * q)


def test_near_tie_replay_reproduces_hf(smollm, prompts):
    """tie_eps so large that every position counts as a near tie: each decision is made by the
    HF-way replay, which must reproduce HF greedy exactly and be counted in the forwards."""
    ids = _ids(smollm, prompts[1])
    ref = hf_ref(smollm, ids, 12)
    head = OracleHead(smollm, list(map(int, ids)) + ref, miss_every=3)
    got = speculative_generate(smollm, head, ids, 12, mode="tree", depth=3, top_k=2, total_tokens=5, tie_eps=1e9)
    assert got.tokens == ref
    assert got.tie_rechecks > 0 and all(a == 0 for a in got.accepted)  # the replay stops at the root row
    assert got.n_target_forwards == 1 + len(got.cycle_tokens)
    assert got.tau < 1  # replay forwards count against tau


def test_near_tie_threshold_follows_the_target_dtype(smollm):
    """float32 replays near ties; half precision (bfloat16/float16 on a GPU) does not: its logits
    tie exactly and the replay cannot reproduce GPU kernels (measured on an H200, see the README of commit 111d6ab)."""
    assert default_tie_eps(smollm) == DEFAULT_TIE_EPS
    assert SpeculativeDecoder(smollm, untrained(smollm)).tie_eps == DEFAULT_TIE_EPS
    assert SpeculativeDecoder(smollm, untrained(smollm), tie_eps=0).tie_eps == 0.0
    for dtype in (torch.bfloat16, torch.float16):
        half = type("HalfTarget", (), {"model": torch.nn.Linear(2, 2).to(dtype)})()
        assert default_tie_eps(half) == 0.0
    for bad in (True, -1e-3, "1e-3"):
        with pytest.raises(DecodeError, match=f"tie_eps={bad!r} must be a number >= 0"):
            SpeculativeDecoder(smollm, untrained(smollm), tie_eps=bad)


def test_sampling_path_on_the_real_model(smollm, prompts):
    """T>0 through the real target: a near-zero temperature reproduces greedy (the sampling rule
    accepts exactly the argmax), a fixed seed reproduces a sample, and drafts are accepted."""
    ids = _ids(smollm, prompts[0])
    ref = hf_ref(smollm, ids, 24)
    head = OracleHead(smollm, list(map(int, ids)) + ref, miss_every=3)
    cold = speculative_generate(smollm, head, ids, 24, mode="tree", depth=3, top_k=2, total_tokens=5, temperature=1e-4)
    assert cold.tokens == ref and cold.tau > 1.5
    a = speculative_generate(smollm, head, ids, 24, mode="chain", draft_len=3, temperature=0.8, seed=3)
    b = speculative_generate(smollm, head, ids, 24, mode="chain", draft_len=3, temperature=0.8, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) >= 1
