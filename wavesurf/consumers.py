"""How each consumer of an EAGLE-3 drafter config reads target layer ids: one rule per consumer,
used by ``wavesurf export`` (a full checkpoint) and ``wavesurf select --eagle-config`` (a snippet).

wavesurf's ids are vLLM ids (0 = embedding output, i = output of block i before the final norm).
Upstream sources of each rule are cited where it is applied.
"""
from __future__ import annotations

from typing import Any

from .errors import ConsumerError
from .models import block_output_ids



FORMATS = ("vllm", "sglang", "sglang-legacy", "specforge", "speculators")
#: formats whose fusion layer ``fc`` takes exactly 3 x hidden inputs: vllm-project/vllm and
#: sgl-project/sglang ``.../models/llama_eagle3.py``; SpecForge ``specforge/modeling/draft/llama3_eagle.py``
#: and ``resolve_eagle_capture_layers`` (exactly three ids)
FIXED_WIDTH = {"vllm": 3, "sglang": 3, "sglang-legacy": 3, "specforge": 3}
#: format names of earlier wavesurf versions ("eagle3" wrote SpecForge ids under eagle_config)
_RENAMED = {"eagle3": "specforge (the same ids as the old 'eagle3'), sglang, sglang-legacy or vllm"}


def check_format(fmt: str) -> str:
    if fmt in _RENAMED:
        raise ConsumerError(f"format {fmt!r} was split by consumer; choose {_RENAMED[fmt]}")
    if fmt not in FORMATS:
        raise ConsumerError(f"format {fmt!r} does not exist; choose one of {', '.join(FORMATS)}")
    return fmt


def written_layer_ids(fmt: str, layer_ids: list[int], n_layers: int) -> list[int]:
    """The ids ``fmt``'s consumer must find in the config to read the vLLM ids ``layer_ids``.

    Refuses what the consumer cannot capture, naming a format that can.
    """
    check_format(fmt)
    ids = [int(i) for i in layer_ids]
    # Every consumer records the residual stream entering block i while it loops over blocks
    # 0..N-1 (vllm-project/vllm vllm/model_executor/models/llama.py LlamaModel.forward, `idx in
    # self.aux_hidden_state_layers`; sgl-project/sglang python/sglang/srt/models/llama.py
    # `layers_to_capture`): the output of the last block (vLLM id N) is never captured, and at id 0
    # vLLM's llama adds a residual that does not exist yet; SpecForge ids must be >= 0 (= vLLM >= 1).
    bad = [i for i in ids if not 1 <= i <= n_layers - 1]
    if bad:
        raise ConsumerError(
            f"layer ids {bad} cannot be served: {fmt} captures vLLM ids 1..{n_layers - 1} only (id 0 is the "
            f"embedding output, id {n_layers} the last block's output, neither is captured by the serving "
            "stacks). Train the drafter on other layers")
    need = FIXED_WIDTH.get(fmt)
    if need is not None and len(ids) != need:
        raise ConsumerError(
            f"format {fmt!r} reads exactly {need} target layers (its fc takes {need} x hidden inputs) but this "
            f"drafter reads {len(ids)} ({ids}); export it with --format speculators, which reads any number")
    if fmt in ("vllm", "speculators"):
        return ids
    if fmt in ("sglang-legacy", "specforge"):
        return block_output_ids(ids)  # ids >= 1 here
    # fmt == "sglang" (PR #25454 on): a first id of 1 is shifted by +1, anything else is read as vLLM ids.
    if ids[0] == 2:
        return block_output_ids(ids)  # [1, ...]: read as +1 by old and new SGLang alike
    if ids[0] == 1:
        raise ConsumerError(
            "SGLang (PR #25454 on) shifts ids by +1 exactly when the first id is 1, so a set starting at vLLM "
            f"id 1 ({ids}) cannot be written for it: written as vLLM ids it would be read one layer higher, "
            "written as 'output of block k' ids ([0, ...]) one layer lower. Use --format sglang-legacy for "
            "SGLang before PR #25454, or --format vllm")
    return ids


def read_layer_ids(fmt: str, config: dict[str, Any]) -> list[int]:
    """The vLLM ids a consumer of ``fmt`` reads from ``config`` (the inverse of :func:`written_layer_ids`)."""
    if fmt in ("vllm", "speculators"):
        return [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    ids = [int(i) for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    if fmt == "sglang" and ids[0] != 1:
        return ids
    return [i + 1 for i in ids]


def servable_formats(layer_ids: list[int], n_layers: int) -> list[str]:
    """The formats whose consumer can read ``layer_ids`` (empty: no serving stack captures them)."""
    ok = []
    for fmt in FORMATS:
        try:
            written_layer_ids(fmt, layer_ids, n_layers)
        except ConsumerError:
            continue
        ok.append(fmt)
    return ok


def config_snippet(fmt: str, layer_ids: list[int], n_layers: int) -> dict[str, Any]:
    """The part of a drafter config that tells ``fmt``'s consumer which target layers to read."""
    ids = written_layer_ids(fmt, layer_ids, n_layers)
    if fmt in ("vllm", "speculators"):
        return {"eagle_aux_hidden_state_layer_ids": ids}
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}


__all__ = ["config_snippet", "servable_formats", "FIXED_WIDTH", "FORMATS", "ConsumerError", "check_format", "read_layer_ids", "written_layer_ids"]
