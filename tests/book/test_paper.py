"""What the paper-companion notebooks share beyond the statistics: ranks and ids in prose (the
set scores are LayerStats methods, tested in tests/stats/test_analysis.py; the tables and interval
prose in tests/test_select.py)."""
from __future__ import annotations

import numpy as np

from wavesurf.book import paper


def test_rank_and_ids():
    assert paper.rank_of(np.array([3.0, 2.0, 1.0]), 2.0) == (2, 1 / 3)
    assert paper.fmt_ids(np.array([2, 15, 27])) == "[2, 15, 27]"


def test_profile_probe_follows_the_profile_and_scores_the_trained_sets(smollm):
    """The probe notebook 06 correlates with the heads: the profile's corpus and budget, every
    3-set of SmolLM2's 31 ids (4,495, under the 10,000 that are probed whole), the trained sets
    among them with their top-1 agreement."""
    import math

    from wavesurf.book.notebook import check_parameters
    from wavesurf.book.profiles import PROFILES

    params = check_parameters("smollm2-135m", "sharegpt", None, "smoke", 0, "cpu")
    trained = [[2, 15, 27], [1, 9, 29]]
    probe = paper.profile_probe(smollm, params, trained, progress=False)
    a = PROFILES["smoke"]["analysis"]
    assert probe.meta["settings"]["max_tokens"] == a["max_tokens"] and probe.meta["settings"]["split"] == "stats"
    assert probe.over == "all" and len(probe.layer_sets) == math.comb(smollm.n_layers + 1, 3)
    for ids in trained:
        assert np.isfinite(probe.score(ids)) and 0.0 <= probe.top1[tuple(ids)] <= 1.0


def test_jackknife_agreement_note_names_groups_and_refuses_to_call_it_stability():
    class Run:  # only the run metadata the note reads
        def __init__(self, groups):
            self.meta = {"intervals": {"groups": groups}} if groups is not None else {}

    note = paper.jackknife_agreement_note(Run(10))
    assert "jackknife agreement" in note and "not stability" in note
    assert "9 of 10 groups" in note and "1/3.0" in note  # sqrt(10 - 1) = 3
    assert "1/4.4" in paper.jackknife_agreement_note(Run(20))  # sqrt(19) = 4.36
    assert paper.jackknife_agreement_note(Run(None)) == "" and paper.jackknife_agreement_note(Run(0)) == ""
