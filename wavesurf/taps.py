"""Residual-stream taps: where a causal LM's decoder blocks are, and forward hooks that keep each
block's output under its vLLM layer id (0 = the embedding output, i = the output of block i,
before the final norm). Capture, drafter features and speculative decoding all read the target
through these taps, so the layer-id convention lives in one place.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def decoder_blocks(model: Any) -> Any:
    """The decoder of a HF causal LM: the module holding ``.layers`` (the N blocks), ``.norm`` and
    the input embedding."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(base, "layers"):
        raise TypeError(f"{type(model).__name__}: cannot find the decoder blocks (expected `.layers`)")
    return base


class ResidualTaps:
    """Forward hooks that keep references to the embedding output (id 0) and each wanted block's
    output (id i) in ``states`` during a forward pass. Use as a context manager, or call
    :meth:`remove` when done: the hooks never outlive their user."""

    def __init__(self, model: Any, layer_ids: Sequence[int]):
        base = decoder_blocks(model)
        self.states: dict[int, Any] = {}
        self.handles: list[Any] = []
        wanted = set(layer_ids)
        if 0 in wanted:
            self.handles.append(base.get_input_embeddings().register_forward_hook(self._store(0)))
        for i, block in enumerate(base.layers, start=1):
            if i in wanted:
                self.handles.append(block.register_forward_hook(self._store(i)))

    def _store(self, layer_id: int):
        def hook(_module, _inputs, output):
            self.states[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> ResidualTaps:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


__all__ = ["ResidualTaps", "decoder_blocks"]
