"""Load a target model by embedded name, local directory or Hugging Face id, and the layer-id
convention every other module uses.

Layer ids follow vLLM / EAGLE-3: id 0 is the embedding output (the input of block 1), id i in
1..N is the residual stream after block i, *before* the final norm. SpecForge / SGLang name the
same tensors "output of block k" with k = id - 1.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .assets import DEFAULT_MODEL, EMBEDDED_MODELS, ensure_dequantized
from .errors import DeviceError, LayerIdError, ModelNotAvailableError, UnknownModelError

log = logging.getLogger(__name__)


def configure_torch(threads: int | None = None) -> None:
    """Use every core for intra-op work and keep TF32 off (the statistics sum large numbers)."""
    import torch

    if threads is None:
        threads = int(os.environ.get("WAVESURF_THREADS", 0)) or (os.cpu_count() or 1)
    torch.set_num_threads(max(1, threads))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def processor_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows. Benchmarks print it:
    the cost of a multi-row verify against HF's one-row step differs between CPU makes (MKL's
    small-matrix kernels on an AMD EPYC vs an Intel Xeon), so a speed ratio is a fact about one."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"device={device!r} was asked for but CUDA is not available; use 'cpu' or 'auto'")
    if device not in ("cpu", "mps") and not device.startswith("cuda"):
        raise DeviceError(f"device={device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N', 'mps'")
    return device


@dataclass
class Target:
    """A loaded target model and the facts about it other steps need."""

    name: str
    model: Any  # transformers PreTrainedModel (causal LM), in eval mode
    tokenizer: Any
    n_layers: int  # N, number of transformer blocks
    hidden_size: int  # d
    vocab_size: int  # V (rows of the unembedding)
    has_chat_template: bool
    device: str
    dtype: str
    source: str  # what cache keys and corpus ownership record; see :func:`local_identity` for directories
    load_seconds: float = field(default=0.0, repr=False)
    path: str | None = None  # the resolved local directory; None for embedded names and HF ids
    fingerprint: str | None = None  # :func:`checkpoint_fingerprint` of ``path``; None without one

    # ---- layer-id convention -------------------------------------------------------------
    @property
    def layer_ids(self) -> list[int]:
        """All layer ids, 0..N (vLLM convention)."""
        return list(range(self.n_layers + 1))

    def default_layer_ids(self) -> list[int]:
        """The EAGLE-3 default rule ``[2, N//2, N-3]`` in vLLM ids."""
        return default_layer_ids(self.n_layers)

    def to_sglang(self, layer_ids: Sequence[int]) -> list[int]:
        """vLLM ids -> SpecForge/SGLang "output of block k" ids (k = id - 1)."""
        return to_sglang(self.check_layer_ids(layer_ids), self.n_layers)

    def from_sglang(self, block_ids: Sequence[int]) -> list[int]:
        return from_sglang(block_ids, self.n_layers)

    def check_layer_ids(self, layer_ids: Iterable[int]) -> list[int]:
        return check_layer_ids(layer_ids, self.n_layers)

    def describe(self) -> dict:
        return {
            "model": self.name,
            "n_layers": self.n_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "chat_template": self.has_chat_template,
            "device": self.device,
            "dtype": self.dtype,
            "source": self.source,
            **({"path": self.path, "fingerprint": self.fingerprint} if self.path is not None else {}),
        }


def default_layer_ids(n_layers: int) -> list[int]:
    return [2, n_layers // 2, n_layers - 3]


def check_layer_ids(layer_ids: Iterable[int], n_layers: int) -> list[int]:
    """Validate vLLM layer ids against a model with ``n_layers`` blocks (allowed: 0..N, no repeats)."""
    ids = list(layer_ids)
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= n_layers]
    if bad:
        raise LayerIdError(f"layer ids {bad} are out of range: allowed are integers 0..{n_layers} (vLLM ids, 0 = embeddings)")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise LayerIdError(f"layer ids {dup} are given more than once in {ids}")
    if not ids:
        raise LayerIdError("no layer ids given; allowed are integers 0..{n_layers}")
    return ids


def to_sglang(layer_ids: Sequence[int], n_layers: int) -> list[int]:
    ids = check_layer_ids(layer_ids, n_layers)
    if 0 in ids:
        raise LayerIdError("layer id 0 (the embedding output) has no SGLang/SpecForge 'output of block k' id")
    return block_output_ids(ids)


def block_output_ids(layer_ids: Sequence[int]) -> list[int | None]:
    """vLLM ids -> SpecForge/SGLang "output of block k" ids (k = id - 1), None for id 0 (the
    embedding output has no such name). The one place the shift is written."""
    return [int(i) - 1 if int(i) > 0 else None for i in layer_ids]


def from_sglang(block_ids: Sequence[int], n_layers: int) -> list[int]:
    bad = [k for k in block_ids if not 0 <= k < n_layers]
    if bad:
        raise LayerIdError(f"SGLang block ids {bad} are out of range: allowed are 0..{n_layers - 1}")
    return check_layer_ids([k + 1 for k in block_ids], n_layers)


# ---------------------------------------------------------------------------------------------
def _resolve_dtype(dtype: str | None, device: str):
    import torch

    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype is None:
        return torch.float32
    if dtype not in names:
        raise DeviceError(f"dtype={dtype!r} is not one of {sorted(names)}")
    if device == "cpu" and names[dtype] != torch.float32:
        raise DeviceError(f"dtype={dtype!r} is only supported on GPU; on CPU wavesurf runs float32")
    return names[dtype]


#: files of a checkpoint directory that decide what the model computes: config, tokenizer and
#: generation settings (small, so hashed whole) and weights (only their ends, see below)
_FINGERPRINT_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".safetensors", ".bin")
_EDGE = 64 * 1024
_LOCAL_PREFIX = "local directory "
_LOCAL_SOURCE = re.compile(r"local directory (?P<path>.+?)(?: \(fingerprint (?P<fp>[0-9a-f]+)\))?")
SHORT_FINGERPRINT = 16  # hex digits of the fingerprint a source string shows


