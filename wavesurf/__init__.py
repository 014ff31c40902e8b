"""wavesurf: which target layers an EAGLE-3 drafter should read, chosen by matrix entropy and CKA
of the hidden states, with token-entropy filtering. Companion of *Surfing the Activation Wave*.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .assets import DEFAULT_MODEL, EMBEDDED_MODELS
from .capture import CaptureBatch, capture, collect_states, run_capture, write_capture
from .data import Corpus, Example, encode, load_corpus, split_of
from .errors import (
    BudgetError,
    DatasetError,
    LayerIdError,
    MissingAssetError,
    ModelNotAvailableError,
    UnknownModelError,
    WavesurfError,
)
from .models import Target, default_layer_ids, load_target
from .select import METHODS, Selection, select_layers
from .stats.analysis import AnalysisSettings, LayerStats, analyze, load_stats

__all__ = [
    "__version__", "DEFAULT_MODEL", "EMBEDDED_MODELS",
    "Target", "load_target", "default_layer_ids",
    "Corpus", "Example", "load_corpus", "encode", "split_of",
    "CaptureBatch", "capture", "collect_states", "run_capture", "write_capture",
    "WavesurfError", "UnknownModelError", "ModelNotAvailableError", "MissingAssetError",
    "DatasetError", "BudgetError", "LayerIdError",
    "AnalysisSettings", "LayerStats", "analyze", "load_stats", "METHODS", "Selection", "select_layers",
]
