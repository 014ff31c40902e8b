"""Drafter training throughput (real tokens per second through the TTT loop, forward + backward +
AdamW) for several unroll lengths and draft-vocabulary sizes, beside the throughput of building
the feature store those tokens come from. Prints numbers and ratios measured in this one run.

Threads: whatever the process is given (``WAVESURF_THREADS``, else all cores).

    WAVESURF_THREADS=1 python benchmarks/train_throughput.py [--model smollm2-135m] [--store-tokens 6144]
        [--batch-tokens 1024] [--steps 4] [--ttt 1,3,7] [--vocab 8192,32000]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="default", help="vLLM ids, e.g. 2,15,27 (default: [2, N//2, N-3])")
    ap.add_argument("--store-tokens", type=int, default=6144)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps timed per configuration (after one warm-up step)")
    ap.add_argument("--ttt", default="1,3,7")
    ap.add_argument("--vocab", default="8192,32000")
    args = ap.parse_args()

    import torch

    from wavesurf.drafter.features import build_feature_store
    from wavesurf.drafter.train import TrainSettings, train_drafter
    from wavesurf.models import configure_torch, load_target, processor_name

    configure_torch()
    target = load_target(args.model, device="cpu")
    layers = target.default_layer_ids() if args.layers == "default" else [int(x) for x in args.layers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="wavesurf-train-bench-"))
    old_cache = os.environ.get("WAVESURF_CACHE")
    try:
        os.environ["WAVESURF_CACHE"] = str(work / "cache")  # vocab counts; the model is already loaded
        t0 = time.perf_counter()
        store = build_feature_store(target, path=work / "store", max_tokens=args.store_tokens, max_len=args.max_len,
                                    batch_tokens=args.batch_tokens, layer_ids=layers, progress=False)
        build_s = time.perf_counter() - t0
        build_tps = store.tokens / build_s
        rows = []
        for vocab in (int(v) for v in args.vocab.split(",")):
            for ttt in (int(s) for s in args.ttt.split(",")):
                settings = TrainSettings(ttt_steps=ttt, draft_vocab_size=vocab, batch_tokens=args.batch_tokens,
                                         max_steps=args.steps + 1, warmup_steps=1, checkpoint_every=10**6,
                                         log_every=1)
                timed: dict[str, float] = {}

                def clock(step: int, record: dict, timed=timed) -> None:
                    if step == 1:  # warm-up step excluded
                        timed["t0"], timed["tok0"] = time.perf_counter(), record["tokens"]
                    timed["t1"], timed["tok1"] = time.perf_counter(), record["tokens"]

                train_drafter(target, store, layers, settings, work / f"run-{ttt}-{vocab}", progress=False,
                                    callback=clock)
                tps = (timed["tok1"] - timed["tok0"]) / (timed["t1"] - timed["t0"])
                rows.append({"ttt_steps": ttt, "draft_vocab": vocab, "train_tok_per_s": round(tps, 1),
                             "train_over_store_build": round(tps / build_tps, 3),
                             "ms_per_step": round(1000 * (timed["t1"] - timed["t0"]) / args.steps, 1)})
                print(json.dumps(rows[-1]), flush=True)
        print(json.dumps({
            "model": target.name, "processor": processor_name(), "layers": layers, "threads": torch.get_num_threads(),
            "store_tokens": store.tokens, "store_build_tok_per_s": round(build_tps, 1),
            "store_bytes_per_token": round(store.bytes_per_token, 1), "batch_tokens": args.batch_tokens,
            "timed_steps": args.steps, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "rows": rows}, indent=2))
    finally:
        if old_cache is None:
            os.environ.pop("WAVESURF_CACHE", None)
        else:
            os.environ["WAVESURF_CACHE"] = old_cache
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
