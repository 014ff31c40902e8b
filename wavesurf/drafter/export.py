"""Write a trained head as each serving stack or trainer loads it, and read such an export back.

A format names its consumer, because the consumers read the same checkpoint differently (where
the ids sit, their convention for the target's architecture, how wide ``fc`` is, whether each
stream is normalised before ``fc``). The rules, read from the released packages and cited there,
live in one table in :mod:`wavesurf.consumers`; this module writes the config and weights:

* ``vllm`` — ``LlamaForCausalLMEagle3`` config, top-level ``eagle_aux_hidden_state_layer_ids`` in
  vLLM ids, ``num_aux_hidden_states`` and ``fc_norm``.
* ``sglang`` — the same config with the ids under ``eagle_config`` in the convention SGLang's
  model class for the target's architecture applies (``--consumer-version`` picks 0.5.23 or 0.5.14).
* ``specforge`` — as ``sglang`` at SpecForge's pinned sglang 0.5.14, exactly three ids.
* ``speculators`` — vLLM's native speculators format: ``speculators_model_type: "eagle3"``,
  weights under ``layers.0.*``, vLLM ids, ``norm_before_residual: false`` written explicitly (vLLM's
  loader defaults a missing key to true: ``vllm/transformers_utils/configs/speculators/algos.py``),
  ``num_aux_hidden_states`` inside ``transformer_layer_config`` (the keys vLLM keeps), and the
  verifier's HF id or local path and architecture.

A head trained with ``input_norm="rms"`` (each target stream divided by its RMS before ``fc``) is
written with ``fc_norm: true`` and unit ``fc_norm.{i}.weight``: the per-stream RMSNorm every
consumer above applies (``llama_eagle3.py`` of vLLM and SGLang, SpecForge, speculators).

Every format carries ``wavesurf`` metadata (target, ids in both conventions, format, consumer
version and architecture) so :func:`load_export` rebuilds the exact head, checks the ids the
consumer reads against it and refuses the wrong target; :func:`check_export` says which layers
each consumer version reads for an exported config. Weights are written in bfloat16 unless
another dtype is asked for (SpecForge ships bf16 heads, e.g. its ``configs/*-eagle3.json``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cache import atomic_directory
from ..consumers import (CONSUMERS, FORMATS, PLUS_ONE, Consumer, ConsumerError, arch_rule, architecture_of, check_format,
                         config_ids, config_snippet, consumer, consumer_view, fc_width, read_layer_ids, reads,
                         written_layer_ids)
from ..models import block_output_ids
from .head import DraftConfig, DraftHead, DrafterError, load_head

if TYPE_CHECKING:
    from ..models import Target

DTYPES = ("bfloat16", "float16", "float32")
WEIGHTS = "model.safetensors"


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise DrafterError(f"export dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    return dtype


def _local_config(path: str | None) -> dict | None:
    if path and (Path(path).expanduser() / "config.json").is_file():
        return json.loads((Path(path).expanduser() / "config.json").read_text())
    return None


def resolve_architecture(c: DraftConfig, given: str | None = None, target: Target = None) -> str | None:
    """The HF architecture of the target a head was trained on (what serving stacks load it as):
    ``given``, the embedded model's, a loaded ``target``'s, the one recorded at training, the local
    checkpoint's ``config.json`` or the local HF cache's; None when nothing tells."""
    from ..assets import EMBEDDED_MODELS

    if given:
        return given
    spec = EMBEDDED_MODELS.get(c.target_name)
    if spec is not None:
        return spec.architecture
    if target is not None:
        return architecture_of(target)
    if c.extra.get("target_architecture"):
        return str(c.extra["target_architecture"])
    local = _local_config(c.extra.get("target_path"))
    if local and local.get("architectures"):
        return str(local["architectures"][0])
    try:
        from transformers import AutoConfig

        archs = AutoConfig.from_pretrained(c.target_name, local_files_only=True).architectures or []
        return str(archs[0]) if archs else None
    except (OSError, ValueError):
        return None


def resolve_verifier(c: DraftConfig, verifier: str | None = None, architecture: str | None = None,
                     target: Target = None) -> tuple[str, str]:
    """The verifier's HF id or local path and its architecture for a head trained on
    ``c.target_name``: the embedded models' HF ids, the local directory the head was trained on
    (speculators accepts a path), a loaded ``target``'s, or what the caller passes."""
    from ..assets import EMBEDDED_MODELS

    spec = EMBEDDED_MODELS.get(c.target_name)
    name = verifier or (spec.hf_name if spec else None) or c.extra.get("target_path")
    if name is None and target is not None and getattr(target, "path", None):
        name = str(target.path)
    if name is None and "/" in c.target_name:
        name = c.target_name
    if name is None:
        raise DrafterError(f"the verifier of target {c.target_name!r} is not known: pass its HF id or path "
                           "(verifier=..., --verifier)")
    if architecture is None and verifier is not None and not (spec and verifier == spec.hf_name):
        local = _local_config(verifier)
        architecture = str(local["architectures"][0]) if local and local.get("architectures") else None
    architecture = architecture or resolve_architecture(c, None, target)
    if architecture is None:
        raise DrafterError(f"the architecture of verifier {name!r} is not known (no local config.json): pass it "
                           "(target_architecture=..., --target-architecture), e.g. 'LlamaForCausalLM'")
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


