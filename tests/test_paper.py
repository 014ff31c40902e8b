"""What the paper-companion notebooks share: closed-form set scores over layer sets (the selection
and sweep tables, with their intervals and interval prose, are tested in tests/test_select.py)."""
from __future__ import annotations

import numpy as np
import pytest

from wavesurf import paper


def test_closed_forms_match_exact_entropies(small_stats):
    """alpha=2 aggregate entropy and redundancy from purities + CKA equal the eigenvalue versions."""
    sets = [[2, 15, 27], [1, 2], [5, 20, 29, 30]]
    for s in sets:
        assert paper.aggregate_entropy2(small_stats, [s])[0] == pytest.approx(small_stats.aggregate_entropy(s, alpha=2.0), abs=1e-5)
        assert paper.redundancy2(small_stats, [s])[0] == pytest.approx(small_stats.redundancy(s, alpha=2.0), abs=1e-5)
    m = paper.pair_matrix(small_stats)
    assert m.shape == (31, 31) and np.allclose(m, m.T)
    assert np.allclose(np.diag(m), small_stats.entropy2, atol=1e-8)  # a single layer: its own S2
    assert np.all(paper.redundancy2(small_stats, paper.all_subsets(range(1, 31), 2)) >= -1e-9)
    with pytest.raises(Exception, match="layer id 99"):
        paper.aggregate_entropy2(small_stats, [[1, 99]])


def test_subsets_rank_and_ids():
    assert paper.all_subsets(range(1, 31), 3).shape == (4060, 3)
    assert paper.rank_of(np.array([3.0, 2.0, 1.0]), 2.0) == (2, 1 / 3)
    assert paper.fmt_ids(np.array([2, 15, 27])) == "[2, 15, 27]"
