"""Layer sets as arrays: the candidates every set-scoring statistic and selection method ranks.
Its own module so that ``stats`` (the probe) and ``select`` both use it without ``stats``
importing the selection layer above it."""
from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np


def all_subsets(layer_ids: Iterable[int], k: int) -> np.ndarray:
    """Every k-subset of ``layer_ids`` as an ``[m, k]`` int64 array (sorted rows, lexicographic)."""
    return np.array(list(itertools.combinations(sorted(layer_ids), k)), dtype=np.int64).reshape(-1, k)


__all__ = ["all_subsets"]
