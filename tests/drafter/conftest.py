"""Drafter fixtures: a tiny real feature store of SmolLM2 on ShareGPT's training split (the
per-test cache directory ``tmp_cache`` is in ``tests/conftest.py``)."""
from __future__ import annotations

import pytest

#: parameters of the shared tiny store; tests that rebuild it elsewhere must get identical shards
TINY = {"max_tokens": 2000, "max_len": 128, "batch_tokens": 512, "layer_ids": [1, 2, 15, 27]}


@pytest.fixture(scope="session")
def tiny_store(smollm, tmp_path_factory):
    from wavesurf.drafter.features import build_feature_store

    return build_feature_store(smollm, path=tmp_path_factory.mktemp("features") / "store", progress=False, **TINY)
