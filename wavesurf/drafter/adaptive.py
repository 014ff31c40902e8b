"""Adaptive draft length: choose the chain length and confidence threshold a head runs at from
measured costs, so that it is never run at a setting slower than plain decoding.

A cycle that drafts ``d`` tokens costs one verify forward of ``d + 1`` tokens plus the draft-head
forwards that produced them (one per level; one more when drafting stopped early because the next
token's path probability fell below ``min_confidence``). :class:`CostModel` holds those costs
measured on this machine for one target (``measure_costs``), and HF ``generate``'s time per token.
``choose_setting`` replays calibration cycles (a chain of the longest length drafted with no
threshold: the cumulative draft log-probs of its tokens and how many the target accepted) under
every candidate (draft length, threshold) and keeps the one with the most tokens per second; when
no candidate beats plain one-token decoding, the choice is plain decoding (``draft_len = 0``).

The replay keeps each calibration cycle's accepted count and cuts it to what a shorter or
thresholded draft would have proposed; it ignores that cycles would start at other positions, so
its tokens/s is an estimate, checked against the timed run by ``wavesurf bench``.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DecodeError, is_int
from .baselines import greedy_generate
from .decode import SpeculativeDecoder, check_confidence
from .generation import DecodeResult
from .guard import DraftGuard
from .head import DraftHead
from .tree import TreeSpec

if TYPE_CHECKING:
    from ..models import Target

#: thresholds on the drafted path's probability tried by :func:`choose_setting`
DEFAULT_THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: how much faster (a fraction of plain decoding's seconds per token) a drafting setting must be predicted
#: to be chosen over plain decoding: larger than the timing noise of two separately measured costs
MIN_GAIN = 0.02


@dataclass(frozen=True)
class CostModel:
    """Costs measured on one target, machine and thread count (seconds).

    ``verify_seconds[K-1]``: one verify forward of K tokens (root + K-1 drafts) over a cached
    context, K = 1..len; ``draft_step_seconds``: one draft-head forward; ``hf_token_seconds``: HF
    greedy ``generate``'s time per generated token (the baseline); ``plain_token_seconds``: our
    one-token-per-forward loop's."""

    model: str
    threads: int
    context: int
    verify_seconds: tuple[float, ...]
    draft_step_seconds: float
    hf_token_seconds: float
    plain_token_seconds: float

    @property
    def max_draft_len(self) -> int:
        return len(self.verify_seconds) - 1

    def cycle_seconds(self, drafted: int, draft_steps: int) -> float:
        return self.verify_seconds[drafted] + draft_steps * self.draft_step_seconds

    def check_fits(self, target: Target, draft_len: int) -> None:
        """Refuse a cost model measured on another model or too short for ``draft_len``."""
        if self.model != target.name:
            raise DecodeError(f"the cost model was measured on {self.model!r}, not on the target {target.name!r}; "
                              "measure it on this target (measure_costs)")
        if draft_len > self.max_draft_len:
            raise DecodeError(f"draft_len={draft_len} needs verify costs up to {draft_len + 1} tokens; the cost "
                              f"model has them up to {len(self.verify_seconds)} (max draft_len {self.max_draft_len})")

    def describe(self) -> dict:
        d = asdict(self)
        d["verify_seconds"] = [round(x, 5) for x in self.verify_seconds]
        for k in ("draft_step_seconds", "hf_token_seconds", "plain_token_seconds"):
            d[k] = round(d[k], 5)
        d["verify_over_hf_step"] = [round(x / self.hf_token_seconds, 3) for x in self.verify_seconds]
        d["draft_step_over_hf_step"] = round(self.draft_step_seconds / self.hf_token_seconds, 3)
        return d


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after one warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


#: cost models measured in this process, by what they depend on (see measure_costs)
_MEASURED: dict[tuple, CostModel] = {}


def _costs_key(target: Target, head: DraftHead, *settings: Any) -> tuple:
    """What a cost model depends on: the loaded target, the machine's threads, the head's shape
    (not its weights: a draft step costs the same whatever the head learned) and the settings."""
    c = head.config
    return (id(target.model), target.name, str(target.device), torch.get_num_threads(), type(head).__name__,
            c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.draft_vocab_size, str(head.fc.weight.dtype), *settings)


@torch.inference_mode()
def measure_costs(target: Target, head: DraftHead, max_draft_len: int = 6, *, context: int = 256,
                  repeats: int = 5, packed: bool | None = None, reuse: bool = True) -> CostModel:
    """Time verify forwards of 1..max_draft_len+1 tokens (the decoder's own path, packed weights
    included), one draft-head step over ``context`` cached positions, and HF ``generate`` / our
    plain loop per token on a ``context``-token prompt. Takes 5-15 seconds on 2 CPU cores.

    ``reuse``: return the cost model measured earlier in this process for the same target, thread
    count, head shape and settings (a speed table tunes many heads of one shape; their costs are
    the machine's, not the heads'). ``reuse=False`` measures again and keeps the new one."""
    if not is_int(max_draft_len, 1):
        raise DecodeError(f"max_draft_len={max_draft_len!r} must be an integer >= 1")
    if not is_int(context, 8):
        raise DecodeError(f"context={context!r} must be an integer >= 8")
    key = _costs_key(target, head, max_draft_len, context, repeats, packed)
    if reuse and key in _MEASURED:
        return _MEASURED[key]
    _MEASURED[key] = costs = _measure(target, head, max_draft_len, context, repeats, packed)
    return costs


