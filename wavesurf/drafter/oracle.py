"""A drafter that knows the answer: the test double that makes long accepted paths happen.

:class:`OracleHead` is a real :class:`~wavesurf.drafter.head.DraftHead` whose ``step`` runs as
usual (its keys and values fill the draft cache) but whose logits rank a known continuation first,
or second behind a wrong token at chosen positions. Losslessness tests and the speed-ceiling
benchmark use it: an untrained head is rejected at once and never exercises accepted paths,
non-first tree siblings or non-contiguous cache rows; the oracle does. Not for serving.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .head import DraftConfig, DraftHead, DraftStep, init_head

if TYPE_CHECKING:
    from ..models import Target


class OracleHead(DraftHead):
    """At rotary position p the draft predicts token p+2 of ``ref`` (prompt + reference output):
    ranked first, or second behind a wrong token when ``p % miss_every == miss_every - 1``."""

    def __init__(self, target: Target, ref: list[int], miss_every: int = 0):
        n = target.n_layers
        extra = [i for i in range(20000) if i not in set(ref)]
        vocab = sorted(set(ref) | set(extra[: 8192 - len(set(ref))]))
        super().__init__(DraftConfig.for_target(target, [2, n // 2, n - 3], 8192))
        init_head(self)
        self.set_vocab(torch.tensor(vocab))
        self.index = {t: i for i, t in enumerate(vocab)}
        self.ref, self.miss_every = ref, miss_every
        self.eval()

    def step(self, hidden, embeds, positions, mask, past_k=None, past_v=None):
        st = super().step(hidden, embeds, positions, mask, past_k, past_v)
        logits = torch.full_like(st.logits, -30.0)
        for i, p in enumerate(positions[0].tolist()):
            logits[0, i, 100:104] = torch.tensor([1.0, 0.5, 0.0, -0.5])  # wrong candidates for the tree
            if p + 2 < len(self.ref):
                good = self.index[self.ref[p + 2]]
                miss = self.miss_every and p % self.miss_every == self.miss_every - 1
                if miss:
                    logits[0, i, 100] = 6.0
                logits[0, i, good] = 5.0 if miss else 6.0
        return DraftStep(st.hidden, logits, st.k, st.v)


__all__ = ["OracleHead"]
