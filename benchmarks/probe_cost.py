"""Cost of the predictive probe (issue 32's targets), in one run on one machine:

- the probe's moments update per captured batch against the capture forward of that batch
  (target: <= 0.25x), after the pilot batches that fix the principal components;
- scoring every k-subset of the model's layer ids from the moments (target: <= 10 min for every
  3-subset of SmolLM2-135M, 4,495 sets).

The moments here come from ``--batches`` timed batches only (plus the warm-up and pilot), which is
enough to time them; the book's probe uses the profile's token budget.

    python benchmarks/probe_cost.py [--model smollm2-135m] [--batches 3] [--batch-tokens 4096] [--k 3]
"""
from __future__ import annotations

import itertools
import time

from _common import capture_stream, stats_cost_parser, timed_batches, write_result


def main() -> None:
    ap = stats_cost_parser(__doc__)
    ap.add_argument("--k", type=int, default=3, help="layer-set size scored (default 3)")
    ap.add_argument("--ridge", type=float, default=None, help="ridge penalty (default: the library's)")
    args = ap.parse_args()

    import numpy as np
    import torch

    from wavesurf.stats.probe import DEFAULT_RIDGE, ProbeAccumulator, ProbeSettings, score_layer_sets

    settings = ProbeSettings(max_tokens=(args.batches + 1) * args.batch_tokens, batch_tokens=args.batch_tokens,
                             pilot_tokens=min(ProbeSettings().pilot_tokens, args.batch_tokens // 2))
    # the stream has one warm-up batch and ``batches`` timed ones; the pilot is the warm-up batch
    target, ids, _, stream = capture_stream(args)
    acc = ProbeAccumulator(target.n_layers, target.hidden_size, settings)
    t_fwd = t_probe = 0.0
    positions = 0
    for k, batch, dt_fwd in timed_batches(stream, args.batches):
        t0 = time.perf_counter()
        acc.update(batch)
        dt_probe = time.perf_counter() - t0
        if k == 0:
            acc.finish_pilot()  # the principal components come from the warm-up batch; not timed
            continue
        t_fwd += dt_fwd
        t_probe += dt_probe
        positions += int(batch.stat_mask().sum())
    moments = acc.result()
    ratio = t_probe / t_fwd
    print(f"# {target.name}: {len(ids)} layer ids x d={target.hidden_size}; {args.batches} timed batches of "
          f"{args.batch_tokens} tokens ({positions} positions); torch threads {torch.get_num_threads()}")
    print(f"capture forward {t_fwd / args.batches:.2f} s per batch; probe moments {t_probe / args.batches:.3f} s "
          f"per batch -> {ratio:.3f}x the forward (target <= 0.25)")

    ridge = DEFAULT_RIDGE if args.ridge is None else args.ridge
    sets = np.array(list(itertools.combinations(range(target.n_layers + 1), args.k)), dtype=np.int64)
    t0 = time.perf_counter()
    scores = score_layer_sets(moments, sets, ridge)
    dt_score = time.perf_counter() - t0
    print(f"scoring all {len(sets):,} {args.k}-subsets of ids 0..{target.n_layers}: {dt_score:.1f} s "
          f"(target <= 600 s for every 3-subset); best r2 {float(np.max(scores['r2'])):.3f}")
    out = write_result("probe_cost", {
        "model": target.name, "layer_ids": len(ids), "hidden_size": target.hidden_size,
        "batches": args.batches, "batch_tokens": args.batch_tokens, "positions": positions,
        "dims": settings.dims, "embedding_dims": settings.embedding_dims,
        "forward_s_per_batch": round(t_fwd / args.batches, 4), "probe_s_per_batch": round(t_probe / args.batches, 4),
        "probe_over_forward": round(ratio, 4), "target_probe_over_forward": 0.25,
        "k": args.k, "sets_scored": int(len(sets)), "score_s": round(dt_score, 2), "target_score_s": 600,
        "ridge": ridge})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
