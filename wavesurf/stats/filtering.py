"""Token-entropy filtering: keep the positions where the target is unsure of the next token.

A filter keeps position t iff H_t >= threshold (nats), the *same* positions for every layer, so
CKA samples stay paired. The threshold is given in nats or as a quantile of H over the run's
statistics positions; a quantile is fixed from a pilot of the first ``pilot_tokens`` positions
(one pass, no second forward). Every filtered statistic has a control: a random subset of the
same size, drawn per batch among the same candidate positions (so it also matches the filter's
batch-by-batch counts).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data import ROLE_NAMES
from ..errors import FilterError

FILTER_HELP = "'none', 'q0.5' (keep H >= the 50% quantile), or '1.5nats' (keep H >= 1.5 nats)"


@dataclass(frozen=True)
class TokenFilter:
    """``kind`` is ``none``, ``quantile`` (value in [0, 1)) or ``nats`` (value >= 0)."""

    kind: str = "none"
    value: float = 0.0
    pilot_tokens: int = 8192

    @classmethod
    def parse(cls, spec: str | None, pilot_tokens: int = 8192) -> TokenFilter:
        if spec is None or str(spec).strip().lower() in ("", "none", "off"):
            return cls("none", 0.0, pilot_tokens)
        text = str(spec).strip().lower()
        m = re.fullmatch(r"(?:q|quantile[:=]?)\s*([0-9.]+)", text)
        if m:
            q = float(m.group(1))
            if not 0.0 <= q < 1.0:
                raise FilterError(f"filter {spec!r}: a quantile must be in [0, 1), got {q}; allowed: {FILTER_HELP}")
            return cls("quantile", q, pilot_tokens)
        m = re.fullmatch(r"(?:nats[:=]?)?\s*([0-9.]+)\s*(?:nats?)?", text)
        if m:
            try:
                value = float(m.group(1))
            except ValueError:
                value = -1.0
            if value >= 0 and math.isfinite(value):
                return cls("nats", value, pilot_tokens)
        raise FilterError(f"filter {spec!r} is not understood; allowed: {FILTER_HELP}")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @property
    def label(self) -> str:
        return {"none": "none", "quantile": f"q{self.value:g}", "nats": f"{self.value:g}nats"}[self.kind]

    def check_reachable(self, vocab_size: int) -> None:
        """Refuse, before any capture, a threshold in nats that no position can reach: the entropy
        of a distribution over ``vocab_size`` tokens is at most ln(vocab_size)."""
        top = math.log(vocab_size) if vocab_size > 1 else 0.0
        if self.kind == "nats" and self.value > top:
            raise FilterError(f"filter {self.label!r} keeps no position: a next-token entropy over {vocab_size:,} "
                              f"tokens is at most ln({vocab_size:,}) = {top:.2f} nats; allowed: a threshold "
                              f"<= {top:.2f} nats, or {FILTER_HELP}")


class FilterState:
    """Applies a :class:`TokenFilter` batch by batch and counts what it kept."""

    def __init__(self, spec: TokenFilter, seed: int = 0):
        self.spec = spec
        self.seed = seed
        self.threshold: float | None = spec.value if spec.kind == "nats" else (None if spec.active else -math.inf)
        self.candidates = 0
        self.kept = 0
        # positions by role (wavesurf.data.ROLE_*): which roles a filter keeps, e.g. how much of the
        # high-entropy half of a chat corpus is user text rather than the answers a drafter serves
        self.candidate_roles = np.zeros(len(ROLE_NAMES), dtype=np.int64)
        self.kept_roles = np.zeros(len(ROLE_NAMES), dtype=np.int64)

    def set_threshold_from(self, entropies: Any) -> None:
        """Fix a quantile threshold from pilot entropies (1-D tensor of statistics positions)."""
        import torch

        if self.spec.kind != "quantile" or self.threshold is not None:
            return
        if entropies.numel() == 0:
            raise FilterError("the pilot of the token-entropy filter saw no statistics positions")
        self.threshold = float(torch.quantile(entropies.double().cpu(), self.spec.value))

    def masks(self, candidate_mask: Any, token_entropy: Any, batch_index: int,
              roles: Any = None) -> tuple[Any, Any | None]:
        """(kept, random control of the same size) among ``candidate_mask`` positions; ``roles``
        (int [B, T], ``wavesurf.data.ROLE_*``) adds the positions' roles to the counts."""
        import torch

        if self.threshold is None:
            raise RuntimeError("quantile threshold not set: call set_threshold_from on the pilot first")
        kept = candidate_mask & (token_entropy >= self.threshold) if self.spec.active else candidate_mask
        self.candidates += int(candidate_mask.sum())
        self.kept += int(kept.sum())
        if roles is not None:
            for counts, mask in ((self.candidate_roles, candidate_mask), (self.kept_roles, kept)):
                counts += torch.bincount(roles[mask].long().cpu(), minlength=len(counts))[: len(counts)].numpy()
        if not self.spec.active:
            return kept, None
        flat = candidate_mask.reshape(-1).nonzero().squeeze(1)
        k = int(kept.sum())
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_index)
        pick = flat[torch.randperm(flat.numel(), generator=gen)[:k].to(flat.device)]
        control = torch.zeros(candidate_mask.numel(), dtype=torch.bool, device=candidate_mask.device)
        control[pick] = True
        return kept, control.reshape(candidate_mask.shape)

    def sum_over_processes(self, all_reduce_ints: Callable[..., list[int]]) -> None:
        """Replace every count by its sum over the processes of a sharded pass
        (``wavesurf.distributed.all_reduce_ints``)."""
        n = len(self.candidate_roles)
        summed = all_reduce_ints(self.candidates, self.kept, *self.candidate_roles, *self.kept_roles)
        self.candidates, self.kept = summed[:2]
        self.candidate_roles, self.kept_roles = np.array(summed[2:2 + n]), np.array(summed[2 + n:])

    def summary(self) -> dict[str, Any]:
        return {
            "filter": self.spec.label,
            "threshold_nats": None if self.threshold in (None, -math.inf) else round(self.threshold, 6),
            "candidate_tokens": self.candidates,
            "kept_tokens": self.kept,
            "kept_fraction": round(self.kept / self.candidates, 6) if self.candidates else None,
            "candidate_roles": role_counts(self.candidate_roles),
            "kept_roles": role_counts(self.kept_roles),
        }


def role_counts(counts: Sequence[int]) -> dict[str, int]:
    """Counts by ``ROLE_*`` index as ``{role name: count}``, roles never seen left out."""
    return {ROLE_NAMES[r]: int(n) for r, n in enumerate(counts) if n}


def role_shares(summary: dict[str, Any], which: str = "kept") -> dict[str, float] | None:
    """Share of each role among the ``kept`` (or ``candidate``) positions of a filter summary
    (:meth:`FilterState.summary`); None for a result cached before roles were counted."""
    counts = summary.get(f"{which}_roles")
    if not counts:
        return None
    total = sum(counts.values())
    return {role: n / total for role, n in counts.items()}
