"""Speedup ceiling of our speculative decoder on this machine: a drafter that always guesses right
(the oracle head of ``tests/drafter/test_decode.py``, ranking HF's own continuation first) gives the
largest tau each tree shape allows, so tokens/s against HF greedy here is the best a trained head
could reach with that shape. Methods are interleaved per prompt; one warm-up run is excluded.
Speedups come with a 95% bootstrap interval over prompts, paired with HF greedy on each prompt
(``wavesurf.bench.speedup_interval``); the thread count and the 1-minute load are printed.

    python benchmarks/speed_ceiling.py --n-prompts 8            # both cores (default)
    WAVESURF_THREADS=1 python benchmarks/speed_ceiling.py       # one thread
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPES = {"chain2": ("chain", 2, 0, 0, 0), "chain3": ("chain", 3, 0, 0, 0), "chain4": ("chain", 4, 0, 0, 0), "chain6": ("chain", 6, 0, 0, 0),
          "tree4x2x8": ("tree", 0, 4, 2, 8), "tree6x3x16": ("tree", 0, 6, 3, 16)}


def main() -> None:
    from wavesurf.drafter.oracle import OracleHead
    import torch

    from wavesurf.bench import bench_prompts, prompt_ids, speedup_interval
    from wavesurf.drafter.decode import hf_generate, speculative_generate
    from wavesurf.models import configure_torch, load_target, processor_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--miss-every", type=int, default=0, help="make the oracle rank the right token second every n positions")
    args = ap.parse_args()
    configure_torch()
    target = load_target(args.model, device="cpu")
    prompts = bench_prompts(args.dataset, args.n_prompts + 1, target)
    tps: dict[str, list[float]] = {"hf_generate": []}
    rows: list[dict] = []
    taus: dict[str, list[float]] = {}
    for i, p in enumerate(prompts):
        ids = prompt_ids(target, p, [])
        ref = hf_generate(target, ids, args.max_new_tokens)
        head = OracleHead(target, list(map(int, ids)) + ref.tokens, miss_every=args.miss_every)
        runs = {"hf_generate": ref}
        for name, (mode, k, depth, top_k, total) in SHAPES.items():
            r = speculative_generate(target, head, ids, args.max_new_tokens, mode=mode, draft_len=k or 4,
                                     depth=depth or 4, top_k=top_k or 2, total_tokens=total or 8)
            assert r.tokens == ref.tokens
            runs[name] = r
        runs["hf_generate"] = hf_generate(target, ids, args.max_new_tokens)  # timed again after the others
        if i == 0:
            continue  # warm-up
        for name, r in runs.items():
            rows.append({"prompt_id": i, "method": name, "tokens_per_second": r.tokens_per_second})
            tps.setdefault(name, []).append(r.tokens_per_second)
            taus.setdefault(name, []).append(r.tau)
    base = sum(tps["hf_generate"]) / len(tps["hf_generate"])
    out = {"model": target.name, "processor": processor_name(), "threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2),
           "prompts": args.n_prompts, "max_new_tokens": args.max_new_tokens,
           "miss_every": args.miss_every, "hf_tokens_per_second": round(base, 2),
           "shapes": {n: {"tau": round(sum(taus[n]) / len(taus[n]), 2),
                          "speedup_vs_hf": round(sum(v) / len(v) / base, 2),
                          "speedup_ci95": [round(x, 2) for x in speedup_interval(rows, n) or []]}
                      for n, v in tps.items() if n != "hf_generate"}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
