"""Generation throughput of ``wavesurf distill`` (answer tokens per second) at batch 1 and batched,
with how many batched greedy answers equal batch-1 greedy before and after the near-tie re-decode;
each batch size with HF's plain kernels and with the oneDNN-packed weights ``distill`` uses.

Prompts: first user turns of ShareGPT's held-out split that fit ``--max-prompt`` tokens. Tokens
counted are the kept answer tokens (up to EOS or the budget), so rows that finish early in a batch
cost time without adding tokens, as they do in a real run. One run, numbers from this run only.

Threads: whatever the process is given (``WAVESURF_THREADS``, else all cores).

    python benchmarks/distill_throughput.py [--model smollm2-135m] [--prompts 16] [--new 32]
        [--batch-sizes 4,8,16] [--max-prompt 192]
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=16, help="prompts for the batched runs")
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts timed at batch 1 (the first ones)")
    ap.add_argument("--new", type=int, default=32, help="max new tokens per answer")
    ap.add_argument("--batch-sizes", default="4,8,16")
    ap.add_argument("--max-prompt", type=int, default=192)
    args = ap.parse_args()

    import torch

    from wavesurf.data import load_corpus
    from wavesurf.distill import generate_batch, prompt_ids
    from wavesurf.drafter.decode import eos_ids
    from wavesurf.models import configure_torch, load_target, processor_name
    from wavesurf.packed import packing_available

    configure_torch()
    target = load_target(args.model, device="cpu")
    eos = eos_ids(target)
    prompts = []
    for e in load_corpus("sharegpt", split="heldout").examples:
        users = [m for m in e.messages if m["role"] == "user"]
        if users and len(ids := prompt_ids(target, [users[0]])) <= args.max_prompt:
            prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    generate_batch(target, [prompts[0]], [4], eos=eos)  # warm-up

    def timed(group_size: int, subset: list[list[int]], tie_eps: float, packed: bool = False):
        t0, out = time.perf_counter(), []
        for b in range(0, len(subset), group_size):
            out += generate_batch(target, subset[b : b + group_size], [args.new] * len(subset[b : b + group_size]),
                                  eos=eos, tie_eps=tie_eps, packed=packed)
        return time.perf_counter() - t0, out

    n1 = min(args.batch1_prompts, len(prompts))
    sec1, alone = timed(1, prompts[:n1], 0)
    tok1 = sum(len(a.ids) for a in alone)
    rate1 = tok1 / sec1
    # batch-1 references for the prompts not timed at batch 1 (agreement only)
    alone += [generate_batch(target, [p], [args.new], eos=eos)[0] for p in prompts[n1:]]
    rows = [{"batch_size": 1, "prompts": n1, "tokens": tok1, "seconds": round(sec1, 2),
             "tokens_per_s": round(rate1, 1), "ratio_vs_batch1": 1.0}]
    for bs, packed in [(int(x), p) for x in args.batch_sizes.split(",") if x for p in (False, True)]:
        if packed and not packing_available(target.model):
            continue
        sec_raw, raw = timed(bs, prompts, 0, packed)
        sec, fixed = timed(bs, prompts, 1e-3, packed)
        tok = sum(len(a.ids) for a in fixed)
        rows.append({"batch_size": bs, "packed": packed, "prompts": len(prompts), "tokens": tok, "seconds": round(sec, 2),
                     "tokens_per_s": round(tok / sec, 1), "ratio_vs_batch1": round(tok / sec / rate1, 2),
                     "tokens_per_s_without_redecode": round(sum(len(a.ids) for a in raw) / sec_raw, 1),
                     "equal_to_batch1_raw": sum(a.ids == b.ids for a, b in zip(raw, alone)),
                     "equal_to_batch1_with_redecode": sum(a.ids == b.ids for a, b in zip(fixed, alone)),
                     "redecoded": sum(a.redecoded for a in fixed),
                     "smallest_top2_gap": float(f"{min(a.min_gap for a in raw):.3g}")})
    print(json.dumps({"model": target.name, "processor": processor_name(), "threads": torch.get_num_threads(), "max_new_tokens": args.new,
                      "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
                      "load_average_1min": round(os.getloadavg()[0], 2), "rows": rows}, indent=2))
    for r in rows:
        extra = (f"  equal to batch 1: {r['equal_to_batch1_raw']}/{r['prompts']} raw, "
                 f"{r['equal_to_batch1_with_redecode']}/{r['prompts']} after re-decode ({r['redecoded']} re-decoded)"
                 if r["batch_size"] > 1 else "")
        kind = " packed" if r.get("packed") else ""
        print(f"batch {r['batch_size']:>2}{kind:7}: {r['tokens_per_s']:>7.1f} tok/s  x{r['ratio_vs_batch1']:.2f}{extra}")


if __name__ == "__main__":
    main()
