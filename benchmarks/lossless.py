"""Is greedy speculative decoding token-identical to HF ``generate(do_sample=False)``?

Runs MT-bench (turn 1), HumanEval and held-out ShareGPT prompts on the embedded targets and prints,
per target and dataset, how many outputs are identical, how many near-tie re-checks were made and
where any mismatch starts.

Drafters: ``untrained`` (default; a deterministic untrained head, drafts are rejected, every
decision is read from a multi-token verify forward), ``oracle`` (:mod:`wavesurf.drafter.oracle`, ranking HF's own
continuation first or second: long accepted paths and
non-contiguous cache rows), or a drafter directory (``save_head`` output; needs one --targets).
``--lookup-ngram 3`` drafts each chain's first tokens by n-gram lookup; ``--guard`` runs the
run-time guard (:mod:`wavesurf.drafter.guard`) with a window of 2 cycles and pauses from 4 tokens
on a cost model in which every drafted token adds a plain forward's cost (so drafting loses unless
nearly every draft is accepted): the head pauses and resumes often, which is what this checks. On
measured costs it may never pause (on an AMD EPYC a 5-token verify costs less than a 1-token one).

    WAVESURF_THREADS=1 OMP_NUM_THREADS=1 python benchmarks/lossless.py --n-per-dataset 34
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from wavesurf.bench import bench_prompts, prompt_ids, untrained_head
    from wavesurf.drafter.decode import DEFAULT_TIE_EPS, SpeculativeDecoder, hf_generate, make_tree
    from wavesurf.drafter.guard import DraftGuard
    from wavesurf.drafter.head import load_head
    from wavesurf.models import configure_torch, load_target, processor_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--datasets", default="mt-bench,humaneval,sharegpt")
    ap.add_argument("--n-per-dataset", type=int, default=34, help="prompts per dataset and target (default 34)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--mode", choices=["chain", "tree"], default="chain")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=3)
    ap.add_argument("--total-tokens", type=int, default=10)
    ap.add_argument("--tie-eps", type=float, default=DEFAULT_TIE_EPS)
    ap.add_argument("--drafter", default="untrained", help="untrained, oracle, or a drafter directory")
    ap.add_argument("--min-confidence", type=float, default=0.0, help="stop drafting below this path probability")
    ap.add_argument("--no-packed", action="store_true", help="verify with HF's plain linear kernels")
    ap.add_argument("--lookup-ngram", type=int, default=0, help="chain: n-gram lookup first (0 = the head alone)")
    ap.add_argument("--guard", action="store_true", help="chain: the run-time guard, window 2, pauses from 4 tokens")
    args = ap.parse_args()
    configure_torch()
    tree = make_tree(args.mode, draft_len=args.draft_len, depth=args.depth, top_k=args.top_k,
                     total_tokens=args.total_tokens)
    import torch

    report: dict = {"settings": {**vars(args), "tree": tree.describe(), "processor": processor_name(), "threads": torch.get_num_threads()},
                    "targets": {}}
    total = same = 0
    t0 = time.perf_counter()
    for name in args.targets.split(","):
        target = load_target(name, device="cpu")
        per: dict = {}
        costs = None
        if args.guard:
            from wavesurf.drafter.adaptive import CostModel

            costs = CostModel(target.name, torch.get_num_threads(), 256,
                              tuple(1.0 + k for k in range(tree.depth + 1)), 0.1, 1.0, 1.0)
        for ds in args.datasets.split(","):
            prompts = bench_prompts(ds, args.n_per_dataset, target, max_prompt_tokens=384)
            stats = {"prompts": 0, "identical": 0, "tie_rechecks": 0, "paused_tokens": 0, "mean_tau": 0.0,
                     "mismatches": []}
            for p in prompts:
                ids = prompt_ids(target, p, [])
                ref = hf_generate(target, ids, args.max_new_tokens).tokens
                if args.drafter == "untrained":
                    head = untrained_head(target)
                elif args.drafter == "oracle":
                    from wavesurf.drafter.oracle import OracleHead

                    head = OracleHead(target, list(map(int, ids)) + ref, miss_every=3)
                else:
                    head, _ = load_head(args.drafter, target)
                guard = DraftGuard(costs, window=2, pause=4) if costs is not None else None
                got = SpeculativeDecoder(target, head, tree, tie_eps=args.tie_eps, packed=False if args.no_packed else None,
                                         min_confidence=args.min_confidence, lookup_ngram=args.lookup_ngram,
                                         guard=guard).generate(ids, args.max_new_tokens)
                stats["prompts"] += 1
                stats["tie_rechecks"] += got.tie_rechecks
                stats["paused_tokens"] += got.paused_tokens
                stats["mean_tau"] += got.tau / len(prompts)
                if got.tokens == ref:
                    stats["identical"] += 1
                else:
                    first = next((i for i, (a, b) in enumerate(zip(got.tokens, ref)) if a != b), min(len(got.tokens), len(ref)))
                    stats["mismatches"].append({"prompt": p.id, "first_diff_at": first})
                print(f"{name} {ds} {p.id}: {'ok' if got.tokens == ref else 'DIFF'} tau={got.tau:.2f} "
                      f"rechecks={got.tie_rechecks}", file=sys.stderr, flush=True)
            stats["mean_tau"] = round(stats["mean_tau"], 3)
            per[ds] = stats
            total += stats["prompts"]
            same += stats["identical"]
        report["targets"][name] = per
    report["identical"] = f"{same}/{total}"
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
