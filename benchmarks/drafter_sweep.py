"""Which drafter training options earn their keep? Trains the default layer set once per option
setting at one token budget and scores every head by exact offline chain acceptance on the same
held-out target answers, with paired bootstrap intervals against the first (baseline) setting.

    python benchmarks/drafter_sweep.py --model smollm2-135m --train-tokens 40000 \
        --dataset sharegpt@smollm2-135m --heldout sharegpt@smollm2-135m

The corpora default to the target's own answers (``wavesurf distill`` first). Prints one row per
setting: tau at draft lengths 1..6, step-0 accuracy, paired difference at ``--draft-len`` with its
interval, training seconds and tokens/s, and the thread count / load average (training speed is only
comparable on a quiet machine; tau is not affected by load).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: draft lengths every head, the lookup rows and the bigram floor are scored up to (as the profiles)
MAX_DRAFT_LEN = 6
#: name -> TrainSettings overrides on top of the baseline; each is one question
#: ("train_tokens_scale" multiplies the baseline's token budget)
SETTINGS = {
    "baseline": {},
    "lr3e-4": {"lr": 3e-4},
    "lr3e-3": {"lr": 3e-3},
    "batch2048": {"batch_tokens": 2048},
    "batch512": {"batch_tokens": 512},
    "batch256": {"batch_tokens": 256},
    "batch512_lr3e-3": {"batch_tokens": 512, "lr": 3e-3},
    "batch256_lr3e-3": {"batch_tokens": 256, "lr": 3e-3},
    "constant": {"schedule": "constant"},
    "init_lm_head": {"init_lm_head": "target"},
    "input_norm": {"input_norm": "rms"},
    "vocab2048": {"draft_vocab_size": 2048},
    "vocab8192": {"draft_vocab_size": 8192},
    "ttt3": {"ttt_steps": 3},
    "ttt6": {"ttt_steps": 6},
    "warmup30": {"warmup_steps": 30},
    "tokens150k": {"train_tokens": 150_000},
    # the head's matrix products in bfloat16 (torch.autocast): equal tokens, and equal training time
    "bf16": {"precision": "bfloat16"},
    "bf16_tokens1.5x": {"precision": "bfloat16", "train_tokens_scale": 1.5},
    "bf16_tokens4x": {"precision": "bfloat16", "train_tokens_scale": 4.0},
    "tokens400k": {"train_tokens": 400_000},
    # wavesurf.drafter.induction: start as a copy head; train everything, or keep fc and attention
    "induction": {"init_attention": "induction", "init_lm_head": "target"},
    "induction_frozen": {"init_attention": "induction", "init_lm_head": "target", "frozen": ["fc", "attention"]},
    "induction_frozen_lr3e-4": {"init_attention": "induction", "init_lm_head": "target",
                                "frozen": ["fc", "attention"], "lr": 3e-4},
    # does the head use its layers? the same head reading no stream (the speed table's control)
    "embedding_only": {"embedding_only": True},
    # per-stream RMS before fc (EAGLE 3.1's fc_norm) with more optimizer steps or a higher rate
    "input_norm_batch256": {"input_norm": "rms", "batch_tokens": 256},
    "input_norm_lr3e-3": {"input_norm": "rms", "lr": 3e-3},
    "input_norm_bf16": {"input_norm": "rms", "precision": "bfloat16"},
    "input_norm_bf16_tokens1.5x": {"input_norm": "rms", "precision": "bfloat16", "train_tokens_scale": 1.5},
    "batch256_bf16": {"batch_tokens": 256, "precision": "bfloat16"},
    # more optimizer steps: does the gain come from the layers? (the control at the same steps)
    "embedding_only_batch256": {"embedding_only": True, "batch_tokens": 256},
    "batch128_bf16": {"batch_tokens": 128, "precision": "bfloat16"},
    "batch256_bf16_tokens1.5x": {"batch_tokens": 256, "precision": "bfloat16", "train_tokens_scale": 1.5},
    "batch256_lr5e-4": {"batch_tokens": 256, "lr": 5e-4},
    "batch256_bf16_tokens3x": {"batch_tokens": 256, "precision": "bfloat16", "train_tokens_scale": 3.0},
    "embedding_only_batch256_bf16_tokens3x": {"embedding_only": True, "batch_tokens": 256, "precision": "bfloat16",
                                              "train_tokens_scale": 3.0},
    # issue 30, against "bf16" (and the 1.5x row against "bf16_tokens1.5x"): inverse_rms costs no time per
    # step, so equal tokens is equal wall-clock; fc in float32 does cost time, its train_s against bf16's says
    # how much (equal wall-clock is then a train_tokens_scale of their ratio)
    "init_fc_inverse_rms_bf16": {"init_fc": "inverse_rms", "precision": "bfloat16"},
    "init_fc_inverse_rms_bf16_tokens1.5x": {"init_fc": "inverse_rms", "precision": "bfloat16", "train_tokens_scale": 1.5},
    "fc_fp32_bf16": {"fc_precision": "float32", "precision": "bfloat16"},
    "init_fc_inverse_rms_fc_fp32_bf16": {"init_fc": "inverse_rms", "fc_precision": "float32", "precision": "bfloat16"},
    # issue 30's floor target: tau against tokens (and so wall-clock) of one recipe, pass --base with it
    # (e.g. the long profile's train settings); each row's margin over the bigram floor and its control's
    "tokens2x": {"train_tokens_scale": 2.0},
    "tokens4x": {"train_tokens_scale": 4.0},
    "tokens8x": {"train_tokens_scale": 8.0},
    "embedding_only_tokens4x": {"embedding_only": True, "train_tokens_scale": 4.0},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dataset", default=None, help="training corpus (default: sharegpt@<model>)")
    ap.add_argument("--split", default="train")
    ap.add_argument("--heldout", default=None, help="held-out corpus (default: sharegpt@<model>)")
    ap.add_argument("--heldout-split", default="heldout")
    ap.add_argument("--train-tokens", type=int, default=40_000)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--base", default="{}", help="JSON TrainSettings shared by every setting")
    ap.add_argument("--only", default=",".join(SETTINGS), help="comma-separated settings to run")
    ap.add_argument("--layers", default=None, help="vLLM ids (default: the EAGLE-3 rule)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--lookup-ngram", type=int, default=0,
                    help="also score each head after n-gram lookup drafting (tau_lookup; 3 as the profiles; default 0: no)")
    args = ap.parse_args()

    import torch

    from _common import write_result

    from wavesurf.drafter.acceptance import bigram_acceptance, bootstrap_tau, build_bigram_table, offline_acceptance
    from wavesurf.drafter.diagnostics import floor_miss_accuracy, stream_contributions
    from wavesurf.drafter.features import FeatureSettings, build_feature_store
    from wavesurf.drafter.head import load_head
    from wavesurf.drafter.train import TrainSettings, train_drafter
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    target = load_target(args.model)
    ids = [int(i) for i in args.layers.split(",")] if args.layers else target.default_layer_ids()
    dataset = args.dataset or f"sharegpt@{target.name}"
    heldout = args.heldout or f"sharegpt@{target.name}"
    split = None if args.split == "none" else args.split
    hsplit = None if args.heldout_split == "none" else args.heldout_split
    feats = {"max_tokens": None, "max_len": args.max_len, "batch_tokens": 4096, "layer_ids": ids}
    store = build_feature_store(target, FeatureSettings(dataset=dataset, split=split, **feats))
    held = build_feature_store(target, FeatureSettings(dataset=heldout, split=hsplit, **feats))
    base = {"train_tokens": args.train_tokens, "ttt_steps": 4, "draft_vocab_size": 4096, "batch_tokens": 1024,
            "warmup_steps": 10, "lr": 1e-3, "checkpoint_every": 10_000, "seed": args.seed, **json.loads(args.base)}
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}; train store {store.tokens:,} "
          f"tokens, held-out store {held.tokens:,} tokens; layers {ids}; base {base}", flush=True)
    table = build_bigram_table(target, dataset, split=split)
    rows, ref = [], None
    for name in args.only.split(","):
        t0 = time.perf_counter()
        overrides = dict(SETTINGS[name])
        scale = overrides.pop("train_tokens_scale", 1.0)  # a budget relative to --train-tokens
        settings = {**base, **overrides}
        settings["train_tokens"] = round(settings["train_tokens"] * scale)
        res = train_drafter(target, store, ids, TrainSettings(**settings), progress=False)
        head, info = load_head(res.out_dir, target)
        acc = offline_acceptance(target, head, held, max_draft_len=MAX_DRAFT_LEN, name=name, progress=False)
        ref = ref or acc
        ci = bootstrap_tau([acc], args.draft_len, baseline=[ref])
        row = {"setting": name, **{f"tau_{d}": round(acc.tau(d), 4) for d in acc.draft_lens},
               "step0_acc": round(acc.step_accuracy[0], 4), "diff": round(ci["diff"], 4),
               "diff_lo": round(ci["diff_lo"], 4), "diff_hi": round(ci["diff_hi"], 4),
               "train_tokens": res.train_tokens, "train_s": round(res.seconds, 1),
               "tok_per_s": round(res.tokens_per_second, 1),
               "heldout_coverage": info.get("vocab", {}).get("heldout_coverage"),
               "load": round(os.getloadavg()[0], 2), "wall_s": round(time.perf_counter() - t0, 1)}
        rescue = floor_miss_accuracy(target, head, table, held).interval()
        row.update(rescue=round(rescue["rescue_rate"], 4), rescue_lo=round(rescue["rescue_lo"], 4),
                   rescue_hi=round(rescue["rescue_hi"], 4))
        if not head.config.embedding_only:
            row["stream_shares"] = [round(c["share"], 3) for c in stream_contributions(head, store)]
        if args.lookup_ngram:
            after = offline_acceptance(target, head, held, max_draft_len=MAX_DRAFT_LEN, lookup_ngram=args.lookup_ngram,
                                       name=f"{name}+lookup", progress=False)
            row[f"tau_lookup_{args.draft_len}"] = round(after.tau(args.draft_len), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    floor = bigram_acceptance(target, table, held, max_draft_len=MAX_DRAFT_LEN, progress=False)
    ci = bootstrap_tau([floor], args.draft_len, baseline=[ref])
    floor_row = {"setting": "bigram floor", **{f"tau_{d}": round(floor.tau(d), 4) for d in floor.draft_lens},
                 "step0_acc": round(floor.step_accuracy[0], 4), "diff": round(ci["diff"], 4),
                 "diff_lo": round(ci["diff_lo"], 4), "diff_hi": round(ci["diff_hi"], 4)}
    print(json.dumps(floor_row))
    print(f"held-out: {len(ref.sequence_ids)} sequences, {ref.positions:,} continuation tokens "
          f"({ref.cut_tokens} cut where the stored token was not the target's greedy choice)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    where = write_result("drafter_sweep", {
        "model": target.name, "layer_ids": ids, "base": base, "draft_len": args.draft_len, "dataset": dataset,
        "heldout": heldout, "heldout_sequences": len(ref.sequence_ids), "heldout_positions": ref.positions,
        "train_store_tokens": store.tokens, "rows": rows, "floor": floor_row,
        "note": "tau is not affected by machine load; train_s and tok_per_s are only comparable on a quiet machine"})
    print(f"written {where}")


if __name__ == "__main__":
    main()
