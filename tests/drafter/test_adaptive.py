"""Adaptive draft length and the cheaper verify: the choice follows the costs and the calibration
cycles, a confidence threshold cuts drafts and stays lossless, the packed verify weights give the
plain kernels' logits to float32 rounding and leave the model as it was, bad settings are refused
before model work."""
from __future__ import annotations

import math

import pytest
import torch

from wavesurf.bench import BenchError, BenchSettings, bench_prompts, prompt_ids, run_bench, untrained_head
from wavesurf.drafter.adaptive import (
    CostModel, _replay, adaptive_decoder, calibration_cycles, choose_setting, measure_costs, tune,
)
from wavesurf.drafter.decode import DecodeError, SpeculativeDecoder, TreeSpec, hf_generate
from wavesurf.drafter.oracle import OracleHead
from wavesurf.drafter.target_runner import TargetRunner
from wavesurf.packed import PackedLinears, packing_available

NEW = 24


def costs(verify=(1.0, 1.3, 1.4, 1.5, 1.6), draft=0.05, hf=1.0, plain=1.0, model="m") -> CostModel:
    return CostModel(model, 1, 256, tuple(verify), draft, hf, plain)


def _brute(cycles, d, thr, c):
    """Seconds per token of (d, thr), written out directly."""
    tok = sec = 0.0
    for scores, acc in cycles:
        probs = [math.exp(s) for s in scores[:d]]
        drafted = next((i for i, p in enumerate(probs) if p < thr), len(probs))
        steps = drafted if drafted == d else drafted + 1
        tok += min(acc, drafted) + 1
        sec += c.verify_seconds[drafted] + steps * c.draft_step_seconds
    return sec / tok


def test_choice_is_the_fastest_replayed_setting():
    c = costs()
    lp = [math.log(p) for p in (0.9, 0.8, 0.3, 0.2)]
    cycles = [(lp, 2), (lp, 3), (lp, 1), (lp, 2)]
    s = choose_setting(cycles, c, 4)
    best = min((_brute(cycles, d, t, c), d, t) for d in range(1, 5) for t in (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5,
                                                                               0.6, 0.7, 0.8, 0.9))
    assert s.draft_len >= 1 and s.predicted_speedup == pytest.approx(c.hf_token_seconds / best[0])
    assert s.predicted_speedup == pytest.approx(1.0 / _brute(cycles, s.draft_len, s.min_confidence, c))
    assert any(row["draft_len"] == 0 for row in s.candidates)


def test_nothing_accepted_means_plain_decoding():
    cycles = [([math.log(0.9)] * 3, 0)] * 5
    s = choose_setting(cycles, costs(), 3)
    assert s.plain and s.draft_len == 0
    assert s.predicted_speedup == pytest.approx(1.0)
    dec = adaptive_decoder(None, None, s)
    assert type(dec).__name__ == "PlainDecoder"


def test_a_setting_that_drafts_nothing_does_not_beat_plain_on_timing_noise():
    """A threshold above every draft's confidence means a one-token verify and a draft step per
    token: plain decoding measured separately. Timed 1% faster by chance, it is still not chosen;
    a real gain above the margin is."""
    cycles = [([math.log(0.01)] * 2, 0)] * 5
    noisy = costs(verify=(0.95, 1.3, 1.4), draft=0.04)  # 0.95 + 0.04 = 0.99 s/token < plain 1.0
    assert choose_setting(cycles, noisy, 2).plain
    assert not choose_setting(cycles, noisy, 2, min_gain=0.0).plain  # without the margin noise wins
    assert not choose_setting(cycles, costs(verify=(0.9, 1.3, 1.4), draft=0.04), 2).plain  # 4% is a gain
    for bad in (-0.1, 1.0):
        with pytest.raises(DecodeError, match="min_gain"):
            choose_setting(cycles, noisy, 2, min_gain=bad)


def test_threshold_cuts_the_unlikely_tail():
    """Confident tokens are accepted, unsure ones never: the chosen threshold separates them."""
    sure, unsure = math.log(0.9), math.log(0.05)
    cycles = [([sure, sure + unsure, sure + 2 * unsure], 1), ([unsure, 2 * unsure, 3 * unsure], 0)] * 5
    s = choose_setting(cycles, costs(verify=(1.0, 1.2, 1.6, 2.0)), 3)
    assert s.draft_len >= 1 and 0.05 < s.min_confidence <= 0.9
    assert s.predicted_tokens_per_cycle == pytest.approx(1.5)
    no_threshold = next(r for r in s.candidates if r["draft_len"] == s.draft_len and r["min_confidence"] == 0)
    assert s.predicted_speedup > no_threshold["predicted_speedup"]


