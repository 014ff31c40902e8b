"""Drafter training throughput: real tokens per second through ``train_drafter`` (TTT unroll,
forward + backward + AdamW), this checkout against a baseline commit, at the same settings, on
the same feature store, alternating the two in rounds so that drift of the machine hits both.

    python benchmarks/train_throughput.py [--baseline-rev 111d6ab] [--threads 1,2] [--rounds 3]
        [--configs default,f32-1024] [--steps 30] [--store-tokens 8192]

Each measurement is one fresh process (``--worker``) that loads the target, trains ``--steps``
optimizer steps after ``--warmup`` untimed ones and prints its tokens/s; the baseline's process
imports ``wavesurf`` from a temporary ``git worktree`` of ``--baseline-rev`` (removed afterwards).
The ratio per round is this checkout's tokens/s over the baseline's; the result gives the median
ratio and its range over rounds per configuration and thread count, written as JSON under
``benchmarks/results/`` (host, threads, load, commit, date). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent

#: training settings measured: the default profile's heads, and the recipe before it (1,024-token
#: float32 batches), both with the default profile's unroll, vocabulary and learning rate
CONFIGS = {
    "default": {"batch_tokens": 128, "precision": "bfloat16"},
    "f32-1024": {"batch_tokens": 1024, "precision": "float32"},
    "bf16-1024": {"batch_tokens": 1024, "precision": "bfloat16"},
}
COMMON = {"ttt_steps": 3, "draft_vocab_size": 4096, "lr": 1e-3, "warmup_steps": 10}


def feature_store(target: Any, layers: list[int], tokens: int, path: Path) -> Any:
    """The feature store both checkouts (and ``train_profile.py``) train from: ``tokens`` tokens of
    the ShareGPT train split, features of ``layers`` only."""
    from wavesurf.drafter.features import FeatureSettings, build_feature_store

    return build_feature_store(target, FeatureSettings(dataset="sharegpt", split="train", max_len=512,
                                                       max_tokens=tokens, layer_ids=layers),
                               path=path, progress=False)


def bench_settings(config: str, steps: int, warmup: int) -> Any:
    """The ``TrainSettings`` of one measurement: ``config`` over :data:`COMMON`, ``warmup + steps``
    optimizer steps, no checkpoints; log_every=1, so every step's record carries the real tokens so
    far (batches come in one seeded order, so every run times the same batches)."""
    from wavesurf.drafter.train import TrainSettings

    return TrainSettings(**COMMON, **CONFIGS[config], max_steps=warmup + steps, checkpoint_every=10**6, log_every=1)


def step_clock(warmup: int) -> tuple[Callable[[int, dict], None], dict[str, float]]:
    """A ``train_drafter`` callback and the marks it fills: time and real tokens at the end of step
    ``warmup`` (``t0``, ``tok0``) and of the latest step (``t1``, ``tok1``)."""
    marks: dict[str, float] = {}

    def clock(step: int, record: dict) -> None:
        if step == warmup:
            marks["t0"], marks["tok0"] = time.perf_counter(), record["tokens"]
        marks["t1"], marks["tok1"] = time.perf_counter(), record["tokens"]

    return clock, marks


def worker(args: argparse.Namespace) -> None:
    """One measurement in this process: tokens/s over ``steps`` optimizer steps after ``warmup``."""
    import torch

    from wavesurf.drafter.features import FeatureStore
    from wavesurf.drafter.train import train_drafter
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    target = load_target(args.model)
    store = FeatureStore(args.store)
    layers = [int(x) for x in args.layers.split(",")]
    settings = bench_settings(args.config, args.steps, args.warmup)
    clock, timed = step_clock(args.warmup)

    out = Path(tempfile.mkdtemp(prefix="wavesurf-train-bench-run-"))
    try:
        train_drafter(target, store, layers, settings, out / "head", progress=False, callback=clock)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    seconds = timed["t1"] - timed["t0"]
    print(json.dumps({"tok_per_s": (timed["tok1"] - timed["tok0"]) / seconds, "ms_per_step": 1000 * seconds / args.steps,
                      "threads": torch.get_num_threads()}))


def run_worker(src: Path, args: argparse.Namespace, config: str, threads: int, store: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "WAVESURF_THREADS": str(threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--store", str(store),
           "--layers", args.layers, "--config", config, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=src)
    if done.returncode != 0:
        raise SystemExit(f"worker failed in {src}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="2,15,27", help="vLLM ids the heads read")
    ap.add_argument("--baseline-rev", default="111d6ab", help="commit to compare with (before issue 30's speed-ups)")
    ap.add_argument("--configs", default="default,f32-1024", help=f"among {', '.join(CONFIGS)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="timed optimizer steps per measurement")
    ap.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    ap.add_argument("--store-tokens", type=int, default=8192)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", default="", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs {bad}: not among {', '.join(CONFIGS)}")
    threads = [int(t) for t in args.threads.split(",")]
    sys.path.insert(0, str(ROOT))
    from _common import write_result

    from wavesurf.models import configure_torch, load_target

    work = Path(tempfile.mkdtemp(prefix="wavesurf-train-bench-"))
    tree = work / "baseline"
    load_before = os.getloadavg()[0]
    try:
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline_rev], cwd=ROOT, check=True,
                       capture_output=True)
        configure_torch()
        target = load_target(args.model)
        layers = [int(x) for x in args.layers.split(",")]
        store = feature_store(target, layers, args.store_tokens, work / "store")
        del target
        rows = []
        for config in configs:
            for t in threads:
                for r in range(args.rounds):
                    order = [("baseline", tree), ("current", ROOT)] if r % 2 == 0 else [("current", ROOT), ("baseline", tree)]
                    got = {name: run_worker(src, args, config, t, store.path) for name, src in order}
                    row = {"config": config, "threads": t, "round": r,
                           "baseline_tok_per_s": round(got["baseline"]["tok_per_s"], 1),
                           "current_tok_per_s": round(got["current"]["tok_per_s"], 1),
                           "ratio": round(got["current"]["tok_per_s"] / got["baseline"]["tok_per_s"], 3)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        summary = []
        for config in configs:
            for t in threads:
                mine = [r for r in rows if r["config"] == config and r["threads"] == t]
                ratios = [r["ratio"] for r in mine]
                summary.append({"config": config, "threads": t, **CONFIGS[config], **COMMON,
                                "baseline_tok_per_s": round(median(r["baseline_tok_per_s"] for r in mine), 1),
                                "current_tok_per_s": round(median(r["current_tok_per_s"] for r in mine), 1),
                                "ratio_median": round(median(ratios), 3), "ratio_min": min(ratios),
                                "ratio_max": max(ratios)})
        payload = {"baseline_rev": args.baseline_rev, "model": args.model, "layers": layers,
                   "store_tokens": store.tokens, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                   "load_before": round(load_before, 2), "quiet": load_before < 0.5, "summary": summary, "rows": rows}
        print(json.dumps(summary, indent=1))
        print("written", write_result("train_throughput", payload))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
