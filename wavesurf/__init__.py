"""wavesurf: which target layers an EAGLE-3 drafter should read, chosen by matrix entropy and CKA
of the hidden states, with token-entropy filtering. Companion of *Surfing the Activation Wave*.

The public names below are imported on first use, so ``wavesurf --help`` and ``import wavesurf``
do not load torch.
"""
from __future__ import annotations

from typing import Any

from ._lazy import lazy_getattr
from ._version import __version__

#: public name -> the module that defines it
_PUBLIC = {
    "DEFAULT_MODEL": "assets", "EMBEDDED_MODELS": "assets",
    "Target": "models", "load_target": "models", "default_layer_ids": "models",
    "Corpus": "data", "Example": "data", "load_corpus": "data", "encode": "data", "split_of": "data",
    "CaptureBatch": "capture", "capture": "capture", "collect_states": "capture", "run_capture": "capture",
    "write_capture": "capture",
    "WavesurfError": "errors", "UnknownModelError": "errors", "ModelNotAvailableError": "errors",
    "MissingAssetError": "errors", "DatasetError": "errors", "BudgetError": "errors", "LayerIdError": "errors",
    "AnalysisSettings": "stats.analysis", "LayerStats": "stats.results", "analyze": "stats.analysis",
    "load_stats": "stats.store",
    "METHODS": "select", "Selection": "select", "select_layers": "select",
}


def __getattr__(name: str) -> Any:
    return lazy_getattr(__name__, _PUBLIC, globals(), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = ["__version__", *_PUBLIC]
