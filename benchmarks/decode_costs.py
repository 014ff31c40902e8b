"""Per-step costs of speculative decoding on this machine: one HF decode step of the target, one
target verify forward of K tokens (K = 1, 4, 8, 16, 32) over a cached context, one draft-head step,
and a whole draft+verify cycle of our decoder (chain K) with an untrained head.

From these, the best-case speedup of a drafter with acceptance length tau is roughly
``tau * t_step / (t_verify(K+1) + draft_cost)``; the printed table says which draft lengths and
tree sizes can reach 2x on this CPU.

    WAVESURF_THREADS=1 OMP_NUM_THREADS=1 python benchmarks/decode_costs.py --model smollm2-135m
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import torch
    from transformers import DynamicCache

    from wavesurf.drafter.adaptive import median_seconds as _time
    from wavesurf.drafter.decode import TreeSpec, TargetRunner
    from wavesurf.drafter.head import DraftConfig, DraftHead, init_head
    from wavesurf.models import configure_torch, load_target, processor_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=256, help="cached context tokens (default 256)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    configure_torch()
    target = load_target(args.model, device="cpu")
    model = target.model
    ctx = torch.randint(100, 5000, (args.context,))
    res: dict = {"model": target.name, "processor": processor_name(), "threads": torch.get_num_threads(), "context": args.context}

    with torch.inference_mode():
        def hf_step():
            cache = hf_step.cache
            extra = cache.get_seq_length() - args.context
            if extra > 0:
                cache.crop(-extra)
            model(input_ids=ctx[-1:][None], cache=cache, use_cache=True)

        hf_step.cache = DynamicCache(config=model.config)
        model(input_ids=ctx[None], cache=hf_step.cache, use_cache=True)
        res["hf_decode_step_ms"] = round(1e3 * _time(hf_step, args.repeats), 2)

        runner = TargetRunner(target, target.default_layer_ids())
        runner.forward(ctx, torch.arange(args.context), torch.ones(args.context, args.context, dtype=torch.bool).tril())
        for k in (1, 4, 8, 16, 32, 64):
            ids = torch.randint(100, 5000, (k,))
            pos = args.context + torch.arange(k)
            tree = torch.ones(k, k, dtype=torch.bool).tril()

            def verify():
                runner.forward(ids, pos, tree)
                runner.keep(args.context, torch.zeros(0, dtype=torch.long))

            res[f"verify_{k}_ms"] = round(1e3 * _time(verify, args.repeats), 2)
        runner.close()

        head = init_head(DraftHead(DraftConfig.for_target(target, target.default_layer_ids(), min(32000, target.vocab_size))))
        h = head.config.hidden_size
        kv = torch.zeros(1, head.config.num_key_value_heads, args.context, head.config.head_dim)
        for rows in (1, 4):
            hid, emb = torch.randn(1, rows, h), torch.randn(1, rows, h)
            pos = torch.full((1, rows), args.context)
            mask = torch.ones(1, 1, rows, args.context + rows, dtype=torch.bool)
            res[f"draft_step_{rows}rows_ms"] = round(1e3 * _time(lambda: head.step(hid, emb, pos, mask, kv, kv), args.repeats), 2)
        feats = torch.randn(1, 5, 3 * target.hidden_size)
        res["draft_fuse_5rows_ms"] = round(1e3 * _time(lambda: head.fuse(feats), args.repeats), 2)

    step = res["hf_decode_step_ms"]
    bound = {}
    for k in (4, 8, 16, 32):  # verify k tokens = root + (k-1) drafts
        cycle = res[f"verify_{k}_ms"]
        bound[f"tau_needed_for_2x_verify{k}_no_draft_cost"] = round(2 * cycle / step, 2)
    res["tau_needed"] = bound
    res["note"] = ("speedup ~= tau * hf_step / (verify(K) + draft_cost); tau_needed ignores the draft cost "
                   "(add ~ depth * draft_step)")
    _ = TreeSpec
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
