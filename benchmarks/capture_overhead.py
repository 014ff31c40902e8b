"""Capture throughput against a bare HF forward over the same batches, and peak memory of a
streamed capture at two token budgets. Prints ratios measured in this one run.

Targets (issue 2): capture/bare throughput >= 0.9; peak RSS at the large budget within 10% of
the small one.

    python benchmarks/capture_overhead.py [--model smollm2-135m] [--tokens 12000] [--budgets 20000 100000]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def throughput(model_name: str, tokens: int, batch_tokens: int, max_len: int) -> dict:
    import torch

    from wavesurf.capture import capture
    from wavesurf.data import encode_budget, load_corpus, make_batches
    from wavesurf.capture import pad_batch, _pad_id
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    target = load_target(model_name)
    corpus = load_corpus("sharegpt", split="stats")
    encoded = encode_budget(corpus, target.tokenizer, target.has_chat_template, tokens, max_len)
    batches = make_batches(encoded, batch_tokens)
    stream = capture(target, encoded, tokens, max_len=max_len, batch_tokens=batch_tokens, progress=False)
    t_bare = t_cap = 0.0
    # warm-up on the first batch (allocator, kernels), not timed
    ids, mask, _, _ = pad_batch(batches[0], _pad_id(target), target.device)
    with torch.no_grad():
        target.model(input_ids=ids, attention_mask=mask.long(), use_cache=False)
    for batch in batches:  # interleave so drift hits both sides equally
        ids, mask, _, _ = pad_batch(batch, _pad_id(target), target.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = target.model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
        t_bare += time.perf_counter() - t0
        del logits
        t0 = time.perf_counter()
        b = next(stream)
        t_cap += time.perf_counter() - t0
        assert len(b.hidden) == target.n_layers + 1
        del b
    return {"tokens": tokens, "batches": len(batches), "bare_tok_per_s": round(tokens / t_bare, 1),
            "capture_tok_per_s": round(tokens / t_cap, 1), "capture_over_bare": round(t_bare / t_cap, 3)}


def peak_memory_child(model_name: str, tokens: int, batch_tokens: int, max_len: int) -> None:
    """Stream a capture of all layers, touching every state, and print peak RSS (MiB)."""
    from wavesurf.capture import capture
    from wavesurf.data import load_corpus
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    target = load_target(model_name)
    corpus = load_corpus("sharegpt", split="stats")
    total = 0.0
    for b in capture(target, corpus, tokens, max_len=max_len, batch_tokens=batch_tokens, progress=False):
        m = b.stat_mask()
        total += sum(float(h[m].sum()) for h in b.hidden.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens": tokens, "peak_rss_mib": round(peak, 1), "checksum": total}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=12000, help="tokens for the throughput comparison")
    ap.add_argument("--budgets", type=int, nargs=2, default=[20000, 100000], help="two budgets for peak memory")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--skip-memory", action="store_true", help="only the throughput comparison")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        peak_memory_child(args.model, args.child, args.batch_tokens, args.max_len)
        return
    import platform

    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; model {args.model}")
    tp = throughput(args.model, args.tokens, args.batch_tokens, args.max_len)
    print(json.dumps({"throughput": tp}))
    print(f"capture/bare throughput ratio: {tp['capture_over_bare']:.3f}  (target >= 0.9)")
    if args.skip_memory:
        return
    peaks = []
    for budget in args.budgets:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", str(budget),
                              "--batch-tokens", str(args.batch_tokens), "--max-len", str(args.max_len)],
                             check=True, capture_output=True, text=True).stdout
        peaks.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps({"memory": peaks[-1]}))
    ratio = peaks[1]["peak_rss_mib"] / peaks[0]["peak_rss_mib"]
    print(f"peak RSS {args.budgets[1]:,} tok / {args.budgets[0]:,} tok: {ratio:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
