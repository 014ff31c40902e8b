"""What the paper-companion notebooks share beyond the statistics: ranks and ids in prose (the
set scores are LayerStats methods, tested in tests/stats/test_analysis.py; the tables and interval
prose in tests/test_select.py)."""
from __future__ import annotations

import numpy as np

from wavesurf.book import paper


def test_rank_and_ids():
    assert paper.rank_of(np.array([3.0, 2.0, 1.0]), 2.0) == (2, 1 / 3)
    assert paper.fmt_ids(np.array([2, 15, 27])) == "[2, 15, 27]"