def checkpoint_fingerprint(directory: str | os.PathLike[str]) -> str:
    """A cheap fingerprint (sha256 hex) of a checkpoint directory's top-level config, tokenizer
    and weight files: for each, its name, its size and a hash of its first and last 64 KiB
    (so files up to 128 KiB, config.json among them, are hashed whole). It is a fingerprint, not
    a full hash: multi-GB weights are never read whole, and a change in the middle of a large
    file that keeps its size goes unnoticed. It exists so caches keyed on a directory are not
    served to a changed checkpoint (new weights, a new config or chat template)."""
    root = Path(directory)
    digest = hashlib.sha256(b"wavesurf-checkpoint-fingerprint-1\0")
    for f in sorted(p for p in root.iterdir() if p.suffix in _FINGERPRINT_SUFFIXES and p.is_file()):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            edges = fh.read(_EDGE)
            if size > _EDGE:
                fh.seek(max(_EDGE, size - _EDGE))
                edges += fh.read(_EDGE)
        digest.update(f"{f.name}\0{size}\0{hashlib.sha256(edges).hexdigest()}\n".encode())
    return digest.hexdigest()


def local_identity(directory: str | os.PathLike[str]) -> tuple[str, str, str, str]:
    """``(name, resolved path, fingerprint, source)`` of a checkpoint directory: the one place a
    local target's identity is computed. The path is resolved (``~``, relative, trailing-slash
    and symlink spellings of one directory agree, so caches and corpora are shared across
    spellings); the name is the resolved directory's name (a symlink's *target* name, not the
    link's); the source names the path and a short fingerprint, so a changed checkpoint gets
    new cache keys."""
    resolved = Path(directory).expanduser().resolve()
    fingerprint = checkpoint_fingerprint(resolved)
    source = f"{_LOCAL_PREFIX}{resolved} (fingerprint {fingerprint[:SHORT_FINGERPRINT]})"
    return resolved.name, str(resolved), fingerprint, source


