"""Numerical core: streaming float64 moments, matrix entropy (nats), linear CKA, depth compartments."""

from wavesurf.stats.cka import (
    DEFAULT_MEMORY_BUDGET,
    MinibatchCKA,
    TokenShuffler,
    choose_cka_estimator,
    cka_to_last,
    linear_cka,
    linear_cka_from_moments,
    neighbour_cka,
)
from wavesurf.stats.compartments import compartment_costs, compartment_stability, compartments, mean_silhouette
from wavesurf.stats.entropy import (
    aggregate_covariance,
    aggregate_entropy,
    aggregate_entropy2_closed_form,
    effective_rank,
    layer_entropies,
    matrix_entropy,
    purity,
    redundancy,
    renyi_entropy,
)
from wavesurf.stats.moments import LayerMoments, gather_layer_rows

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "LayerMoments",
    "MinibatchCKA",
    "TokenShuffler",
    "aggregate_covariance",
    "aggregate_entropy",
    "aggregate_entropy2_closed_form",
    "choose_cka_estimator",
    "cka_to_last",
    "compartment_costs",
    "compartment_stability",
    "compartments",
    "effective_rank",
    "gather_layer_rows",
    "layer_entropies",
    "linear_cka",
    "linear_cka_from_moments",
    "matrix_entropy",
    "mean_silhouette",
    "neighbour_cka",
    "purity",
    "redundancy",
    "renyi_entropy",
]
