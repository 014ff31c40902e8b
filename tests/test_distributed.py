"""Statistics split over two processes (torchrun, gloo on CPU) equal a single-process run."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ARRAYS = ("entropy", "entropy2", "normalized_entropy", "purity", "trace", "cka")
ARGS = ["--dataset", "sharegpt", "--max-tokens", "1200", "--max-len", "128", "--batch-tokens", "256",
        "--filter", "q0.5", "--pilot-tokens", "300", "--estimator", "exact", "--quiet"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(tiny_model_dir, tmp_path, monkeypatch):
    from wavesurf.models import load_target
    from wavesurf.stats.analysis import AnalysisSettings, analyze
    from wavesurf.stats.store import load_stats

    model_dir, _ = tiny_model_dir("llama")
    env = {**os.environ, "WAVESURF_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "-m", "wavesurf.cli", "analyze", "--model", str(model_dir), *ARGS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # only the first process prints
    multi = load_stats(Path(summary["results"]))
    assert multi.meta["processes"] == 2

    monkeypatch.setenv("WAVESURF_CACHE", str(tmp_path / "single"))
    settings = AnalysisSettings(dataset="sharegpt", split="stats", max_tokens=1200, max_len=128, batch_tokens=256,
                                filter="q0.5", pilot_tokens=300, estimator="exact")
    single = analyze(load_target(str(model_dir), device="cpu"), settings, use_cache=False, progress=False)
    assert multi.key == single.key  # the same cache entry: a distributed run fills it for everyone
    assert multi.meta["filter"] == single.meta["filter"]  # same pilot threshold, same kept tokens
    assert multi.meta["tokens"] == single.meta["tokens"]
    for subset in ("main", "control"):
        a, b = getattr(multi, subset), getattr(single, subset)
        for name in ARRAYS:
            x, y = np.asarray(getattr(a, name), dtype=np.float64), np.asarray(getattr(b, name), dtype=np.float64)
            assert x.shape == y.shape
            np.testing.assert_allclose(x, y, rtol=1e-10, atol=0, err_msg=f"{subset}.{name}")
    assert multi.main.compartments == single.main.compartments


def test_launcher_environment_errors(monkeypatch):
    from wavesurf.distributed import DistributedError, Shard, init_from_env

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_from_env() == Shard()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(DistributedError, match="WORLD_SIZE='two' is not an integer"):
        init_from_env()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DistributedError, match="MASTER_ADDR is not set"):
        init_from_env()


def test_shard_ownership():
    from wavesurf.distributed import Shard

    shards = [Shard(r, 3) for r in range(3)]
    assert [[i for i in range(7) if s.owns(i)] for s in shards] == [[0, 3, 6], [1, 4], [2, 5]]
    s = Shard(1, 2, pilot_done=False)
    assert s.wants(0) and s.wants(1)  # pilot: every batch
    s.pilot_done = True
    assert not s.wants(0) and s.wants(1)
