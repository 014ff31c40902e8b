"""What every decoder shares: the result of one generation and its counting, settings checks,
end-of-sequence ids, token bookkeeping and sampling."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DecodeError, is_int

if TYPE_CHECKING:
    from ..models import Target


def check_decode_settings(max_new_tokens: Any, temperature: Any) -> None:
    """Refuse a bad generation length or temperature before any model work."""
    if not is_int(max_new_tokens, 1):
        raise DecodeError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or temperature == float("inf"):
        raise DecodeError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")


@dataclass
class DecodeResult:
    """What one generation produced and cost. ``tokens`` excludes the prompt and includes a final EOS."""

    method: str
    tokens: list[int]
    seconds: float  # wall time of the whole generation, prefill included
    n_target_forwards: int  # every target forward, prefill included
    cycle_tokens: list[int] = field(default_factory=list)  # tokens committed by each forward after the prefill
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per cycle (speculative only)
    draft_steps: int = 0  # draft-head forwards (extend + expansion levels)
    tie_rechecks: int = 0  # extra one-token target forwards spent on near-tie replays
    prompt_tokens: int = 0
    stopped: str = ""  # "eos" or "max_new_tokens"
    draft_scores: list[list[float]] = field(default_factory=list)  # chain only: cumulative draft log-probs per cycle
    lookup_drafted: list[int] = field(default_factory=list)  # with lookup drafting: tokens lookup proposed per cycle
    paused_tokens: int = 0  # with a DraftGuard: tokens committed while it had paused the head

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward after the prefill (EAGLE's acceptance length)."""
        n = len(self.cycle_tokens)
        return sum(self.cycle_tokens) / n if n else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> dict:
        return {"method": self.method, "new_tokens": self.new_tokens, "tau": round(self.tau, 4),
                "n_target_forwards": self.n_target_forwards, "tie_rechecks": self.tie_rechecks,
                "draft_steps": self.draft_steps, "paused_tokens": self.paused_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_second": round(self.tokens_per_second, 3), "stopped": self.stopped}


def eos_ids(target: Target) -> set[int]:
    """Token ids that end a generation: the generation config's ``eos_token_id`` (int or list),
    else the tokenizer's."""
    gc = getattr(target.model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = target.tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def as_ids(input_ids: Any, device: str) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise DecodeError(f"batch size {ids.shape[0]}: speculative decoding here is batch size 1")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() < 1:
        raise DecodeError(f"input_ids must be a non-empty 1D sequence of token ids, got shape {tuple(ids.shape)}")
    return ids.to(device)


def finish_tokens(new: list[int], produced: list[int], eos: set[int], budget: int) -> tuple[list[int], bool]:
    """Append ``new`` to ``produced`` up to the first EOS (kept) and the budget; True when done."""
    for t in new:
        if len(produced) >= budget:
            return produced, True
        produced.append(int(t))
        if int(t) in eos:
            return produced, True
    return produced, len(produced) >= budget


def sample_token(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    if temperature == 0:
        return int(torch.argmax(logits))
    p = torch.softmax(logits.double() / temperature, dim=-1)
    return int(torch.multinomial(p, 1, generator=gen))



__all__ = ["DecodeResult", "as_ids", "check_decode_settings", "eos_ids", "finish_tokens", "sample_token"]
