"""Run profiles: the sizes the notebooks and ``wavesurf reproduce`` use.

``smoke`` is what CI runs through nbval (seconds per notebook), ``default`` is the main job on a
2-core CPU with the embedded default model, ``paper`` the sizes a GPU user would pick. Each
profile is a plain nested dict so the drafter part (training steps, decoding prompts, ...) can be
added under its own ``"drafter"`` key without touching the statistics part.

The analysis part fixes the token budget, the CKA estimators (``estimator`` for the unfiltered
statistics, ``selection_estimator`` for the filtered ones selection reads, ``sweep_estimator`` for
the filter sweep and the position-0 variant; only ``exact`` keeps the cross-layer covariances that
the alpha=1 aggregate entropy and redundancy need) and the variants every statistics notebook reads:
``base`` (no filter), ``position0`` (no filter, position 0 kept), ``selection`` (the token-entropy
filter selection uses) and one ``sweep`` variant per filter of ``sweep_filters``. All variants share
one capture of the corpus (see :func:`wavesurf.paper.profile_stats`).
"""
from __future__ import annotations

import copy
from typing import Any

from .errors import WavesurfError

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {
        "description": "seconds per notebook; what CI runs through nbval",
        "analysis": {
            # the same capture settings as the unit tests' small analysis (tests/conftest.py SMALL),
            # so both share one cached result
            "max_tokens": 1500, "max_len": 128, "batch_tokens": 1024, "pilot_tokens": 8192,
            "estimator": "auto", "selection_filter": "q0.5", "selection_estimator": "minibatch",
            "sweep_filters": ["q0.25", "q0.5"], "sweep_estimator": "minibatch", "minibatch_size": 128,
        },
        "drafter": {},
    },
    "default": {
        "description": "the main job on a 2-core CPU with the embedded default model",
        "analysis": {
            "max_tokens": 20_000, "max_len": 512, "batch_tokens": 4096, "pilot_tokens": 8192,
            # "auto" = exact CKA whenever the cross moments fit 8 GB (both embedded models), and the
            # same cache key as `wavesurf analyze/select --max-tokens 20000 [--filter q0.5]`
            "estimator": "auto", "selection_filter": "q0.5", "selection_estimator": "auto",
            "sweep_filters": ["q0.25", "q0.5", "q0.75"], "sweep_estimator": "minibatch", "minibatch_size": 512,
        },
        "drafter": {},
    },
    "paper": {
        "description": "the sizes a GPU user would pick (more tokens, finer filter sweep)",
        "analysis": {
            "max_tokens": 200_000, "max_len": 1024, "batch_tokens": 8192, "pilot_tokens": 16384,
            "estimator": "auto", "selection_filter": "q0.5", "selection_estimator": "auto",
            "sweep_filters": ["q0.1", "q0.25", "q0.5", "q0.75", "q0.9"], "sweep_estimator": "auto",
            "minibatch_size": 1024,
        },
        "drafter": {},
    },
}


class ProfileError(WavesurfError, ValueError):
    """An unknown profile name."""


def profile_names() -> list[str]:
    return list(PROFILES)


def get_profile(name: str) -> dict[str, Any]:
    """A deep copy of profile ``name`` (callers may change it freely)."""
    if not isinstance(name, str) or name not in PROFILES:
        raise ProfileError(f"unknown profile {name!r}; available: {', '.join(PROFILES)}")
    return copy.deepcopy(PROFILES[name])
