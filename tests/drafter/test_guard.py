"""The run-time guard: a window of losing drafting cycles pauses the head for a number of committed
tokens, a losing probe doubles the pause up to its cap, a winning window resets it; a guarded
decode stays token-identical to HF greedy, extends the head's cache over the paused positions
without gaps when it drafts again, and bad settings are refused before model work."""
from __future__ import annotations

import pytest

from wavesurf.bench import BenchError, BenchSettings, bench_prompts, prompt_ids, untrained_head
from wavesurf.drafter.adaptive import CostModel
from wavesurf.drafter.decode import DecodeError, SpeculativeDecoder, TreeSpec, hf_generate
from wavesurf.drafter.guard import DraftGuard
from wavesurf.drafter.oracle import OracleHead

NEW = 40


def costs(verify=(1.0, 1.5, 2.0, 2.5, 3.0), draft=0.1, model="m") -> CostModel:
    return CostModel(model, 1, 256, tuple(verify), draft, 1.0, 1.0)


def test_losing_windows_pause_and_probes_double_the_pause():
    g = DraftGuard(costs(), window=2, pause=3, max_pause=8)
    # a chain of 3 costs 2.5 + 3 * 0.1 = 2.8 s; committing 2 tokens = 1.4 s/token > 1.0 plain
    g.observe(3, 3, 2)
    assert not g.paused  # half a window is no verdict
    g.observe(3, 3, 2)
    assert g.paused and g.pauses == 1
    for _ in range(3):  # paused: one token per plain cycle counts the pause down
        assert g.paused
        g.observe(0, 0, 1)
    assert not g.paused and g.paused_tokens == 3
    g.observe(3, 3, 2)
    g.observe(3, 3, 2)  # the probe loses: pause 6
    assert g.paused
    g.observe(2, 0, 6)  # a lookup draft while paused commits several tokens at once
    assert not g.paused and g.paused_tokens == 9
    g.observe(3, 3, 2)
    g.observe(3, 3, 2)  # loses again: 12 capped at 8
    g.observe(0, 0, 7)
    assert g.paused
    g.observe(0, 0, 1)
    assert not g.paused
    g.observe(3, 3, 4)  # 2.8 / 4 = 0.7 s/token: the probe wins and the pause length resets
    g.observe(3, 3, 4)
    assert not g.paused
    g.observe(3, 3, 1)  # the window slides: (2.8 + 2.8) / 5 tokens loses, a pause of the reset length
    for _ in range(3):
        assert g.paused
        g.observe(0, 0, 1)
    assert not g.paused and g.pauses == 4
    g.reset()
    assert not g.paused and g.paused_tokens == 0 and g.pauses == 0


def test_cycles_that_break_even_keep_drafting():
    g = DraftGuard(costs(verify=(1.0, 1.1, 1.2)), window=4)
    for _ in range(20):
        g.observe(2, 2, 2)  # (1.2 + 0.2) / 2 = 0.7 s/token
        g.observe(0, 1, 1)  # a cycle cut by the threshold: 1.1 s for one token
    assert not g.paused and g.pauses == 0


def test_bad_guard_settings_are_refused(smollm):
    for name in ("window", "pause", "max_pause"):
        for bad in (0, -1, 1.5, "4", True):
            with pytest.raises(DecodeError, match=name):
                DraftGuard(costs(), **{name: bad})
    with pytest.raises(DecodeError, match="max_pause=4 is smaller than pause=8"):
        DraftGuard(costs(), pause=8, max_pause=4)
    with pytest.raises(DecodeError, match="not a cost model"):
        DraftGuard({"verify_seconds": (1.0,)})
    head = untrained_head(smollm)
    with pytest.raises(DecodeError, match="measured on 'm'"):
        SpeculativeDecoder(smollm, head, TreeSpec.chain(2), guard=DraftGuard(costs()))
    with pytest.raises(DecodeError, match="max draft_len 4"):
        SpeculativeDecoder(smollm, head, TreeSpec.chain(6), guard=DraftGuard(costs(model=smollm.name)))
    with pytest.raises(DecodeError, match="not a chain"):
        SpeculativeDecoder(smollm, head, TreeSpec(3, 2, 4), guard=DraftGuard(costs(model=smollm.name)))
    with pytest.raises(DecodeError, match="must be a DraftGuard"):
        SpeculativeDecoder(smollm, head, TreeSpec.chain(2), guard=costs(model=smollm.name))
    with pytest.raises(BenchError, match="guard='yes'"):
        BenchSettings(n_prompts=1, mode="auto", guard="yes")


@pytest.fixture(scope="module")
def prompt(smollm):
    p = bench_prompts("humaneval", 1, smollm)[0]
    ids = prompt_ids(smollm, p, [])
    return ids, hf_generate(smollm, ids, NEW).tokens


def _record_extends(dec: SpeculativeDecoder) -> list[tuple[int, int, int]]:
    """(draft cache length before, start position, positions) of every draft extend."""
    calls: list[tuple[int, int, int]] = []
    real = dec._draft_extend

    def extend(feats, next_tokens, start):
        calls.append((0 if dec.dk is None else int(dec.dk.shape[2]), int(start), len(next_tokens)))
        return real(feats, next_tokens, start)

    dec._draft_extend = extend
    return calls


@pytest.mark.parametrize("lookup_ngram", [0, 3])
def test_a_losing_head_is_paused_and_the_output_stays_hf_greedy(smollm, prompt, lookup_ngram):
    """An untrained head accepts nothing: with the guard most tokens are decoded without it, the
    head's cache is extended over the paused positions without gaps, and the tokens are HF's."""
    ids, ref = prompt
    head = untrained_head(smollm)
    dec = SpeculativeDecoder(smollm, head, TreeSpec.chain(3), lookup_ngram=lookup_ngram,
                             guard=DraftGuard(costs(model=smollm.name), window=2, pause=4))
    calls = _record_extends(dec)
    r = dec.generate(ids, NEW)
    assert r.tokens == ref
    assert r.paused_tokens >= NEW // 2
    assert len(calls) < len(r.cycle_tokens) / 2  # the head ran in a minority of cycles
    assert any(n > 4 for _, _, n in calls[1:])  # a resumed head caught up over a pause at once
    for (cache, start, n), (nxt_cache, nxt_start, _) in zip(calls, calls[1:]):
        assert cache == start and nxt_cache == start + n and nxt_start == start + n  # no gap, no repeat
    if lookup_ngram:
        assert len(r.lookup_drafted) == len(r.accepted)


def test_a_winning_head_is_never_paused(smollm, prompt):
    ids, ref = prompt
    head = OracleHead(smollm, list(map(int, ids)) + ref)
    guard = DraftGuard(costs(model=smollm.name), window=2, pause=4)
    r = SpeculativeDecoder(smollm, head, TreeSpec.chain(4), guard=guard).generate(ids, NEW)
    assert r.tokens == ref and r.paused_tokens == 0 and guard.pauses == 0 and r.tau > 4
