"""Drafter fixtures: a tiny real feature store of SmolLM2 on ShareGPT's training split, and a
per-test cache directory (set only after the model is loaded, so the model cache is untouched)."""
from __future__ import annotations

import pytest

#: parameters of the shared tiny store; tests that rebuild it elsewhere must get identical shards
TINY = {"max_tokens": 2000, "max_len": 128, "batch_tokens": 512, "layer_ids": [1, 2, 15, 27]}


@pytest.fixture
def tmp_cache(smollm, monkeypatch, tmp_path):
    """WAVESURF_CACHE -> a fresh directory for results written by the test (vocab counts, stores);
    its ``models`` links to the real model cache, so a CLI call does not dequantize again."""
    from wavesurf.cache import cache_root

    models = cache_root() / "models"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(models, target_is_directory=True)
    monkeypatch.setenv("WAVESURF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def tiny_store(smollm, tmp_path_factory):
    from wavesurf.drafter.features import build_feature_store

    return build_feature_store(smollm, path=tmp_path_factory.mktemp("features") / "store", progress=False, **TINY)
