"""What the statistics-cost benchmarks (``stats_cost.py``, ``interval_cost.py``) share: their
options and the capture stream they time. ``python benchmarks/<script>.py`` puts this folder first
on ``sys.path``, so the scripts import it as ``_common``."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stats_cost_parser(doc: str) -> argparse.ArgumentParser:
    """The options both scripts take: model, timed batches (after one warm-up), their size, the
    CKA minibatch size; a script adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, default=3, help="timed batches (after one warm-up)")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--minibatch-size", type=int, default=512)
    return ap


def capture_stream(args: argparse.Namespace) -> tuple[Any, list[int], Any, Any]:
    """Threads as the package sets them, the target, its layer ids 0..N, the ShareGPT statistics
    split and a capture generator of ``batches + 1`` batches (the first is the warm-up)."""
    import torch

    from wavesurf.capture import capture
    from wavesurf.data import load_corpus
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    print(f"torch threads: {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f} at start")
    target = load_target(args.model)
    ids = list(range(target.n_layers + 1))
    corpus = load_corpus("sharegpt", split="stats")
    stream = capture(target, corpus, (args.batches + 1) * args.batch_tokens, batch_tokens=args.batch_tokens,
                     progress=False)
    return target, ids, corpus, stream


def timed_batches(stream: Any, batches: int) -> Any:
    """``(k, batch, forward seconds)`` for the warm-up batch (``k = 0``) and ``batches`` timed ones of
    a :func:`capture_stream`: the capture forward of each batch is timed as the batch is drawn."""
    for k in range(batches + 1):
        t0 = time.perf_counter()
        batch = next(stream)
        yield k, batch, time.perf_counter() - t0


RESULTS = Path(__file__).resolve().parent / "results"


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write one benchmark's measurements as ``benchmarks/results/<name>-<date>.json`` with what they
    depend on: host CPU, torch threads, load average, commit (and whether the tree was dirty), date."""
    import torch

    from wavesurf.models import processor_name

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"benchmark": name, "date": now.isoformat(timespec="seconds"), "host": processor_name(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_average": round(os.getloadavg()[0], 2), "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}-{now.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps({**meta, **payload}, indent=1))
    return out