def plan_export(c: DraftConfig, fmt: str, *, consumer_version: str | None = None,
                architecture: str | None = None) -> tuple[Consumer, str | None, list[int]]:
    """The consumer, target architecture and ids written for exporting a head with config ``c`` in
    ``fmt``; refuses (before anything is loaded or written) what that consumer cannot read."""
    check_format(fmt)
    if c.embedding_only:
        raise DrafterError("this head is the embedding-only control (trained with embedding_only=True: it reads no "
                           "target layer); it is a diagnostic, not a drafter, and is not exported")
    cons = consumer(fmt, consumer_version)
    ids = written_layer_ids(fmt, list(c.layer_ids), c.target_n_layers, architecture, version=cons.version,
                            input_norm=c.input_norm)
    return cons, architecture, ids


def export_drafter(head: DraftHead | str | Path, fmt: str, out: str | Path, *, include_embedding: Any = None,
                   verifier: str | None = None, target_architecture: str | None = None,
                   consumer_version: str | None = None, speculative_tokens: int = 3, dtype: str = "bfloat16",
                   overwrite: bool = False) -> Path:
    """Export ``head`` (a :class:`DraftHead` or a directory written by ``save_head``) to ``out`` in
    format ``fmt`` (one of :data:`FORMATS`) for its consumer at ``consumer_version`` (default: the
    newest whose rules were read), weights in ``dtype``.

    ``include_embedding``: a target whose input embedding to store as ``embed_tokens.weight``
    (optional: SGLang and vLLM take the target's embedding anyway); it also tells the target's
    architecture. ``target_architecture``: the target's HF architecture where nothing else tells it
    (the SGLang-family id rule depends on it). ``verifier``: the speculators config's target id or
    path (default: the embedded model's HF id, or the local directory the head was trained on).
    Every refusal happens before anything is written.
    """
    import torch

    check_format(fmt)
    check_dtype(dtype)
    if not isinstance(head, DraftHead):
        head, _ = load_head(head)
    c = head.config
    architecture = resolve_architecture(c, target_architecture, include_embedding)
    cons, architecture, ids_written = plan_export(c, fmt, consumer_version=consumer_version, architecture=architecture)
    if fmt == "speculators":
        verifier, architecture = resolve_verifier(c, verifier, architecture, include_embedding)
    torch_dtype = getattr(torch, dtype)
    sd = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    if _full_identity_vocab(head):
        # the draft vocabulary is the target's: no mapping tensors (speculators src/speculators/model.py
        # builds none then; EAGLE's ea_model.py deletes them)
        sd.pop("d2t"), sd.pop("t2d")
    k = len(c.layer_ids)
    if c.input_norm == "rms":  # our weightless per-stream RMS = fc_norm with unit weights
        for i in range(k):
            sd[f"fc_norm.{i}.weight"] = torch.ones(c.target_hidden_size)
    sd = {name: (v.to(torch_dtype) if v.is_floating_point() else v) for name, v in sd.items()}
    if fmt == "speculators":
        sd = {("layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n): v for n, v in sd.items()}
    if include_embedding is not None:
        emb = include_embedding.model.get_input_embeddings().weight.detach().cpu()
        sd["embed_tokens.weight"] = emb.to(torch_dtype).contiguous()
    rule = cons.architectures.get(architecture or "", cons.fallback)
    meta = {"target": c.target_name, "config": c.to_dict(), "layer_ids_vllm": list(c.layer_ids),
            "layer_ids_sglang": block_output_ids(c.layer_ids), "layer_ids_written": ids_written, "format": fmt,
            "dtype": dtype, "consumer": {"format": fmt, "version": cons.version, "package": cons.package,
                                         "target_architecture": architecture,
                                         "rule": rule.rule if rule else None, "source": rule.source if rule else None}}
    snippet = config_snippet(fmt, list(c.layer_ids), c.target_n_layers, architecture, version=cons.version,
                             input_norm=c.input_norm)
    if fmt == "speculators":
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {**_llama_fields(c, dtype), "architectures": ["LlamaForCausalLM"],
                                         **snippet.pop("transformer_layer_config")},
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": False,
            **snippet,
            "torch_dtype": dtype,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": [architecture]},
            },
        }
    else:
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **_llama_fields(c, dtype),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": False,
            **snippet,
        }
    config["wavesurf"] = meta
    from safetensors.torch import save_file

    out = Path(out)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        save_file(sd, str(tmp / WEIGHTS))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _read_config(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise DrafterError(f"{directory} has no config.json; it is not a drafter export")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterError(f"{cfg_path} is not valid JSON ({exc}); it is not a drafter export") from None
    if not isinstance(config, dict) or not (config.get("eagle_config") or "eagle_aux_hidden_state_layer_ids" in config
                                            or config.get("speculators_model_type") or config.get("wavesurf")):
        raise DrafterError(f"{cfg_path} names no EAGLE-3 target layers (no eagle_aux_hidden_state_layer_ids, "
                           "eagle_config or speculators_model_type); it is not a drafter export")
    return cfg_path, config


def _export_consumer(meta: dict[str, Any], cfg_path: Path) -> tuple[str, str | None, str | None]:
    """Format, consumer version and target architecture an export was written for (exports of
    earlier wavesurf versions carry no consumer: their format's newest rule, the embedded model's
    architecture)."""
    from ..assets import EMBEDDED_MODELS

    fmt = meta.get("format")
    info = meta.get("consumer") or {}
    arch = info.get("target_architecture")
    if arch is None and meta.get("target") in EMBEDDED_MODELS:
        arch = EMBEDDED_MODELS[meta["target"]].architecture
    if fmt not in FORMATS and fmt not in ("sglang-legacy", "eagle3"):
        raise DrafterError(f"{cfg_path}: export format {fmt!r} is not one this version reads ({', '.join(FORMATS)}); "
                           "export the drafter again")
    return fmt, info.get("version"), arch


def _ids_read(config: dict[str, Any], fmt: str, version: str | None, n_layers: int, arch: str | None) -> list[int]:
    if fmt in ("sglang-legacy", "eagle3"):  # written by earlier wavesurf versions: always "output of block k"
        return reads(PLUS_ONE, config["eagle_config"]["eagle_aux_hidden_state_layer_ids"], n_layers)
    return read_layer_ids(config, fmt, n_layers, arch, version=version)


def load_export(directory: str | Path, target: Target | None = None) -> DraftHead:
    """Rebuild a float32 head from an export written by :func:`export_drafter`.

    Layer ids are read from the format's own field by the consumer's rule for the target's
    architecture and checked against the ``wavesurf`` metadata, so a convention slip is caught
    here and not at serving time (``wavesurf export --check`` says what each consumer reads).
    """
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path, config = _read_config(directory)
    meta = config.get("wavesurf")
    if not meta:
        raise DrafterError(f"{cfg_path} carries no 'wavesurf' metadata; only exports written by wavesurf can be loaded")
    c = DraftConfig.from_dict(meta["config"])
    fmt, version, arch = _export_consumer(meta, cfg_path)
    try:
        ids = _ids_read(config, fmt, version, c.target_n_layers, arch)
    except ConsumerError as exc:
        raise DrafterError(f"{cfg_path}: {exc}") from None
    if ids != list(c.layer_ids):
        raise DrafterError(f"{cfg_path}: the layer ids a {fmt} consumer reads, {ids} (vLLM ids), disagree with the "
                           f"metadata {c.layer_ids}; see `wavesurf export --check {directory}` and export again")
    if target is not None:
        c.check_target(target)
    sd = load_file(str(directory / WEIGHTS))
    sd.pop("embed_tokens.weight", None)
    sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}
    k = len(c.layer_ids)
    norms = [sd.pop(f"fc_norm.{i}.weight", None) for i in range(k)]
    if bool(config.get("fc_norm")) != (c.input_norm == "rms"):
        raise DrafterError(f"{cfg_path}: fc_norm={config.get('fc_norm')!r} disagrees with the head's "
                           f"input_norm={c.input_norm!r}")
    if c.input_norm == "rms" and all(w is not None for w in norms):
        # fc(concat(w_i * rms_i(x_i))) = (fc.weight scaled by w_i per stream)(concat(rms_i(x_i))): exact for w = 1
        sd["fc.weight"] = sd["fc.weight"] * torch.cat(norms)[None, :]
    head = DraftHead(c)
    if "d2t" not in sd:  # full vocabulary written without mapping tensors
        sd["d2t"], sd["t2d"] = head.d2t.clone(), head.t2d.clone()
    head.load_state_dict(sd)
    return head.eval()