def test_cycles_that_lookup_filled_cost_no_draft_steps():
    """A chain lookup proposed entirely runs only the draft-KV extend; lookup tokens score 0, so a
    threshold never cuts them."""
    c = costs(verify=(1.0, 1.2, 1.3, 1.4), draft=0.1)
    lp = [0.0, 0.0, 0.0]  # three tokens proposed by lookup
    tpc, sec = _replay([(lp, 3, 3)], 3, 0.9, c)
    assert tpc == 4 and sec == pytest.approx((1.4 + 0.1) / 4)
    tpc, sec = _replay([(lp, 3)], 3, 0.9, c)  # without the lookup count: three head steps
    assert sec == pytest.approx((1.4 + 0.3) / 4)
    _, sec = _replay([(lp, 1, 2)], 3, 0.0, c)  # lookup proposed 2 of 3: the head ran every level
    assert sec == pytest.approx((1.4 + 0.3) / 2)


def test_bad_settings_are_refused():
    c = costs()
    cycles = [([0.0] * 4, 1)]
    for bad in (1.0, -0.1, 1.5, True, "0.5"):
        with pytest.raises(DecodeError, match="min_confidence"):
            choose_setting(cycles, c, 2, thresholds=[bad])
    with pytest.raises(DecodeError, match="max_draft_len"):
        choose_setting(cycles, c, 5)  # the cost model knows verify lengths up to 5 tokens = 4 drafts
    with pytest.raises(DecodeError, match="fewer than max_draft_len"):
        choose_setting([([0.0], 1)], c, 2)
    with pytest.raises(DecodeError, match="no calibration cycles"):
        choose_setting([], c, 2)


def test_decoder_refusals_before_model_work(smollm):
    head = untrained_head(smollm)
    for bad in (1.0, -0.5, float("nan"), True):
        with pytest.raises(DecodeError, match="min_confidence"):
            SpeculativeDecoder(smollm, head, TreeSpec.chain(2), min_confidence=bad)
    with pytest.raises(DecodeError, match="packed"):
        SpeculativeDecoder(smollm, head, TreeSpec.chain(2), packed="yes")
    with pytest.raises(DecodeError, match="measured on 'other'"):
        costs(model="other").check_fits(smollm, 2)
    with pytest.raises(DecodeError, match="max draft_len 4"):
        costs(model=smollm.name).check_fits(smollm, 6)
    with pytest.raises(BenchError, match="n_calibration"):
        BenchSettings(n_prompts=1, mode="auto", n_calibration=0)
    with pytest.raises(BenchError, match="mode='adaptive' is not one of 'chain', 'tree', 'auto'"):
        BenchSettings(n_prompts=1, mode="adaptive")
    with pytest.raises(BenchError, match="exclude each other"):
        BenchSettings(n_prompts=1, mode="auto", tree=TreeSpec.chain(2))
    with pytest.raises(BenchError, match="must be a TreeSpec"):
        BenchSettings(n_prompts=1, tree="chain")
    with pytest.raises(DecodeError, match="total_tokens=3 is smaller than depth=5"):
        BenchSettings(mode="tree", depth=5, total_tokens=3)


@pytest.fixture(scope="module")
def prompt(smollm):
    p = bench_prompts("mt-bench", 1, smollm)[0]
    ids = prompt_ids(smollm, p, [])
    return ids, hf_generate(smollm, ids, NEW).tokens


def test_confidence_threshold_is_lossless_and_cuts_drafts(smollm, prompt):
    ids, ref = prompt
    head = OracleHead(smollm, list(map(int, ids)) + ref, miss_every=3)
    free = SpeculativeDecoder(smollm, head, TreeSpec.chain(4)).generate(ids, NEW)
    assert free.tokens == ref and free.tau > 1.5
    assert len(free.draft_scores) == len(free.accepted) and all(len(s) == 4 for s in free.draft_scores)
    # the oracle's right token has probability ~0.985: a threshold above it drafts nothing
    none = SpeculativeDecoder(smollm, head, TreeSpec.chain(4), min_confidence=0.99).generate(ids, NEW)
    assert none.tokens == ref and none.tau == pytest.approx(1.0) and max(none.accepted) == 0
    some = SpeculativeDecoder(smollm, head, TreeSpec.chain(4), min_confidence=0.5).generate(ids, NEW)
    assert some.tokens == ref and 1.0 < some.tau <= free.tau + 1e-9


def test_packed_verify_matches_plain_kernels_and_restores_the_model(smollm):
    if not packing_available(smollm.model):
        pytest.skip("this PyTorch has no oneDNN linear")
    packed = PackedLinears(smollm.model, rows=10, select="all")
    ctx = torch.arange(100, 140)
    logits = {}
    for name, p in (("plain", None), ("packed", packed)):
        runner = TargetRunner(smollm, [2, 15], p)
        try:
            with torch.inference_mode():
                runner.forward(ctx[:30], torch.arange(30), None)
                logits[name], feats = runner.forward(ctx[30:], torch.arange(30, 40), None, verify=True)
        finally:
            runner.close()
        assert feats.shape == (10, 2 * smollm.hidden_size)
    diff = float((logits["plain"] - logits["packed"]).abs().max())
    assert 0 < diff < 1e-3  # other kernel, same numbers to float32 rounding, inside the near-tie margin
    assert not any("forward" in m.__dict__ for m in smollm.model.modules())


