"""The layer sets the speed table trains: the default rule, each method's picks, the controls."""
from __future__ import annotations

import pytest

from wavesurf.book.table_sets import evenly_spaced, layer_sets, random_sets
from wavesurf.errors import WavesurfError


def test_evenly_spaced_and_random_sets():
    assert evenly_spaced(30, 3) == [10, 20, 30]
    assert evenly_spaced(18, 3) == [6, 12, 18]
    a = random_sets(30, 3, 5, seed=1, avoid=[[1, 2, 3]])
    assert a == random_sets(30, 3, 5, seed=1, avoid=[[1, 2, 3]])  # seeded
    assert len({tuple(s) for s in a}) == 5 and all(len(s) == 3 and 1 <= min(s) and max(s) <= 30 for s in a)
    with pytest.raises(WavesurfError, match="cannot draw 5 distinct"):
        random_sets(4, 3, 5, seed=0)


def test_layer_sets_cover_default_methods_and_controls(small_stats):
    sets = layer_sets(small_stats, k=3, n_random=2, seed=0)
    names = {s.name for s in sets} | {a for s in sets for a in s.aliases}
    assert {"default", "entropy", "aggregate", "cka", "combined", "last-3", "even-3", "last-1",
            "random-1", "random-2"} <= names
    by_name = {s.name: s for s in sets}
    assert by_name["default"].layer_ids == [2, 15, 27]
    assert by_name["last-1"].layer_ids == [30] and by_name["last-3"].layer_ids == [28, 29, 30]
    ids = [tuple(s.layer_ids) for s in sets]
    assert len(ids) == len(set(ids))  # duplicates merged into aliases
    assert all(s.group in ("default", "selected", "control") for s in sets)
