"""Exceptions wavesurf raises for bad input; every message names the bad value and what is allowed."""


class WavesurfError(Exception):
    """Base class: a problem the user can fix (bad argument, missing asset, damaged file)."""


class UnknownModelError(WavesurfError, ValueError):
    """The model name is neither embedded, a local directory, nor a Hugging Face id."""


class ModelNotAvailableError(WavesurfError, OSError):
    """A Hugging Face model is not in the local cache and downloads are not allowed."""


class MissingAssetError(WavesurfError, ImportError):
    """An asset package (model weights or corpus) is not installed."""


class DatasetError(WavesurfError, ValueError):
    """A corpus file is missing, empty or malformed, or a dataset name is unknown."""


class BudgetError(WavesurfError, ValueError):
    """A token budget is not positive or exceeds what the corpus holds."""


class LayerIdError(WavesurfError, ValueError):
    """Layer ids are out of range or duplicated."""


class StatsError(WavesurfError, ValueError):
    """Bad input to the statistics core (non-finite values, bad alpha, mismatched accumulators)."""
