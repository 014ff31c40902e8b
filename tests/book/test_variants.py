"""The profile's analysis variants: one shared capture equals separate analyses, the cached-results
lookup matches settings exactly, and the smoke profile shares the unit tests' analysis."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from wavesurf.book.notebook import check_parameters
from wavesurf.book.profiles import PROFILES
from wavesurf.book import variants as stats_variants

from tests.conftest import SMALL


def test_smoke_profile_shares_the_unit_tests_analysis():
    """The smoke base analysis is the conftest SMALL analysis (one cached result for both)."""
    params = check_parameters("smollm2-135m", "sharegpt", None, "smoke", 0, "cpu")
    base = stats_variants.analysis_variants(params)["base"]
    for k, v in SMALL.items():
        assert getattr(base, k) == v
    assert base.filter == "none" and base.estimator == "auto" and not base.include_position0


def test_cached_results_match_settings_exactly(small_stats):
    from dataclasses import replace

    from wavesurf.stats.analysis import AnalysisSettings

    settings = AnalysisSettings(**SMALL)
    found = stats_variants.cached_results(settings)
    assert "smollm2-135m" in [s.meta["model"] for s in found]
    other = replace(settings, max_tokens=SMALL["max_tokens"] + 1)
    assert "smollm2-135m" not in [s.meta["model"] for s in stats_variants.cached_results(other)]


def test_profile_stats_one_capture_equals_separate_analyses(smollm, monkeypatch):
    """Variants computed from one shared capture equal what analyze() computes alone."""
    from wavesurf.stats.analysis import analysis_key, analyze
    from wavesurf.stats.store import result_dir

    monkeypatch.setitem(PROFILES, "tiny", {"description": "test", "drafter": {}, "analysis": {
        "max_tokens": 900, "max_len": 96, "batch_tokens": 768, "pilot_tokens": 8192, "estimator": "minibatch",
        "selection_filter": "q0.25", "selection_estimator": "minibatch", "sweep_filters": [],
        "sweep_estimator": "minibatch", "minibatch_size": 64, "resample_groups": 3}})
    params = check_parameters("smollm2-135m", "sharegpt", None, "tiny", 0, "cpu")
    variants = stats_variants.analysis_variants(params)
    for s in variants.values():  # start from an empty cache for these settings
        shutil.rmtree(result_dir(smollm.name, analysis_key(smollm, s)[0]), ignore_errors=True)
    got = stats_variants.profile_stats(smollm, params, progress=False)
    assert set(got) == {"base", "position0", "selection"}
    assert got["base"].meta["shared_capture"]["variants"] == 3
    alone = analyze(smollm, variants["selection"], use_cache=False, progress=False)
    np.testing.assert_allclose(got["selection"].entropy, alone.entropy, rtol=1e-6)
    np.testing.assert_allclose(got["selection"].cka, alone.cka, rtol=1e-5, atol=1e-6)
    assert got["selection"].meta["filter"] == alone.meta["filter"]
    # the resampling groups follow the corpus order, not the batching: same replicates (or same note)
    assert got["selection"].main.interval_note == alone.main.interval_note
    if alone.has_intervals:
        np.testing.assert_allclose(got["selection"].main.replicates["entropy"], alone.main.replicates["entropy"], rtol=1e-6)
    assert got["position0"].main.n_tokens > got["base"].main.n_tokens  # position 0 rows are added
    again = stats_variants.profile_stats(smollm, params, ["selection"], progress=False)  # from the cache now
    assert again["selection"].path is not None and "shared_capture" in again["selection"].meta
    with pytest.raises(ValueError, match="unknown analysis variant"):
        stats_variants.profile_stats(smollm, params, ["sweep:q0.9"])


def test_served_variants_read_the_drafters_answers(smollm):
    """The served-position variants: assistant tokens of the target's own training answers (the
    smoke profile's, distilled here if missing), whole answers, as many positions as the
    all-positions budget or every answer, the selection filter on the second."""
    from wavesurf.data import load_corpus, tokens_for_role_positions

    params = check_parameters("smollm2-135m", "sharegpt", None, "smoke", 0, "cpu")
    got = stats_variants.served_variants(smollm, params, progress=False)
    assert list(got) == list(stats_variants.SERVED_VARIANTS)
    a, d = PROFILES["smoke"]["analysis"], PROFILES["smoke"]["drafter"]["distill"]
    served, selection = got["served"], got["served:selection"]
    assert served.dataset.startswith("sharegpt@smollm2-135m#") and served.split == "train"
    assert served.roles == selection.roles == "assistant"
    assert served.max_len == max(a["max_len"], d["max_len"]) and served.filter in (None, "none")
    assert selection.filter == a["selection_filter"] and served.min_tokens == a["served_min_tokens"]
    corpus = load_corpus(served.dataset, split="train")
    assert served.max_tokens == tokens_for_role_positions(corpus, smollm.tokenizer, smollm.has_chat_template,
                                                          a["max_tokens"], max_len=served.max_len)


def test_selection_reads_the_variant_the_profile_names(monkeypatch):
    from wavesurf.book.profiles import get_profile
    from wavesurf.errors import ProfileError, WavesurfError

    params = check_parameters("smollm2-135m", "sharegpt", None, "smoke", 0, "cpu")
    assert stats_variants.selection_variant_names(params) == ("base", "selection")
    spec = {**PROFILES["smoke"], "analysis": {**PROFILES["smoke"]["analysis"], "selection_positions": "served"}}
    monkeypatch.setitem(PROFILES, "served-test", spec)
    params = check_parameters("smollm2-135m", "sharegpt", None, "served-test", 0, "cpu")
    assert stats_variants.selection_variant_names(params) == stats_variants.SERVED_VARIANTS
    for key, bad, match in (("selection_positions", "answers", r"'answers' is not one of \('all', 'served'\)"),
                            ("served_min_tokens", 1, "integer >= 2")):
        monkeypatch.setitem(PROFILES, "bad-test", {**spec, "analysis": {**spec["analysis"], key: bad}})
        with pytest.raises(ProfileError, match=match):
            get_profile("bad-test")
    with pytest.raises(WavesurfError, match="served:selection"):  # the error lists the served variants too
        stats_variants.profile_stats(None, params, ["nonsense"])
