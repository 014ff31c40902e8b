"""Write a trained head as each serving stack or trainer loads it, and read such an export back.

A format names its consumer, because the consumers read the same checkpoint differently
(layer-id convention, where the ids sit, how many target layers ``fc`` takes; the id rules live in
:mod:`wavesurf.consumers`):

* ``vllm`` — ``LlamaForCausalLMEagle3`` config with a top-level ``eagle_aux_hidden_state_layer_ids``
  in vLLM ids. vLLM reads that key and nothing under ``eagle_config`` with this name; without it
  it falls back to ``(2, N//2, N-3)`` (vllm-project/vllm
  ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``, ``get_eagle3_aux_layers_from_config``).
* ``sglang`` — SGLang after PR #25454: ids under ``eagle_config.eagle_aux_hidden_state_layer_ids``;
  SGLang adds +1 only when the first id is 1, otherwise it takes them as vLLM ids
  (sgl-project/sglang ``python/sglang/srt/models/llama.py``, ``set_eagle3_layers_to_capture``).
* ``sglang-legacy`` — SGLang before PR #25454: always +1, so ids are written as "output of block
  k" (vLLM id - 1) (same file, older revisions).
* ``specforge`` — SpecForge's config: exactly three non-negative "output of block k" ids under
  ``eagle_config`` (sgl-project/SpecForge ``specforge/algorithms/model_providers.py``,
  ``resolve_eagle_capture_layers``).
* ``speculators`` — vLLM's native speculators format: ``speculators_model_type: "eagle3"``, weights
  under ``layers.0.*``, vLLM ids, ``norm_before_residual: false`` written explicitly (vLLM's loader
  defaults a missing key to true: ``vllm/transformers_utils/configs/speculators/algos.py``), and the
  verifier's HF id and architecture, which ``vllm serve <dir>`` and speculators load
  (``vllm/transformers_utils/config.py``; vllm-project/speculators ``src/speculators/config.py``).

Every format carries ``wavesurf`` metadata (target, ids in both conventions, format) so
:func:`load_export` rebuilds the exact head, checks the written ids against it and refuses the
wrong target. Weights are written in bfloat16 unless another dtype is asked for (SpecForge ships
bf16 heads, e.g. its ``configs/*-eagle3.json``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..cache import atomic_directory
from ..consumers import FORMATS, check_format, config_snippet, read_layer_ids, written_layer_ids
from ..models import block_output_ids
from .head import DraftConfig, DraftHead, DrafterError, load_head

DTYPES = ("bfloat16", "float16", "float32")
WEIGHTS = "model.safetensors"


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise DrafterError(f"export dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return dtype


def resolve_verifier(c: DraftConfig, verifier: str | None = None, architecture: str | None = None,
                     target: Any = None) -> tuple[str, str]:
    """The verifier's HF id (or path) and architecture for a head trained on ``c.target_name``:
    the embedded models' HF ids, a loaded ``target``'s own config, a local checkpoint's
    ``config.json``, or what the caller passes."""
    from ..assets import EMBEDDED_MODELS

    spec = EMBEDDED_MODELS.get(c.target_name)
    name = verifier or (spec.hf_name if spec else None)
    if name is None and target is not None and str(getattr(target, "source", "")).startswith("local directory "):
        name = str(target.source)[len("local directory "):]
    if name is None and "/" in c.target_name:
        name = c.target_name
    if name is None:
        raise DrafterError(f"the verifier of target {c.target_name!r} is not known: pass its HF id or path "
                           "(verifier=..., --verifier)")
    if architecture is None and spec is not None and (verifier is None or verifier == spec.hf_name):
        architecture = spec.architecture
    if architecture is None and target is not None:
        archs = getattr(target.model.config, "architectures", None) or [type(target.model).__name__]
        architecture = archs[0]
    if architecture is None and (Path(name).expanduser() / "config.json").is_file():
        archs = json.loads((Path(name).expanduser() / "config.json").read_text()).get("architectures") or []
        architecture = archs[0] if archs else None
    if architecture is None:
        try:
            from transformers import AutoConfig

            archs = AutoConfig.from_pretrained(name, local_files_only=True).architectures or []
            architecture = archs[0] if archs else None
        except (OSError, ValueError):
            architecture = None
    if architecture is None:
        raise DrafterError(f"the architecture of verifier {name!r} is not known (no local config.json): pass it "
                           "(verifier_architecture=..., --verifier-architecture), e.g. 'LlamaForCausalLM'")
    return name, architecture


def _llama_fields(c: DraftConfig, dtype: str) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.target_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def _full_identity_vocab(head: DraftHead) -> bool:
    import torch

    c = head.config
    return c.draft_vocab_size == c.target_vocab_size and not bool(torch.any(head.d2t != 0))


def export_drafter(head: DraftHead | str | Path, fmt: str, out: str | Path, *, include_embedding: Any = None,
                   verifier: str | None = None, verifier_architecture: str | None = None,
                   speculative_tokens: int = 3, dtype: str = "bfloat16", overwrite: bool = False) -> Path:
    """Export ``head`` (a :class:`DraftHead` or a directory written by ``save_head``) to ``out`` in
    format ``fmt`` (one of :data:`FORMATS`), weights in ``dtype``.

    ``include_embedding``: a target whose input embedding to store as ``embed_tokens.weight``
    (optional: SGLang and vLLM take the target's embedding anyway); it also tells the verifier's
    architecture. ``verifier`` / ``verifier_architecture``: the target's HF id or path and its
    architecture, written into the speculators config (default: the embedded model's HF id, or the
    target's own config). Every refusal happens before anything is written.
    """
    import torch

    check_format(fmt)
    check_dtype(dtype)
    if not isinstance(head, DraftHead):
        head, _ = load_head(head)
    c = head.config
    if c.input_norm != "none":
        # vLLM's and SGLang's EAGLE-3 heads feed the concatenated target states straight into fc
        # (vllm-project/vllm vllm/model_executor/models/llama_eagle3.py combine_hidden_states;
        # sgl-project/sglang python/sglang/srt/models/llama_eagle3.py): a per-stream RMS before fc
        # would be silently dropped, so such a head is refused rather than exported wrong.
        raise DrafterError(f"this head was trained with input_norm={c.input_norm!r} (each target stream divided by "
                           f"its RMS before fc), which the {fmt!r} format cannot express: vLLM and SGLang feed the "
                           "raw streams to fc. Train with input_norm='none' (the default) to export")
    ids_written = written_layer_ids(fmt, list(c.layer_ids), c.target_n_layers)
    if fmt == "speculators":
        verifier, verifier_architecture = resolve_verifier(c, verifier, verifier_architecture, include_embedding)
    torch_dtype = getattr(torch, dtype)
    sd = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    if _full_identity_vocab(head):
        # the draft vocabulary is the target's: no mapping tensors (speculators src/speculators/model.py
        # builds none then; EAGLE's ea_model.py deletes them)
        sd.pop("d2t"), sd.pop("t2d")
    sd = {k: (v.to(torch_dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    if fmt == "speculators":
        sd = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in sd.items()}
    if include_embedding is not None:
        emb = include_embedding.model.get_input_embeddings().weight.detach().cpu()
        sd["embed_tokens.weight"] = emb.to(torch_dtype).contiguous()
    meta = {"target": c.target_name, "config": c.to_dict(), "layer_ids_vllm": list(c.layer_ids),
            "layer_ids_sglang": block_output_ids(c.layer_ids), "layer_ids_written": ids_written, "format": fmt,
            "dtype": dtype}
    if fmt == "speculators":
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {**_llama_fields(c, dtype), "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": ids_written,
            "torch_dtype": dtype,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": [verifier_architecture]},
            },
        }
    else:
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **_llama_fields(c, dtype),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": False,
        }
        config.update(config_snippet(fmt, list(c.layer_ids), c.target_n_layers))
    config["wavesurf"] = meta
    from safetensors.torch import save_file

    out = Path(out)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        save_file(sd, str(tmp / WEIGHTS))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_export(directory: str | Path, target: Any | None = None) -> DraftHead:
    """Rebuild a float32 head from an export written by :func:`export_drafter`.

    Layer ids are read from the format's own field by the consumer's rule and checked against the
    ``wavesurf`` metadata, so a convention slip is caught here and not at serving time.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise DrafterError(f"{directory} has no config.json; it is not a drafter export")
    config = json.loads(cfg_path.read_text())
    meta = config.get("wavesurf")
    if not meta:
        raise DrafterError(f"{cfg_path} carries no 'wavesurf' metadata; only exports written by wavesurf can be loaded")
    c = DraftConfig.from_dict(meta["config"])
    fmt = meta.get("format")
    if fmt not in FORMATS:
        raise DrafterError(f"{cfg_path}: export format {fmt!r} is not one this version reads ({', '.join(FORMATS)}); "
                           "export the drafter again")
    ids = read_layer_ids(fmt, config)
    if ids != list(c.layer_ids):
        raise DrafterError(f"{cfg_path}: the layer ids a {fmt} consumer reads, {ids} (vLLM ids), disagree with the "
                           f"metadata {c.layer_ids}")
    if target is not None:
        c.check_target(target)
    sd = load_file(str(directory / WEIGHTS))
    sd.pop("embed_tokens.weight", None)
    sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}
    head = DraftHead(c)
    if "d2t" not in sd:  # full vocabulary written without mapping tensors
        sd["d2t"], sd["t2d"] = head.d2t.clone(), head.t2d.clone()
    head.load_state_dict(sd)
    return head.eval()


__all__ = ["DTYPES", "FORMATS", "check_dtype", "check_format", "export_drafter", "load_export", "resolve_verifier"]
