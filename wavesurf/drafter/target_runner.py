"""Target forwards for speculative decoding: explicit (tree) masks over a plain ``DynamicCache``
whose rows can be kept or dropped after a partial acceptance, the drafter's feature layers read
through residual-stream taps.

Verify forwards of several rows may run on oneDNN-packed weights (:mod:`wavesurf.packed`: MKL's
general GEMM for 2-16 rows costs far more than its one-row kernel on the same weights); one-row
forwards, the prefill and the near-tie replay keep HF's kernels, so they stay bit-identical to HF
``generate``. The verify logits differ from the plain kernels by float32 rounding (~5e-5 on
SmolLM2, measured), well inside the near-tie margin.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DecodeError
from ..packed import PackedLinears
from ..taps import ResidualTaps

if TYPE_CHECKING:
    from ..models import Target


class TargetRunner:
    """Target forwards with explicit (tree) masks over a plain ``DynamicCache``, reading the
    drafter's feature layers through forward hooks."""

    def __init__(self, target: Target, layer_ids: Sequence[int], packed: PackedLinears | None = None):
        from transformers import DynamicCache

        self.target, self.model = target, target.model
        self.layer_ids = list(layer_ids)
        cfg = self.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.impl = getattr(cfg, "_attn_implementation", "sdpa") or "sdpa"
        if self.impl not in ("sdpa", "eager"):
            raise DecodeError(
                f"attention implementation {self.impl!r} does not take a tree mask; load the target with "
                "attn_implementation='sdpa' or 'eager'")
        types = list(getattr(cfg, "layer_types", None) or [])
        self.sliding = int(getattr(cfg, "sliding_window", 0) or 0) if "sliding_attention" in types else 0
        self.dict_mask = bool(types) and self.sliding > 0
        self.cache = DynamicCache()
        self.key_positions = torch.zeros(0, dtype=torch.long, device=target.device)
        self.hooks = ResidualTaps(self.model, self.layer_ids) if self.layer_ids else None
        self.forwards = 0
        self.packed = packed

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None

    @property
    def length(self) -> int:
        return int(self.key_positions.numel())

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        m = allowed[None, None]
        if self.impl == "eager":
            dtype = next(self.model.parameters()).dtype
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
        return m

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None = None,
                logits_rows: int = 0, *, verify: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``ids`` [T] at ``positions`` [T]; ``tree`` bool [T, T] says which new token sees
        which (all cached rows are visible); ``tree=None`` means plain causal order right after the
        cache and lets HF build its own masks, the exact computation of HF's prefill / decode step.
        ``verify=True`` marks a verify forward, which may use the packed weights.
        Returns logits [T, V] (float32; only the last ``logits_rows`` rows if > 0) and features
        [T, k*d] (ascending layer ids) or None."""
        past = self.length
        dev = ids.device
        if tree is None:
            mask: Any = None
        else:
            allowed = torch.cat([torch.ones(len(ids), past, dtype=torch.bool, device=dev), tree], dim=1)
            if self.dict_mask:
                kpos = torch.cat([self.key_positions, positions])
                near = (positions[:, None] - kpos[None, :]) < self.sliding
                mask = {"full_attention": self._mask(allowed), "sliding_attention": self._mask(allowed & near)}
            else:
                mask = self._mask(allowed)
        if self.hooks is not None:
            self.hooks.states = {}
        with self.packed.active() if verify and self.packed is not None and len(ids) > 1 else nullcontext():
            out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                             cache=self.cache, use_cache=True, logits_to_keep=logits_rows)
        self.forwards += 1
        self.key_positions = torch.cat([self.key_positions, positions])
        feats = None
        if self.hooks is not None:
            feats = torch.cat([self.hooks.states[i][0] for i in self.layer_ids], dim=-1)
            self.hooks.states = {}
        return out.logits[0].float(), feats

    def keep(self, past: int, rows: torch.Tensor) -> None:
        """Keep the first ``past`` cached rows plus new rows ``past + rows`` (in that order)."""
        n = len(rows)
        contiguous = n == 0 or bool((rows == torch.arange(n, device=rows.device)).all())
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            if contiguous:
                layer.keys, layer.values = layer.keys[:, :, : past + n], layer.values[:, :, : past + n]
            else:
                idx = torch.cat([torch.arange(past, device=rows.device), past + rows])
                layer.keys, layer.values = layer.keys[:, :, idx], layer.values[:, :, idx]
        kp = self.key_positions
        self.key_positions = kp[: past + n] if contiguous else torch.cat([kp[:past], kp[past + rows]])


__all__ = ["TargetRunner"]