def _measure(target: Target, head: DraftHead, max_draft_len: int, context: int, repeats: int,
             packed: bool | None) -> CostModel:
    from .baselines import hf_generate
    from .target_runner import TargetRunner

    dec = SpeculativeDecoder(target, head, TreeSpec.chain(max_draft_len), packed=packed)
    dev = target.device
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, min(5000, target.vocab_size), (context,), generator=gen).to(dev)
    runner = TargetRunner(target, head.config.layer_ids, dec.packed)
    try:
        runner.forward(ctx, torch.arange(context, device=dev), None)
        verify = []
        for k in range(1, max_draft_len + 2):
            ids, pos = ctx[:k], context + torch.arange(k, device=dev)

            def one(ids=ids, pos=pos):
                runner.forward(ids, pos, None, verify=True)
                runner.keep(context, torch.zeros(0, dtype=torch.long, device=dev))

            verify.append(median_seconds(one, repeats))
    finally:
        runner.close()
    cfg, h = head.config, head.config.hidden_size
    kv = torch.zeros(1, cfg.num_key_value_heads, context, cfg.head_dim, device=dev, dtype=head.fc.weight.dtype)
    hid = torch.randn(1, 1, h, generator=gen).to(dev, head.fc.weight.dtype)
    pos = torch.full((1, 1), context, device=dev)
    mask = torch.ones(1, 1, 1, context + 1, dtype=torch.bool, device=dev)
    draft = median_seconds(lambda: head.step(hid, hid, pos, mask, kv, kv), repeats)
    def per_token(fn) -> float:  # (time of n tokens - time of 1 token) / (n - 1), EOS-aware
        fn(ctx.tolist(), 1)
        firsts, laters = [], []
        for _ in range(max(1, repeats // 2)):
            one, many = fn(ctx.tolist(), 1), fn(ctx.tolist(), 24)
            if many.new_tokens > 1:
                firsts.append(one.seconds)
                laters.append((many.seconds, many.new_tokens))
        if not laters:
            raise DecodeError("the cost measurement's generation ended after one token; use a longer context")
        first = statistics.median(firsts)
        return statistics.median(max(sec - first, 1e-9) / (n - 1) for sec, n in laters)

    hf, plain = per_token(lambda ids, n: hf_generate(target, ids, n)), per_token(lambda ids, n: greedy_generate(target, ids, n))
    return CostModel(target.name, torch.get_num_threads(), context, tuple(verify), draft, hf, plain)


@dataclass(frozen=True)
class AdaptiveSetting:
    """What a head runs at: a chain of ``draft_len`` tokens (0 = plain decoding) cut where the
    path probability falls below ``min_confidence``; the replayed estimate of its speed."""

    draft_len: int
    min_confidence: float
    predicted_tokens_per_cycle: float
    predicted_speedup: float  # over HF greedy generate, from the cost model
    candidates: list[dict] = field(default_factory=list, repr=False)

    @property
    def plain(self) -> bool:
        return self.draft_len == 0

    def describe(self) -> dict:
        return {"draft_len": self.draft_len, "min_confidence": self.min_confidence,
                "predicted_tokens_per_cycle": round(self.predicted_tokens_per_cycle, 4),
                "predicted_speedup": round(self.predicted_speedup, 4)}


def _replay(cycles: Sequence[tuple], draft_len: int, min_confidence: float,
            costs: CostModel) -> tuple[float, float]:
    """(tokens per cycle, seconds per token) of a setting replayed over calibration cycles
    ((scores, accepted) or (scores, accepted, tokens drafted by n-gram lookup))."""
    min_logp = math.log(min_confidence) if min_confidence > 0 else -math.inf
    tokens = seconds = 0.0
    for cycle in cycles:
        scores, accepted = cycle[0], cycle[1]
        looked_up = cycle[2] if len(cycle) > 2 else 0
        drafted = 0
        for s in scores[:draft_len]:
            if s < min_logp:
                break
            drafted += 1
        steps = drafted if drafted == draft_len else drafted + 1  # the step that fell below still ran
        if looked_up >= draft_len:  # lookup filled the chain: only the draft-KV extend ran
            steps = 1
        tokens += min(accepted, drafted) + 1
        seconds += costs.cycle_seconds(drafted, steps)
    return tokens / len(cycles), seconds / tokens


def choose_setting(cycles: Sequence[tuple], costs: CostModel, max_draft_len: int,
                   thresholds: Sequence[float] = DEFAULT_THRESHOLDS, min_gain: float = MIN_GAIN) -> AdaptiveSetting:
    """The (draft length, threshold) with the fewest seconds per token over the calibration
    ``cycles`` ((cumulative draft log-probs of a chain of at least ``max_draft_len`` tokens, accepted
    count[, tokens of it drafted by n-gram lookup]) each), or plain decoding unless a setting is predicted at least ``min_gain`` (a
    fraction) faster. The margin matters: a head that drafts nothing costs a one-token verify plus
    a draft step per token, which equals plain decoding up to timing noise, since the two are
    measured separately."""
    if not cycles:
        raise DecodeError("no calibration cycles: run the decoder on at least one calibration prompt")
    if not is_int(max_draft_len, 1) or max_draft_len > costs.max_draft_len:
        raise DecodeError(f"max_draft_len={max_draft_len!r} must be an integer in [1, {costs.max_draft_len}] "
                          "(the cost model's verify lengths)")
    for t in thresholds:
        check_confidence(t)
    short = min(len(c[0]) for c in cycles)
    if short < max_draft_len:
        raise DecodeError(f"calibration cycles drafted {short} tokens, fewer than max_draft_len={max_draft_len}; "
                          "calibrate with a chain of max_draft_len and min_confidence=0")
    if not 0 <= min_gain < 1:
        raise DecodeError(f"min_gain={min_gain!r} must be a fraction in [0, 1)")
    plain = costs.plain_token_seconds
    best = AdaptiveSetting(0, 0.0, 1.0, costs.hf_token_seconds / plain)
    best_sec = plain * (1.0 - min_gain)  # what a drafting setting must beat
    candidates = [{"draft_len": 0, "min_confidence": 0.0, "tokens_per_cycle": 1.0,
                   "predicted_speedup": round(costs.hf_token_seconds / plain, 4)}]
    for d in range(1, max_draft_len + 1):
        for t in thresholds:
            tpc, sec = _replay(cycles, d, t, costs)
            candidates.append({"draft_len": d, "min_confidence": t, "tokens_per_cycle": round(tpc, 4),
                               "predicted_speedup": round(costs.hf_token_seconds / sec, 4)})
            if sec < best_sec:
                best_sec, best = sec, AdaptiveSetting(d, float(t), tpc, costs.hf_token_seconds / sec)
    return AdaptiveSetting(best.draft_len, best.min_confidence, best.predicted_tokens_per_cycle,
                           best.predicted_speedup, candidates)


def calibration_cycles(results: Sequence[DecodeResult]) -> list[tuple]:
    """(draft scores, accepted[, tokens drafted by lookup]) per cycle of chain runs (tie-replay
    cycles included as run)."""
    out: list[tuple] = []
    for r in results:
        if r.lookup_drafted:
            out.extend(zip(r.draft_scores, r.accepted, r.lookup_drafted))
        else:
            out.extend(zip(r.draft_scores, r.accepted))
    return out


class PlainDecoder:
    """The ``draft_len = 0`` choice: our one-forward-per-token loop (HF's own step), with the
    decoder interface."""

    def __init__(self, target: Target):
        self.target = target

    def generate(self, input_ids: Any, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> DecodeResult:
        r = greedy_generate(self.target, input_ids, max_new_tokens, temperature, seed)
        r.method = "eagle3-plain"
        return r


def tune(target: Target, head: DraftHead, calibration_ids: Sequence[Sequence[int]], *, max_draft_len: int = 6,
         max_new_tokens: int = 64, costs: CostModel | None = None,
         thresholds: Sequence[float] = DEFAULT_THRESHOLDS, lookup_ngram: int = 0) -> tuple[AdaptiveSetting, CostModel]:
    """Measure costs (unless given), run a chain of ``max_draft_len`` without threshold on the
    calibration prompts (n-gram lookup first when ``lookup_ngram > 0``), and choose the setting
    (see the module docstring)."""
    if not calibration_ids:
        raise DecodeError("tune needs at least one calibration prompt")
    if costs is None:
        costs = measure_costs(target, head, max_draft_len)
    costs.check_fits(target, max_draft_len)
    dec = SpeculativeDecoder(target, head, TreeSpec.chain(max_draft_len), lookup_ngram=lookup_ngram)
    runs = [dec.generate(ids, max_new_tokens) for ids in calibration_ids]
    return choose_setting(calibration_cycles(runs), costs, max_draft_len, thresholds), costs


def adaptive_decoder(target: Target, head: DraftHead, setting: AdaptiveSetting, lookup_ngram: int = 0,
                     costs: CostModel | None = None) -> Any:
    """The decoder a setting describes: plain decoding, or a thresholded chain (n-gram lookup
    first when ``lookup_ngram > 0``, as it was tuned). With ``costs`` (the cost model it was tuned
    with) a :class:`~wavesurf.drafter.guard.DraftGuard` pauses the head where it loses at run time."""
    if setting.plain:
        return PlainDecoder(target)
    return SpeculativeDecoder(target, head, TreeSpec.chain(setting.draft_len), min_confidence=setting.min_confidence,
                              lookup_ngram=lookup_ngram, guard=DraftGuard(costs) if costs is not None else None)


__all__ = ["AdaptiveSetting", "CostModel", "DEFAULT_THRESHOLDS", "PlainDecoder", "adaptive_decoder",
           "calibration_cycles", "choose_setting", "measure_costs", "median_seconds", "tune"]
