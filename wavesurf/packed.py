"""oneDNN-packed copies of a model's linear weights for forwards of a few rows on a CPU.

A float32 linear layer with 2-16 input rows runs through MKL's general GEMM, which on the CPUs
measured here costs 1.6-2x the one-row (GEMV) time although it reads the same weights once
(``benchmarks/verify_profile.py``; far more on an AMD EPYC, where MKL's small-matrix kernels are
slow). :class:`PackedLinears` keeps oneDNN's reordered copy of the ``nn.Linear`` weights
(``torch.ops.mkldnn._reorder_linear_weight``, the kernel PyTorch's own CPU inference path
``torch/_inductor/fx_passes/mkldnn_fusion.py`` uses) and, inside :meth:`PackedLinears.active`,
computes inputs of more than one row with it; one-row inputs keep HF's kernels, so a one-token
step stays bit-identical to HF ``generate``. Users: speculative decoding's verify forwards
(:mod:`wavesurf.drafter.target_runner`) and the batched generation of the target's answers
(:mod:`wavesurf.distill`). Results differ from the plain kernels by float32 rounding (~5e-5 in
the logits on SmolLM2, measured); both users re-decide near ties with plain kernels.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .errors import DecodeError


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
            raise DecodeError("oneDNN-packed linear weights need float32 weights on the CPU and a PyTorch with oneDNN, got "
                              f"{next(model.parameters()).dtype} on {next(model.parameters()).device}; use packed=False")
        if select not in ("measured", "all"):
            raise DecodeError(f"select={select!r} must be 'measured' or 'all'")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 2:
            raise DecodeError(f"rows={rows!r} must be an int >= 2 (the input rows of the forwards packed for: "
                              "a verify forward or a generation batch)")
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


def use_packing(packed: Any, model: Any, error: type[Exception] = DecodeError) -> bool:
    """A caller's ``packed`` option: True or False as given, None = where the model allows it
    (:func:`packing_available`); anything else is refused with the caller's ``error``."""
    if packed not in (None, True, False):
        raise error(f"packed={packed!r} must be True, False or None (= when the model allows it)")
    return packing_available(model) if packed is None else bool(packed)


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def packed_for(model: Any, rows: int) -> PackedLinears:
    """One packed copy per model, shared by its users; rebuilt (and its shapes re-measured) when
    the thread count or the row count it was measured at changes."""
    have = _PACKED.get(model)
    if have is None or have.threads != torch.get_num_threads() or have.rows != rows:
        _PACKED.pop(model, None)
        _PACKED[model] = PackedLinears(model, rows=rows)
    return _PACKED[model]


__all__ = ["PackedLinears", "packed_for", "packing_available", "use_packing"]
