"""Cost of the streaming statistics against the capture forward, per batch, in one run; memory
of the accumulators at two token budgets; time to score every 3-subset of a 31-layer model.

Targets (issue 3): statistics update <= 0.25x of the capture forward per batch for SmolLM2-135M
with all pairs; memory flat in the number of tokens; all 3-subsets of 31 layers scored in < 1 s.

    python benchmarks/stats_cost.py [--batches 2] [--batch-tokens 4096]
"""
from __future__ import annotations

import itertools
import json
import os
import resource
import time

from _common import capture_stream, stats_cost_parser, timed_batches


def main() -> None:
    args = stats_cost_parser(__doc__).parse_args()

    import numpy as np
    import torch

    from wavesurf.stats import LayerMoments, MinibatchCKA, TokenShuffler, aggregate_entropy2_closed_form, gather_layer_rows

    target, ids, _, stream = capture_stream(args)
    L, d = len(ids), target.hidden_size
    budget = (args.batches + 1) * args.batch_tokens

    accs = {
        "exact all pairs (float64 moments of the L*d concatenation)": LayerMoments(ids, d, pairs=True),
        "per-layer only (entropy; no cross-layer pairs)": LayerMoments(ids, d, pairs=False),
    }
    mb = MinibatchCKA(ids, gram_dtype=torch.float32)  # as analyze() uses it
    shuffler = TokenShuffler(4 * args.minibatch_size, args.minibatch_size, seed=0)
    times = {k: 0.0 for k in accs} | {"minibatch CKA, all pairs (+ per-layer moments)": 0.0}
    t_fwd, tokens = 0.0, 0
    for k, batch, dt_fwd in timed_batches(stream, args.batches):
        mask = batch.stat_mask()
        dts = {}
        for name, acc in accs.items():
            t0 = time.perf_counter()
            acc.update(batch.hidden, mask)
            dts[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows = gather_layer_rows(batch.hidden, ids, mask)
        for minibatch in shuffler.add({i: r for i, r in zip(ids, rows)}):
            mb.update(minibatch)
        dts["minibatch CKA, all pairs (+ per-layer moments)"] = (
            time.perf_counter() - t0 + dts["per-layer only (entropy; no cross-layer pairs)"])
        if k == 0:
            continue  # warm-up
        if k == 1:  # every buffer exists now; later batches must not add memory
            rss_warm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t_fwd += dt_fwd
        tokens += int(mask.sum())
        for name, dt in dts.items():
            times[name] += dt
    print(f"# {args.model}: L={L} layer ids x d={d}; {args.batches} timed batches of {args.batch_tokens} tokens "
          f"({tokens} statistics positions); {os.cpu_count()} cores; torch threads {torch.get_num_threads()}")
    print(f"capture forward: {t_fwd / args.batches:.2f} s per batch")
    for name, t in times.items():
        print(f"{name}: {t / args.batches:.2f} s per batch -> {t / t_fwd:.3f}x the forward (target <= 0.25)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS after the first timed batch {rss_warm:.0f} MiB, after {budget} tokens {rss:.0f} MiB: ratio "
          f"{rss / rss_warm:.3f} (accumulators are fixed-size; all pairs hold "
          f"{accs[next(iter(accs))]._outer.numel() * 8 / 2**30:.2f} GiB)")

    rng = np.random.default_rng(0)
    P = rng.uniform(0.01, 0.2, 31)
    K = rng.uniform(0, 1, (31, 31))
    K = (K + K.T) / 2
    np.fill_diagonal(K, 1)
    t0 = time.perf_counter()
    subsets = np.array(list(itertools.combinations(range(31), 3)))
    s2 = aggregate_entropy2_closed_form(P, K, subsets)
    dt = time.perf_counter() - t0
    print(f"scoring all {len(subsets)} 3-subsets of 31 layers (alpha=2 closed form): {dt * 1000:.1f} ms (target < 1 s)")
    print(json.dumps({"forward_s": t_fwd / args.batches, **{k: v / t_fwd for k, v in times.items()},
                      "score_3subsets_s": dt, "best": float(s2.max())}))


if __name__ == "__main__":
    main()
