"""Shared fixtures: the real embedded models, loaded once per test session.

Tests run offline on the packaged assets with small token budgets; nothing is mocked.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm():
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    return load_target("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def gemma():
    from wavesurf.models import load_target

    return load_target("gemma3-270m", device="cpu")


@pytest.fixture(scope="session")
def sharegpt():
    from wavesurf.data import load_corpus

    return load_corpus("sharegpt")


# A small real capture of ShareGPT's statistics split, shared by the statistics and selection tests.
SMALL = {"dataset": "sharegpt", "split": "stats", "max_tokens": 1500, "max_len": 128, "batch_tokens": 1024}


@pytest.fixture(scope="session")
def small_batches(smollm):
    from wavesurf.capture import capture
    from wavesurf.data import load_corpus

    corpus = load_corpus(SMALL["dataset"], split=SMALL["split"])
    return list(capture(smollm, corpus, SMALL["max_tokens"], max_len=SMALL["max_len"],
                        batch_tokens=SMALL["batch_tokens"], progress=False))


@pytest.fixture(scope="session")
def small_stats(smollm):
    """The cached analysis the CLI tests reuse (same settings => same cache key)."""
    from wavesurf.stats.analysis import analyze

    return analyze(smollm, progress=False, **SMALL)
