"""Is offline acceptance exact? For trained heads, the chain acceptance length tau that
:func:`wavesurf.drafter.acceptance.offline_acceptance` computes from one teacher-forced unroll is
compared with the tau that real greedy chain decoding (:class:`SpeculativeDecoder`) reaches on the
same held-out continuations (the target's own greedy answers), per draft length.

    python benchmarks/offline_exactness.py --heads DIR1,DIR2,DIR3 [--sequences 12]
    python benchmarks/offline_exactness.py --train 3          # trains 3 small heads first

Decoding every held-out continuation is slow on a CPU, so the comparison uses the first
``--sequences`` held-out sequences (all their continuations, whole); offline tau is summed over
exactly those sequences. Prints one row per head and draft length: offline tau, decoded tau, their
relative difference, and whether every decoded continuation equalled the stored greedy tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--heads", default=None, help="comma-separated drafter directories (train/save_head output)")
    ap.add_argument("--train", type=int, default=0, help="train this many small heads (default set, last-1, random)")
    ap.add_argument("--train-tokens", type=int, default=24_000)
    ap.add_argument("--dataset", default=None, help="training corpus (default sharegpt@<model>, split train)")
    ap.add_argument("--heldout", default=None, help="held-out corpus (default sharegpt@<model>, split heldout)")
    ap.add_argument("--sequences", type=int, default=12)
    ap.add_argument("--draft-lens", default="1,2,4")
    args = ap.parse_args()

    import numpy as np
    import torch

    from wavesurf.drafter.acceptance import continuations, offline_acceptance
    from wavesurf.drafter.decode import SpeculativeDecoder, TreeSpec
    from wavesurf.drafter.features import FeatureSettings, build_feature_store
    from wavesurf.drafter.head import load_head
    from wavesurf.drafter.train import TrainSettings, train_drafter
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    target = load_target(args.model)
    n = target.n_layers
    lens = [int(d) for d in args.draft_lens.split(",")]
    heads = [d for d in (args.heads or "").split(",") if d]
    sets = [target.default_layer_ids(), [n], sorted({3, n // 3, 2 * n // 3})][: args.train]
    union = sorted({i for s in sets for i in s} | set(target.default_layer_ids()))
    held = build_feature_store(target, FeatureSettings(dataset=args.heldout or f"sharegpt@{target.name}",
                                                       split="heldout", max_tokens=None, max_len=512,
                                                       layer_ids=union if sets else None), progress=False)
    if sets:
        store = build_feature_store(target, FeatureSettings(dataset=args.dataset or f"sharegpt@{target.name}",
                                                            split="train", max_tokens=None, max_len=512,
                                                            layer_ids=union), progress=False)
        for ids in sets:
            res = train_drafter(target, store, ids, TrainSettings(
                train_tokens=args.train_tokens, ttt_steps=4, draft_vocab_size=4096, batch_tokens=1024, lr=1e-3,
                warmup_steps=10, checkpoint_every=10_000), progress=False)
            heads.append(res.out_dir)
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}; held-out store {held.tokens:,} tokens; "
          f"{len(heads)} heads; first {args.sequences} held-out sequences", flush=True)

    # the continuations of the first sequences, from the stored batches (same cut rule as offline)
    seq_index = {(s.shard, s.start): i for i, s in enumerate(held.sequences)}
    batches = held.batches([n], 4096)
    chosen: dict[int, list[list[int]]] = {}  # sequence -> [prefix + continuation token ids]
    starts: dict[int, list[tuple[int, int]]] = {}
    for bi in range(len(batches)):
        b = batches[bi]
        for r, s in enumerate(batches.plan[batches.order[bi]]):
            i = seq_index[(s.shard, s.start)]
            if i >= args.sequences:
                continue
            ids = b["input_ids"][r, : s.length]
            conts, _ = continuations(b["loss_mask"][r, : s.length].numpy(), ids.numpy(),
                                     b["target_argmax"][r, : s.length].numpy(), i)
            chosen[i] = [ids.tolist()]
            starts[i] = [(c.start, c.length) for c in conts]
    rows = []
    for out_dir in heads:
        head, _ = load_head(out_dir, target)
        acc = offline_acceptance(target, head, held, max_draft_len=max(lens), progress=False)
        for d in lens:
            decoder = SpeculativeDecoder(target, head, TreeSpec.chain(d))
            committed = cycles = 0
            same = True
            t0 = time.perf_counter()
            for i, (ids,) in chosen.items():
                for start, length in starts[i]:
                    run = decoder.generate(torch.tensor(ids[:start]), max_new_tokens=length)
                    same &= run.tokens == ids[start : start + length]
                    committed += sum(run.cycle_tokens)
                    cycles += len(run.cycle_tokens)
            seqs = sorted(chosen)
            off = float(np.sum(acc.committed[seqs, d - 1]) / np.sum(acc.cycles[seqs, d - 1]))
            real = committed / cycles
            rows.append({"head": os.path.basename(str(out_dir)), "layer_ids": head.config.layer_ids, "draft_len": d,
                         "offline_tau": round(off, 4), "decoded_tau": round(real, 4),
                         "rel_diff": round(abs(off - real) / real, 5), "tokens": committed,
                         "greedy_tokens_equal": bool(same), "decode_s": round(time.perf_counter() - t0, 1),
                         "offline_tau_all_heldout": round(acc.tau(d), 4)})
            print(json.dumps(rows[-1]), flush=True)
    worst = max(r["rel_diff"] for r in rows)
    print(f"largest relative difference offline vs decoded tau: {worst:.5f} over {len(rows)} head x draft-length pairs")


if __name__ == "__main__":
    main()
