"""The best drafter this CPU trains within a stated budget, and its tau/speedup on MT-bench.

Builds (or reuses) a feature store of the ShareGPT training split at the chosen layer ids, trains
one EAGLE-3 head for ``--train-tokens`` tokens (several epochs over the store when larger), then
benchmarks it with ``wavesurf.bench.run_bench`` against HF greedy ``generate``, our plain loop and
HF prompt lookup, for each drafting shape given. Every step is cached, so an interrupted run
resumes. Prints one JSON object: budgets, training time and throughput, tau, speedup per shape.

    WAVESURF_THREADS=2 python benchmarks/best_drafter.py --store-tokens 150000 --train-tokens 1200000
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="default", help="vLLM ids like 2,15,27, or 'default' ([2, N//2, N-3])")
    ap.add_argument("--store-tokens", type=int, default=150_000)
    ap.add_argument("--train-tokens", type=int, default=1_200_000)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--n-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--shapes", default="chain3,chain5,tree5x4x16",
                    help="chainK or treeDEPTHxTOPKxTOTAL, comma-separated")
    args = ap.parse_args()

    from wavesurf.bench import BenchSettings, run_bench
    from wavesurf.drafter.features import FeatureSettings, build_feature_store
    from wavesurf.drafter.head import load_head
    from wavesurf.drafter.train import TrainSettings, train_drafter
    from wavesurf.models import configure_torch, load_target, processor_name

    configure_torch()
    import torch

    target = load_target(args.model, device="cpu")
    ids = target.default_layer_ids() if args.layers == "default" else [int(x) for x in args.layers.split(",")]
    t0 = time.perf_counter()
    store = build_feature_store(target, FeatureSettings(max_tokens=args.store_tokens, layer_ids=ids))
    store_seconds = time.perf_counter() - t0
    settings = TrainSettings(ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab, lr=args.lr,
                             batch_tokens=args.batch_tokens, train_tokens=args.train_tokens, warmup_steps=50,
                             checkpoint_every=100)
    result = train_drafter(target, store, ids, settings)
    head, _ = load_head(result.out_dir, target)
    out = {"model": target.name, "layer_ids": ids, "processor": processor_name(), "machine": platform.machine(), "threads": torch.get_num_threads(),
           "store_tokens": store.tokens, "store_seconds_this_run": round(store_seconds, 1),
           "train": {"train_tokens": result.train_tokens, "steps": result.steps, "seconds": round(result.seconds, 1),
                     "tokens_per_second": round(result.tokens_per_second, 1), "ttt_steps": args.ttt_steps,
                     "draft_vocab_size": args.draft_vocab, "vocab_coverage": result.vocab_coverage,
                     "accuracy_per_step": [round(a, 4) for a in result.accuracy], "drafter": result.out_dir},
           "bench": {}}
    for shape in args.shapes.split(","):
        if shape.startswith("chain"):
            kw = {"mode": "chain", "draft_len": int(shape[5:])}
        else:
            depth, top_k, total = (int(x) for x in shape[4:].split("x"))
            kw = {"mode": "tree", "depth": depth, "top_k": top_k, "total_tokens": total}
        run = run_bench(target, head, args.dataset,
                        BenchSettings(n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens, **kw))
        out["bench"][shape] = {m: {k: v[k] for k in ("tau", "speedup", "mean_tokens_per_second", "lossless") if k in v}
                               for m, v in run.summary["methods"].items()}
        print(json.dumps({shape: out["bench"][shape]}), flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
