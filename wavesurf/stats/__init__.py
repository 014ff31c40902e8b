"""Numerical core: streaming float64 moments, matrix entropy (nats), linear CKA, depth compartments,
grouped-jackknife intervals.

Names are imported from their modules on first use (torch loads only then). ``compartments`` is
both a submodule and a function; the function (numpy only) is bound here so that importing the
submodule cannot shadow it.
"""
from __future__ import annotations

from typing import Any

from .._lazy import lazy_getattr

from .compartments import (compartment_costs, compartment_label, compartment_of, compartment_stability,
                           compartments, mean_silhouette)

_PUBLIC = {
    **dict.fromkeys(["DEFAULT_MEMORY_BUDGET", "MinibatchCKA", "TokenShuffler", "choose_cka_estimator", "cka_to_last",
                     "linear_cka", "linear_cka_from_moments", "neighbour_cka"], "cka"),
    **dict.fromkeys(["aggregate_covariance", "aggregate_entropy", "aggregate_entropy2_closed_form", "effective_rank", "redundancy2_closed_form",
                     "layer_entropies", "matrix_entropy", "purity", "redundancy", "renyi_entropy"], "entropy"),
    **dict.fromkeys(["LayerMoments", "gather_layer_rows"], "moments"),
    **dict.fromkeys(["ProbeResult", "ProbeSettings", "probe_layer_sets", "score_layer_sets"], "probe"),
    **dict.fromkeys(["GroupAssigner", "GroupedLayerMoments", "Jackknife", "jackknife"], "resampling"),
}


def __getattr__(name: str) -> Any:
    return lazy_getattr(__name__, _PUBLIC, globals(), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = ["compartment_costs", "compartment_label", "compartment_of", "compartment_stability", "compartments",
           "mean_silhouette"]
__all__ += sorted(_PUBLIC)  # the lazily imported names
