"""Every exception wavesurf raises, in one place; every message names the bad value and what is
allowed. Modules re-export the ones they raise (``wavesurf.drafter.head.DrafterError`` is this
module's ``DrafterError``), so either import path works."""


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


class DeviceError(WavesurfError, ValueError):
    """A device or dtype this machine (or wavesurf on it) cannot run."""


class CaptureError(WavesurfError, ValueError):
    """Bad capture settings: which tokens count (roles), the dtype of written states."""


class StatsError(WavesurfError, ValueError):
    """Bad input to the statistics core (non-finite values, bad alpha, mismatched accumulators)."""


class ConsumerError(WavesurfError, ValueError):
    """A format that does not exist, or layer ids its consumer cannot read."""


class FilterError(WavesurfError, ValueError):
    """A filter spec that cannot be parsed, or a filter that keeps too few tokens."""


class DrafterError(WavesurfError):
    """A drafter that does not fit its target, or bad drafter settings."""


class DecodeError(DrafterError, ValueError):
    """Bad decoding settings (tree shape, temperature, token budget) or input."""


class AcceptanceError(DrafterError, ValueError):
    """An acceptance evaluation that does not fit: another target, missing layers, bad settings."""


class BenchError(WavesurfError, ValueError):
    """Bad benchmark settings."""


class ProfileError(WavesurfError, ValueError):
    """An unknown profile name."""


class SelectionError(WavesurfError, ValueError):
    """A bad k, method name or candidate set."""


class ReproduceError(WavesurfError):
    """A bad --only / profile, or a notebook that failed (names the notebook and cell)."""


class ParameterError(WavesurfError, ValueError):
    """A notebook parameter or command-line option of the wrong type or value."""


class DistributedError(WavesurfError, RuntimeError):
    """A process group that cannot be set up as the environment describes."""


class DistillError(WavesurfError, ValueError):
    """Bad generation settings (temperature, token budgets, batch size)."""


def is_int(value: object, minimum: int | None = None, maximum: int | None = None) -> bool:
    """Whether ``value`` is an integer (Python or numpy, never a bool) within [minimum, maximum].
    The one check behind every "must be an integer >= ..." refusal; the message stays with the caller."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return False
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