def check_export(directory: str | Path, *, n_layers: int | None = None,
                 architecture: str | None = None) -> dict[str, Any]:
    """Which target layers each consumer version reads for an exported drafter config, how wide it
    builds ``fc`` and whether it normalises the streams, against what the head was trained on
    (from the ``wavesurf`` metadata; for a foreign export pass ``n_layers`` and ``architecture``).

    ``ok`` is False when the consumer the export was written for would read other layers or another
    width than the head's; exports written by earlier wavesurf versions with the old ``sglang``
    rule are reported this way.
    """
    cfg_path, config = _read_config(directory)
    meta = config.get("wavesurf") or {}
    trained = None
    fmt = version = None
    if meta:
        c = DraftConfig.from_dict(meta["config"])
        trained, n_layers = list(c.layer_ids), n_layers or c.target_n_layers
        fmt, version, arch = _export_consumer(meta, cfg_path)
        architecture = architecture or arch
    if n_layers is None:
        raise DrafterError(f"{cfg_path} carries no 'wavesurf' metadata: pass the target's number of layers and "
                           "architecture (--model NAME_OR_PATH)")
    speculators_cfg = bool(config.get("speculators_model_type"))
    rows = []
    for cons in CONSUMERS:
        row: dict[str, Any] = {"consumer": cons.label, "package": cons.package}
        if (cons.format == "speculators") != speculators_cfg and cons.format != "vllm":
            row["reads"] = None
            row["note"] = ("reads only speculators-format configs" if cons.format == "speculators"
                           else "does not read speculators-format configs")
            rows.append(row)
            continue
        view = consumer_view(config, cons)
        try:
            rule = arch_rule(cons, architecture)
            written = config_ids(view, cons)
            ids = read_layer_ids(config, cons.format, n_layers, architecture, version=cons.version)
            width = fc_width(view, cons)
            bad = [i for i in ids if i not in rule.captured(n_layers)]
            if cons.format == "specforge" and (written is None or len(written) != 3 or min(written) < 0):
                raise ConsumerError(f"{cons.label} requires exactly three non-negative ids, found {written}")
            row.update({"written": written, "reads": ids, "default_ids": written is None, "fc_width": width,
                        "fc_norm": bool(view.get("fc_norm") or (cons.format == "sglang" and view.get("use_aux_norm"))),
                        "rule": rule.rule, "source": rule.source})
            if bad:
                row["note"] = f"ids {bad} are not captured by this consumer ({rule.source})"
            if trained is not None:
                row["matches"] = (not bad and ids == trained and width == len(trained)
                                  and row["fc_norm"] == (c.input_norm == "rms"))
        except ConsumerError as exc:
            row["refuses"] = str(exc)
            if trained is not None:
                row["matches"] = False
        rows.append(row)
    own = next((r for r in rows if fmt and r["consumer"].startswith(f"{fmt} ") and
                (version is None or r["consumer"] == f"{fmt} {version}")), None)
    ok = None if trained is None or own is None else bool(own.get("matches"))
    if fmt in ("sglang-legacy", "eagle3"):
        ok = None  # a format that no longer exists: the rows say what each consumer reads
    return {"export": str(Path(directory)), "format": fmt, "consumer_version": version, "target_architecture": architecture,
            "n_layers": n_layers, "trained_layer_ids": trained, "ok": ok, "consumers": rows}


__all__ = ["DTYPES", "FORMATS", "check_dtype", "check_export", "check_format", "export_drafter", "load_export",
           "plan_export", "resolve_architecture", "resolve_verifier"]
