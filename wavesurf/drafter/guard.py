"""Run-time fallback to plain decoding: pause the draft head while the cycles it drafted lately
cost more per committed token than one plain forward.

Why. The adaptive setting (:mod:`~wavesurf.drafter.adaptive`) is chosen on a few calibration
prompts; on a prompt where the head and lookup accept less, the same setting runs slower than
plain decoding (measured on SmolLM2-135M: HumanEval at 0.94x of HF greedy with a setting the
replay predicted at 1.87x). :class:`DraftGuard` watches the cycles as they run and prices each one
with the cost model (verify forward of the drafted length plus the head steps it ran), so its
decisions carry no wall-clock noise and a run is reproducible for a given cost model. When the
last ``window`` drafting cycles cost more per committed token than one plain one-token forward
(``verify_seconds[0]``), the head pauses for ``pause`` committed tokens: those cycles verify the
root alone, or an n-gram lookup draft of a full-length match, which needs no head step. Then the
head drafts again (a probe); a probe that loses doubles the pause (up to ``max_pause``), one that
wins resets it. The worst case is therefore a few losing cycles per doubling pause, not a whole
answer drafted at a loss.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from ..errors import DecodeError, is_int

#: drafting cycles judged together
DEFAULT_WINDOW = 8
#: committed tokens decoded without the head after the first losing window
DEFAULT_PAUSE = 16
#: the longest pause (a losing probe doubles the pause up to this)
DEFAULT_MAX_PAUSE = 256


class DraftGuard:
    """Pause/probe state of one generation (see the module docstring). ``costs`` is a
    :class:`~wavesurf.drafter.adaptive.CostModel` (``verify_seconds``, ``cycle_seconds``)."""

    def __init__(self, costs: Any, *, window: int = DEFAULT_WINDOW, pause: int = DEFAULT_PAUSE,
                 max_pause: int = DEFAULT_MAX_PAUSE):
        if not hasattr(costs, "cycle_seconds") or not getattr(costs, "verify_seconds", None):
            raise DecodeError(f"costs={type(costs).__name__} is not a cost model with verify and draft-step costs; "
                              "measure one with wavesurf.drafter.adaptive.measure_costs")
        for name, v in (("window", window), ("pause", pause), ("max_pause", max_pause)):
            if not is_int(v, 1):
                raise DecodeError(f"{name}={v!r} must be an integer >= 1")
        if max_pause < pause:
            raise DecodeError(f"max_pause={max_pause} is smaller than pause={pause}; use max_pause >= pause")
        self.costs, self.window, self.pause, self.max_pause = costs, window, pause, max_pause
        self.plain_seconds = float(costs.verify_seconds[0])
        self.reset()

    def reset(self) -> None:
        """Start a new generation: the head drafts, nothing observed yet."""
        self._cycles: deque[tuple[float, int]] = deque(maxlen=self.window)
        self._left = 0  # committed tokens still to decode without the head
        self._next_pause = self.pause
        self.paused_tokens = 0  # committed while paused, this generation
        self.pauses = 0

    @property
    def paused(self) -> bool:
        """Whether the next cycle runs without the head."""
        return self._left > 0

    def observe(self, drafted: int, draft_steps: int, committed: int) -> None:
        """Record one cycle: draft tokens verified, head forwards run, tokens committed."""
        if self._left > 0:
            self._left = max(0, self._left - committed)
            self.paused_tokens += committed
            return
        self._cycles.append((self.costs.cycle_seconds(drafted, draft_steps), committed))
        if len(self._cycles) < self.window:
            return
        seconds = sum(c for c, _ in self._cycles)
        tokens = sum(t for _, t in self._cycles)
        if seconds / tokens > self.plain_seconds:  # drafting loses: pause the head
            self._left = self._next_pause
            self._next_pause = min(2 * self._next_pause, self.max_pause)
            self.pauses += 1
            self._cycles.clear()
        else:  # a won window (after a probe or not) resets the pause length
            self._next_pause = self.pause

    def describe(self) -> dict:
        return {"window": self.window, "pause": self.pause, "max_pause": self.max_pause,
                "plain_seconds": round(self.plain_seconds, 5)}


__all__ = ["DEFAULT_MAX_PAUSE", "DEFAULT_PAUSE", "DEFAULT_WINDOW", "DraftGuard"]
