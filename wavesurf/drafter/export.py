"""Write a trained head as the serving stacks load it, and read such an export back.

Two formats (``../shared/reference/eagle3.md`` section 4):

* ``eagle3`` — the EAGLE/SpecForge checkpoint SGLang and vLLM load: ``config.json`` with
  ``architectures: ["LlamaForCausalLMEagle3"]`` and weights ``fc``, ``midlayer.*``, ``norm``,
  ``lm_head``, ``d2t``, ``t2d``. Layer ids go in ``eagle_config.eagle_aux_hidden_state_layer_ids``
  in the SpecForge/SGLang convention ("output of block k" = vLLM id - 1).
* ``speculators`` — vLLM's native format: ``speculators_model_type: "eagle3"``, weights under
  ``layers.0.*``, ``eagle_aux_hidden_state_layer_ids`` in the vLLM convention, and
  ``norm_before_residual: false`` written explicitly (vLLM defaults a missing key to true).

Both carry ``wavesurf`` metadata (target, ids in both conventions) so :func:`load_export` can
rebuild the exact head and refuse the wrong target.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from ..cache import atomic_directory
from .head import DraftConfig, DraftHead, DrafterError, load_head

FORMATS = ("eagle3", "speculators")
WEIGHTS = "model.safetensors"


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise DrafterError(f"export format {fmt!r} does not exist; choose one of {', '.join(FORMATS)}")
    return fmt


def _llama_fields(c: DraftConfig) -> dict:
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
        "torch_dtype": "float32",
    }


def _sglang_ids(c: DraftConfig) -> list[int]:
    return [i - 1 for i in c.layer_ids]


def export_drafter(head: DraftHead | str | Path, fmt: str, out: str | Path, *, include_embedding: Any = None,
                   verifier: str | None = None, speculative_tokens: int = 3, overwrite: bool = False) -> Path:
    """Export ``head`` (a :class:`DraftHead` or a directory written by ``save_head``) to ``out``.

    ``include_embedding``: a target whose input embedding to store as ``embed_tokens.weight``
    (optional: SGLang and vLLM take the target's embedding anyway). ``verifier``: the target's HF id
    or path written into the speculators config (default: the target name the head was trained for).
    """
    check_format(fmt)
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
    if 0 in c.layer_ids:
        warnings.warn("layer id 0 (embedding output) has no SpecForge/SGLang 'output of block k' name; it is "
                      "written as -1 in the eagle3 format", stacklevel=2)
    sd = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    if fmt == "speculators":
        sd = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in sd.items()}
    if include_embedding is not None:
        sd["embed_tokens.weight"] = include_embedding.model.get_input_embeddings().weight.detach().cpu().contiguous()
    meta = {"target": c.target_name, "config": c.to_dict(), "layer_ids_vllm": list(c.layer_ids),
            "layer_ids_sglang": _sglang_ids(c), "format": fmt}
    if fmt == "eagle3":
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **_llama_fields(c),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": _sglang_ids(c), "use_aux_hidden_state": True},
            "wavesurf": meta,
        }
        if _sglang_ids(c)[0] != 1:
            warnings.warn(
                f"SGLang ids {_sglang_ids(c)} do not start at 1: SGLang after PR #25454 adds +1 only when the first "
                "id is 1 and would read these as vLLM ids (one layer lower). Serve this head with vLLM's speculators "
                "format or check your SGLang version", stacklevel=2)
    else:
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {**_llama_fields(c), "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": list(c.layer_ids),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier or c.target_name, "architectures": ["LlamaForCausalLM"]},
            },
            "wavesurf": meta,
        }
    from safetensors.torch import save_file

    out = Path(out)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        save_file(sd, str(tmp / WEIGHTS))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_export(directory: str | Path, target: Any | None = None) -> DraftHead:
    """Rebuild a head from an ``eagle3`` or ``speculators`` export written by :func:`export_drafter`.

    Layer ids are read from the format's own field and converted to vLLM ids, and checked against
    the ``wavesurf`` metadata, so a convention slip is caught here and not at serving time.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise DrafterError(f"{directory} has no config.json; it is not an eagle3/speculators export")
    config = json.loads(cfg_path.read_text())
    meta = config.get("wavesurf")
    if not meta:
        raise DrafterError(f"{cfg_path} carries no 'wavesurf' metadata; only exports written by wavesurf can be loaded")
    c = DraftConfig.from_dict(meta["config"])
    if "speculators_model_type" in config:
        ids = list(config["eagle_aux_hidden_state_layer_ids"])
    else:
        ids = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    if ids != list(c.layer_ids):
        raise DrafterError(f"{cfg_path}: layer ids {ids} (converted to vLLM) disagree with the metadata {c.layer_ids}")
    if target is not None:
        c.check_target(target)
    sd = load_file(str(directory / WEIGHTS))
    sd.pop("embed_tokens.weight", None)
    sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    head = DraftHead(c)
    head.load_state_dict(sd)
    return head.eval()


__all__ = ["FORMATS", "check_format", "export_drafter", "load_export"]
