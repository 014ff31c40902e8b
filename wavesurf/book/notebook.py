"""The first cell of every notebook after its parameters: check them, set up torch and the plot
style, load the target. Everything else a notebook does is a call into the package."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ParameterError, is_int
from .profiles import Profile, get_profile

if TYPE_CHECKING:
    from ..models import Target

DEVICES_HELP = "'auto', 'cpu', 'cuda' or 'cuda:N'"


@dataclass(frozen=True)
class NotebookParams:
    """The checked parameters every notebook takes (papermill ``parameters`` cell)."""

    model: str
    dataset: str
    max_tokens: int | None  # None = the profile's analysis budget
    profile: str
    seed: int
    device: str

    @property
    def profile_spec(self) -> Profile:
        return get_profile(self.profile)


def check_parameters(model: Any, dataset: Any, max_tokens: Any, profile: Any, seed: Any, device: Any) -> NotebookParams:
    """Check notebook parameters; a wrong type or value raises :class:`ParameterError` naming it."""
    from ..assets import CORPUS_ASSETS

    def bad(name: str, value: Any, allowed: str) -> ParameterError:
        return ParameterError(f"parameter {name}={value!r} is not allowed: {allowed}")

    if not isinstance(model, str) or not model.strip():
        raise bad("model", model, "a non-empty string (embedded name, local directory or HF id)")
    if not isinstance(dataset, str) or not (dataset in CORPUS_ASSETS or dataset.endswith(".jsonl")):
        raise bad("dataset", dataset, f"one of {', '.join(CORPUS_ASSETS)} or a path ending in .jsonl")
    if max_tokens is not None and not is_int(max_tokens, 1):
        raise bad("max_tokens", max_tokens, "None (the profile's budget) or a positive integer")
    get_profile(profile)  # raises with the list of profiles
    if not is_int(seed, 0):
        raise bad("seed", seed, "an integer >= 0")
    if not isinstance(device, str) or not (device in ("auto", "cpu", "cuda") or
                                           (device.startswith("cuda:") and device[5:].isdigit())):
        raise bad("device", device, DEVICES_HELP)
    return NotebookParams(model.strip(), dataset, max_tokens, profile, seed, device)




def open_notebook(model: Any, dataset: Any, max_tokens: Any, profile: Any, seed: Any,
                  device: Any) -> tuple[NotebookParams, Any]:
    """Check the parameters (a wrong one raises :class:`ParameterError` before any work), use every
    core (``WAVESURF_THREADS``) with TF32 off, apply the shared plot style, and load the target."""
    from . import plots
    from ..models import configure_torch, load_target

    params = check_parameters(model, dataset, max_tokens, profile, seed, device)
    configure_torch()
    plots.use_style()
    return params, load_target(params.model, device=params.device)


def target_line(target: Target) -> str:
    """The line every page prints under its parameters (an nbval-checked output): the model, its
    depth and width, and the layers EAGLE-3 reads by default (vLLM ids)."""
    return (f"{target.name}: N = {target.n_layers} blocks, d = {target.hidden_size}, "
            f"default EAGLE-3 layers (vLLM ids) {target.default_layer_ids()}")


__all__ = ["DEVICES_HELP", "NotebookParams", "check_parameters", "open_notebook", "target_line"]
