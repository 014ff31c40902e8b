"""Target forwards for speculative decoding: explicit (tree) masks over a plain ``DynamicCache``
whose rows can be kept or dropped after a partial acceptance, the drafter's feature layers read
through residual-stream taps.

Verify forwards of a few rows on a CPU. A float32 linear layer with 2-16 input rows runs through
MKL's general GEMM, which on this machine costs 1.6-2x the one-row (GEMV) time although it reads
the same weights once (``benchmarks/verify_profile.py``). :class:`PackedLinears` keeps oneDNN's
reordered copy of the ``nn.Linear`` weights of the target (``torch.ops.mkldnn._reorder_linear_weight``,
the kernel PyTorch's own CPU inference path ``torch/_inductor/fx_passes/mkldnn_fusion.py`` uses) and
runs multi-row verify forwards on it; one-row forwards, the prefill and the near-tie replay keep
HF's kernels, so they stay bit-identical to HF ``generate``. The verify logits differ from the
plain kernels by float32 rounding (~5e-5 on SmolLM2, measured), well inside the near-tie margin.
It costs one extra copy of the packed weights in memory; which shapes are packed is measured per
thread count (:class:`PackedLinears`).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ..errors import DecodeError
from ..taps import ResidualTaps


def packing_available(model: Any) -> bool:
    """Whether :class:`PackedLinears` can serve ``model``: float32 weights on the CPU and a PyTorch
    built with oneDNN."""
    p = next(model.parameters())
    return (p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinears:
    """oneDNN-reordered copies of a model's ``nn.Linear`` weights, used inside :meth:`active` for
    inputs of more than one row (see the module docstring). Build once per target and reuse.

    Whether the reordered kernel is faster depends on the weight's shape and the thread count (on
    this 2-core machine it is 0.5-0.8x for the MLP and the lm_head but 1.2-1.9x for small attention
    projections, and the balance moves with 1 vs 2 threads), so with ``select="measured"`` each
    distinct shape is timed once, plain against packed at ``rows`` input rows under the current
    thread count, and only shapes packed at least 5% faster are packed (``self.ratios`` keeps the
    measured packed/plain times). ``select="all"`` packs every linear layer."""

    def __init__(self, model: Any, rows: int = 5, select: str = "measured", repeats: int = 15):
        if not packing_available(model):
            raise DecodeError("packed verify weights need float32 weights on the CPU and a PyTorch with oneDNN; "
                              "use packed=False")
        if select not in ("measured", "all"):
            raise DecodeError(f"select={select!r} must be 'measured' or 'all'")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 2:
            raise DecodeError(f"rows={rows!r} must be an int >= 2 (the rows of a verify forward)")
        self.model, self.rows, self.threads = model, rows, torch.get_num_threads()
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        by_shape: dict[tuple[int, int], list[torch.nn.Linear]] = {}
        for mod in linears:
            by_shape.setdefault(tuple(mod.weight.shape), []).append(mod)
        self.weights: dict[torch.nn.Module, torch.Tensor] = {}
        self.ratios: dict[tuple[int, int], float] = {}
        with torch.inference_mode():
            for shape, mods in by_shape.items():
                packed = torch.ops.mkldnn._reorder_linear_weight(mods[0].weight.detach(), rows)
                if select == "measured":
                    self.ratios[shape] = _packed_over_plain(mods[0].weight.detach(), packed, rows, repeats)
                    if self.ratios[shape] > 0.95:
                        continue
                self.weights[mods[0]] = packed
                for mod in mods[1:]:
                    self.weights[mod] = torch.ops.mkldnn._reorder_linear_weight(mod.weight.detach(), rows)
        self.bytes = sum(mod.weight.numel() * mod.weight.element_size() for mod in self.weights)

    @staticmethod
    def _forward(mod: torch.nn.Module, packed: torch.Tensor):
        plain = type(mod).forward.__get__(mod)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.numel() < 2 * x.shape[-1]:  # one row: HF's own kernel
                return plain(x)
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, mod.bias, "none", [], "")
            return y.reshape(*x.shape[:-1], y.shape[-1])

        return forward

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside: every packed module computes multi-row inputs from its packed weight."""
        for mod, w in self.weights.items():
            mod.forward = self._forward(mod, w)
        try:
            yield
        finally:
            for mod in self.weights:
                mod.__dict__.pop("forward", None)


def _packed_over_plain(weight: torch.Tensor, packed: torch.Tensor, rows: int, repeats: int) -> float:
    """Median time of the packed kernel over the plain one for ``rows`` random input rows,
    interleaved so that load drift falls on both alike."""
    import statistics
    import time

    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    plain_t, packed_t = [], []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        t1 = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        t2 = time.perf_counter()
        if i >= 2:  # warm-up
            plain_t.append(t1 - t0)
            packed_t.append(t2 - t1)
    return statistics.median(packed_t) / statistics.median(plain_t)


class TargetRunner:
    """Target forwards with explicit (tree) masks over a plain ``DynamicCache``, reading the
    drafter's feature layers through forward hooks."""

    def __init__(self, target: Any, layer_ids: Sequence[int], packed: PackedLinears | None = None):
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


__all__ = ["PackedLinears", "TargetRunner", "packing_available"]
