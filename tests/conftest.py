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
