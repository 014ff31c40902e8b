"""Cost of the grouped-jackknife intervals against the capture forward, measured in one run.

Per batch: the per-group per-layer moments (entropy, purity, trace replicates), and the minibatch
CKA with leave-one-group-out sums against the same estimator without groups; once per run: the
G x L eigendecompositions of the replicates. Memory of the grouped accumulators is printed too.

Targets (issue 12): interval computation <= 0.25x the capture forward for the per-layer
quantities and the minibatch CKA; the exact-CKA path states its cost (it runs the grouped
minibatch CKA next to the exact moments, so its extra cost is the same minibatch column).

    python benchmarks/interval_cost.py [--batches 3] [--groups 10]
"""
from __future__ import annotations

import os
import time

from _common import capture_stream, stats_cost_parser, timed_batches


def main() -> None:
    ap = stats_cost_parser(__doc__)
    ap.add_argument("--groups", type=int, default=10)
    args = ap.parse_args()

    import numpy as np
    import torch

    from wavesurf.stats import LayerMoments, MinibatchCKA, TokenShuffler, gather_layer_rows
    from wavesurf.stats.resampling import GroupAssigner, GroupedLayerMoments

    target, ids, corpus, stream = capture_stream(args)
    L, d, G = len(ids), target.hidden_size, args.groups
    assigner = GroupAssigner(G, [e.id for e in corpus.examples])
    grouped = GroupedLayerMoments(ids, d, G)  # replaces the per-layer moments on the minibatch path
    single = LayerMoments(ids, d, pairs=False)  # what the minibatch path kept before
    cols = {"per-layer moments, no groups": 0.0, "per-layer moments per group": 0.0,
            "minibatch CKA without groups": 0.0,
            "minibatch CKA with leave-one-group-out sums": 0.0}
    plain, withg = MinibatchCKA(ids, gram_dtype=torch.float32), MinibatchCKA(ids, gram_dtype=torch.float32, n_groups=G)
    sh1 = TokenShuffler(8 * args.minibatch_size, args.minibatch_size, seed=0)
    sh2 = TokenShuffler(8 * args.minibatch_size, args.minibatch_size, seed=0)
    t_fwd = 0.0
    tokens = 0
    for k, batch, dt_fwd in timed_batches(stream, args.batches):
        mask = batch.stat_mask()
        groups = assigner.row_groups(batch.example_ids, tuple(mask.shape))
        dts = {}
        for name, acc in (("per-layer moments, no groups", single), ("per-layer moments per group", grouped)):
            t0 = time.perf_counter()
            acc.update(batch.hidden, mask) if acc is single else acc.update(batch.hidden, groups, mask)
            dts[name] = time.perf_counter() - t0
        rows = gather_layer_rows(batch.hidden, ids, mask)
        t0 = time.perf_counter()
        for mbatch in sh1.add({i: r for i, r in zip(ids, rows)}):
            plain.update(mbatch)
        dts["minibatch CKA without groups"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for mbatch in sh2.add({**{i: r for i, r in zip(ids, rows)}, "groups": groups[mask]}):
            withg.update(mbatch, groups=mbatch["groups"])
        dts["minibatch CKA with leave-one-group-out sums"] = time.perf_counter() - t0
        if k == 0:
            continue  # warm-up
        t_fwd += dt_fwd
        tokens += int(mask.sum())
        for name, v in dts.items():
            cols[name] += v
    t0 = time.perf_counter()
    for g in range(G):
        for lid in ids:
            torch.linalg.eigvalsh(grouped.covariance(lid, drop_group=g))
    t_eig = time.perf_counter() - t0
    print(f"model {args.model}: L={L} layers x d={d}, G={G} groups; {args.batches} timed batches of "
          f"{args.batch_tokens} tokens ({tokens:,} statistics positions); forward {t_fwd / args.batches:.2f} s/batch")
    for name, v in cols.items():
        print(f"  {name:46s} {v / args.batches:6.2f} s/batch = {v / t_fwd:.3f}x forward")
    extra_mb = cols["minibatch CKA with leave-one-group-out sums"] - cols["minibatch CKA without groups"]
    print(f"  {'leave-one-group-out sums alone (difference)':46s} {extra_mb / args.batches:6.2f} s/batch = "
          f"{extra_mb / t_fwd:.3f}x forward")
    exact_extra = cols["per-layer moments per group"] + cols["minibatch CKA with leave-one-group-out sums"]
    mb_extra = (cols["per-layer moments per group"] - cols["per-layer moments, no groups"]) + extra_mb
    print(f"extra per batch, minibatch path (grouped float64 moments replace the per-layer ones, plus the "
          f"leave-one-group-out sums): {mb_extra / t_fwd:.3f}x forward (target <= 0.25x)")
    print(f"extra per batch, exact-CKA path (grouped moments + the whole grouped minibatch CKA): "
          f"{exact_extra / t_fwd:.3f}x forward")
    fwd_per_token = t_fwd / tokens
    print(f"once per subset: {G * L} eigendecompositions of the replicates {t_eig:.1f} s "
          f"(= {t_eig / (fwd_per_token * 20_000):.3f}x the forward of a 20k-token run)")
    mem = grouped._outer.numel() * 8 + grouped._sum.numel() * 8
    buf = 8 * args.minibatch_size * L * d * 4
    print(f"memory: grouped moments {mem / 2**30:.2f} GiB; shuffle buffer {buf / 2**30:.2f} GiB "
          f"(also used by the minibatch estimator); load average {os.getloadavg()[0]:.2f} at end")
    assert np.isfinite(withg.replicates()).all()


if __name__ == "__main__":
    main()