def parse_local_source(source: str) -> tuple[Path, str | None] | None:
    """The resolved directory and (short) fingerprint a local target's ``source`` names; None for
    another kind of source. Sources written before fingerprints (``local directory <path as
    typed>``) give fingerprint None and their path resolved against the current directory."""
    m = _LOCAL_SOURCE.fullmatch(source) if isinstance(source, str) else None
    if m is None:
        return None
    return Path(m["path"]).expanduser().resolve(), m["fp"]


def same_source(recorded: str | None, target: Target) -> bool:
    """Whether a cache entry or corpus whose ``source`` is ``recorded`` came from ``target``. Local
    directories compare by resolved path and, where both are known, fingerprint; other sources
    (embedded models, HF ids) by the exact string. None (not recorded) matches anything."""
    if recorded is None or recorded == target.source:
        return True
    mine, theirs = parse_local_source(recorded), parse_local_source(target.source)
    if mine is None or theirs is None or mine[0] != theirs[0]:
        return False
    fp = getattr(target, "fingerprint", None)
    return mine[1] is None or fp is None or fp.startswith(mine[1])


def _looks_like_hf_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def load_target(
    name_or_path: str = DEFAULT_MODEL,
    device: str = "auto",
    dtype: str | None = None,
    allow_download: bool = False,
) -> Target:
    """Load a target: an embedded name (``smollm2-135m``, ``gemma3-270m``), a local directory with
    a transformers checkpoint, or a Hugging Face id already in the local HF cache.

    Nothing is downloaded unless ``allow_download=True``. Float32 on CPU; ``dtype="bfloat16"`` is
    allowed on GPU. A directory's name, ``path``, ``fingerprint`` and ``source`` come from
    :func:`local_identity`, so every spelling of its path is the same target.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    device = pick_device(device)
    torch_dtype = _resolve_dtype(dtype, device)
    resolved: str | None = None
    fingerprint: str | None = None
    if name_or_path in EMBEDDED_MODELS:
        spec = EMBEDDED_MODELS[name_or_path]
        path, local_only, source = ensure_dequantized(name_or_path), True, spec.source
        name = name_or_path
    elif Path(name_or_path).expanduser().is_dir():
        try:
            name, resolved, fingerprint, source = local_identity(name_or_path)
        except OSError as exc:
            raise ModelNotAvailableError(f"could not read the checkpoint directory {name_or_path!r}: {exc}") from exc
        path, local_only = Path(resolved), True
    elif _looks_like_hf_id(name_or_path):
        path, local_only = name_or_path, not allow_download
        source = f"Hugging Face {name_or_path}"
        name = name_or_path
    else:
        raise UnknownModelError(
            f"unknown model {name_or_path!r}: use one of the embedded models "
            f"{', '.join(EMBEDDED_MODELS)}, a local directory with a transformers checkpoint, "
            "or a Hugging Face id like 'meta-llama/Llama-3.1-8B-Instruct'"
        )
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading takes ~2 s; a bar per load is noise
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=local_only)
        except Exception as exc:  # a damaged cache entry that passed the size check: rebuild once
            if name_or_path not in EMBEDDED_MODELS:
                raise
            warnings.warn(f"cache entry {path} could not be loaded ({exc}); rebuilding it", stacklevel=2)
            path = ensure_dequantized(name_or_path, rebuild=True)
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    except OSError as exc:
        if isinstance(path, Path):
            raise ModelNotAvailableError(f"could not load a transformers checkpoint from {path}: {exc}") from exc
        raise ModelNotAvailableError(
            f"model {name_or_path!r} is not in the local Hugging Face cache and wavesurf does not download "
            f"by default. Either download it first (`huggingface-cli download {name_or_path}`, "
            "with HF_HOME pointing at your cache), pass the local directory that holds its files, or allow "
            "downloads with allow_download=True / --allow-download."
        ) from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.to(device).eval()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    return Target(
        name=name,
        model=model,
        tokenizer=tokenizer,
        n_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(vocab),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        device=device,
        dtype=str(torch_dtype).replace("torch.", ""),
        source=source,
        load_seconds=time.perf_counter() - t0,
        path=resolved,
        fingerprint=fingerprint,
    )
