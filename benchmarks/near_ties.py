"""How far apart are HF's one-token decode logits and our multi-token verify logits, and how often
is the target's top-2 gap smaller than that (where a greedy decision can flip)?

For each prompt: HF greedy ``generate`` with ``output_logits``; then the same tokens teacher-forced
through our verify path (prefill, then per step a chain-masked forward of the root plus
``--verify-len - 1`` filler tokens, only the root row kept, as speculative decoding with rejected
drafts does). Prints the max/median |logit difference|, the top-2 gap distribution and the number
of argmax disagreements.

    WAVESURF_THREADS=1 OMP_NUM_THREADS=1 python benchmarks/near_ties.py --n-prompts 20
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import torch

    from wavesurf.bench import bench_prompts, prompt_ids
    from wavesurf.drafter.target_runner import TargetRunner
    from wavesurf.models import configure_torch, load_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--datasets", default="mt-bench,humaneval,sharegpt")
    ap.add_argument("--n-prompts", type=int, default=10, help="per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--verify-len", type=int, default=5)
    ap.add_argument("--decide", choices=["verify", "recheck", "single"], default="verify",
                    help="verify: root row of the verify forward; recheck: the root run alone the HF way over a "
                         "history computed by verify forwards (what tie_eps does); single: HF-way one-token "
                         "forwards only (our plain loop)")
    args = ap.parse_args()
    configure_torch()
    target = load_target(args.model, device="cpu")
    model = target.model
    diffs, gaps, flips, steps = [], [], 0, 0
    with torch.inference_mode():
        for ds in args.datasets.split(","):
            for p in bench_prompts(ds, args.n_prompts, target, max_prompt_tokens=384):
                ids = torch.tensor(prompt_ids(target, p, []))
                out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], do_sample=False,
                                     max_new_tokens=args.max_new_tokens, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=model.generation_config.pad_token_id)
                gen = out.sequences[0, len(ids):]
                hf = torch.stack([lg[0].float() for lg in out.logits])  # [steps, V]
                runner = TargetRunner(target, [])
                n = len(ids)
                lg, _ = runner.forward(ids, torch.arange(n), None, logits_rows=1)
                ours = [lg[-1]]
                for s in range(len(gen) - 1):
                    m = runner.length
                    root = gen[s : s + 1]
                    if args.decide != "verify":  # HF's decode-step computation (its own masks, one row)
                        lg1, _ = runner.forward(root, m + torch.arange(1), None)
                        if args.decide == "recheck":
                            runner.keep(m, torch.zeros(0, dtype=torch.long))  # history stays verify-computed
                    if args.decide != "single":
                        chunk = torch.cat([root, torch.full((args.verify_len - 1,), 17)])
                        lg, _ = runner.forward(chunk, m + torch.arange(args.verify_len),
                                               torch.ones(args.verify_len, args.verify_len, dtype=torch.bool).tril())
                        runner.keep(m, torch.tensor([0]))
                    if args.decide != "verify":
                        lg = lg1
                    ours.append(lg[0])
                runner.close()
                ours = torch.stack(ours)
                diffs += (ours - hf).abs().amax(-1).tolist()
                top2 = hf.topk(2, dim=-1).values
                gaps += (top2[:, 0] - top2[:, 1]).tolist()
                flips += int((ours.argmax(-1) != hf.argmax(-1)).sum())
                steps += len(gen)
    res = {
        "model": target.name, "steps": steps, "verify_len": args.verify_len, "decide": args.decide,
        "max_abs_logit_diff": max(diffs), "median_max_abs_logit_diff": statistics.median(diffs),
        "top2_gap_below": {str(e): sum(g < e for g in gaps) for e in (1e-5, 1e-4, 1e-3, 1e-2)},
        "argmax_disagreements": flips,
    }
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