def test_measure_costs_and_tune_on_the_real_model(smollm, prompt):
    ids, ref = prompt
    head = OracleHead(smollm, list(map(int, ids)) + ref, miss_every=2)
    c = measure_costs(smollm, head, 2, context=16, repeats=1)
    assert len(c.verify_seconds) == 3 and all(x > 0 for x in c.verify_seconds)
    assert c.draft_step_seconds > 0 and c.hf_token_seconds > 0 and c.plain_token_seconds > 0
    assert c.describe()["threads"] == torch.get_num_threads()
    # measured once per process for this target, head shape and settings; reuse=False measures again
    assert measure_costs(smollm, head, 2, context=16, repeats=1) is c
    again = measure_costs(smollm, head, 2, context=16, repeats=1, reuse=False)
    assert again is not c and measure_costs(smollm, head, 2, context=16, repeats=1) is again
    assert measure_costs(smollm, head, 1, context=16, repeats=1) is not again  # other settings
    setting, _ = tune(smollm, head, [ids], max_draft_len=2, max_new_tokens=NEW, costs=c)
    plain = next(r for r in setting.candidates if r["draft_len"] == 0)
    assert setting.predicted_speedup >= plain["predicted_speedup"] - 1e-4  # candidates are rounded to 4 places
    out = adaptive_decoder(smollm, head, setting).generate(ids, NEW)
    assert out.tokens == ref
    cycles = calibration_cycles([out]) if not setting.plain else []
    assert all(len(s) <= 2 for s, _ in cycles)


def test_packed_shapes_are_chosen_by_measurement_and_bad_settings_refused(smollm):
    if not packing_available(smollm.model):
        pytest.skip("this PyTorch has no oneDNN linear")
    packed = PackedLinears(smollm.model, rows=5, repeats=3)
    shapes = {tuple(m.weight.shape) for m in smollm.model.modules() if type(m) is torch.nn.Linear}
    assert set(packed.ratios) == shapes and all(r > 0 for r in packed.ratios.values())
    assert {tuple(m.weight.shape) for m in packed.weights} == {s for s, r in packed.ratios.items() if r <= 0.95}
    assert packed.threads == torch.get_num_threads() and packed.rows == 5
    for bad, word in (({"rows": 1}, "rows=1"), ({"rows": True}, "rows=True"), ({"select": "some"}, "select='some'")):
        with pytest.raises(DecodeError, match=word):
            PackedLinears(smollm.model, **bad)


def test_bench_auto_runs_an_untrained_head_at_its_cheapest_cycle(smollm):
    """A head that accepts nothing commits one token per cycle whatever it drafts: auto mode
    measures the costs, replays the calibration prompt and chooses the cheapest cycle. That is
    plain decoding where a multi-row verify costs more than a one-row step (MKL on an Intel Xeon);
    where packed multi-row verify is cheaper than HF's one-row kernel (an AMD EPYC) it is a short
    chain verified for its lower cost, and it must then be predicted past the MIN_GAIN margin.
    Either way the output stays lossless."""
    from wavesurf.drafter.adaptive import MIN_GAIN

    settings = BenchSettings(n_prompts=1, max_new_tokens=12, mode="auto", draft_len=2, n_calibration=1,
                             methods=["hf_generate", "eagle3"])
    run = run_bench(smollm, untrained_head(smollm), "mt-bench", settings, use_cache=False, progress=False)
    choice, measured = run.summary["adaptive"]["choice"], run.summary["adaptive"]["costs"]
    assert choice["predicted_tokens_per_cycle"] == pytest.approx(1.0)
    hf, plain = measured["hf_token_seconds"], measured["plain_token_seconds"]
    if choice["draft_len"] == 0:  # plain decoding runs at our plain loop's measured speed
        assert choice["predicted_speedup"] == pytest.approx(hf / plain, rel=1e-3)
    else:
        cycle = hf / choice["predicted_speedup"]
        assert cycle < plain * (1 - MIN_GAIN) + 1e-5
        assert cycle <= measured["verify_seconds"][choice["draft_len"]] + 2 * measured["draft_step_seconds"] + 1e-5
    assert measured["model"] == smollm.name and len(measured["verify_seconds"]) == 3
    assert all(s > 0 for s in measured["verify_seconds"]) and measured["draft_step_seconds"] > 0
    spec = run.summary["methods"]["eagle3"]
    assert spec["lossless"] == "1/1" and spec["speedup_ci95"] is None  # one prompt: no interval


def test_bench_takes_a_tree_spec_as_the_shape_options_would_give_it(smollm):
    head = untrained_head(smollm)
    common = dict(n_prompts=1, max_new_tokens=4, methods=["hf_generate", "eagle3"], warmup=0)
    by_spec = run_bench(smollm, head, "mt-bench", BenchSettings(tree=TreeSpec.chain(2), **common), use_cache=False,
                        progress=False)
    by_options = run_bench(smollm, head, "mt-bench", BenchSettings(mode="chain", draft_len=2, **common),
                           use_cache=False, progress=False)
    assert by_spec.summary["settings"] == by_options.summary["settings"]
    assert by_spec.summary["methods"]["eagle3"]["lossless"] == "1/1"
