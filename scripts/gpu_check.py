"""Check the CUDA path end to end in a few minutes: for each dtype, load the target on the device,
capture + analyze a small corpus, build a small feature store, train a drafter for a few steps,
and decode speculatively (a trained head and a head that always guesses right) against HF greedy
``generate`` on the same device. Prints one JSON line per step (seconds, what was checked) and a
summary; exits 1 if a step failed. Everything goes into a temporary cache (removed at the end;
the embedded model is dequantized into it once, ~25 s), nothing into yours.

    .venv/bin/python scripts/gpu_check.py                      # cuda, float32 and bfloat16
    .venv/bin/python scripts/gpu_check.py --device cpu --dtypes float32   # the same path on a CPU

In bfloat16 a GPU's batched kernels may round a near-tie differently from one-token decoding (and
the decoder makes no near-tie replay there, see ``wavesurf.drafter.decode.default_tie_eps``), so
"identical to HF greedy" is reported per prompt, with the token index where an output first leaves
HF's, rather than asserted; float32 on one device is expected to be identical.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--dataset", default="sharegpt",
                    help="corpus for analysis and training: a dataset name or a .jsonl path (load_corpus)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens captured for analysis and training")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    os.environ["WAVESURF_CACHE"] = tempfile.mkdtemp(prefix="wavesurf-gpu-check-")

    import torch

    # ShareGPT is split (stats / train); any other corpus is used whole
    whole = {} if args.dataset == "sharegpt" else {"split": None}

    from wavesurf.bench import bench_prompts, prompt_ids
    from wavesurf.drafter import FeatureSettings, TrainSettings, build_feature_store, load_head, train_drafter
    from wavesurf.drafter.decode import SpeculativeDecoder, TreeSpec, hf_generate
    from wavesurf.drafter.oracle import OracleHead
    from wavesurf.models import load_target
    from wavesurf.stats.analysis import analyze

    info = {"torch": torch.__version__, "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") and torch.cuda.is_available() else None}
    print(json.dumps(info), flush=True)
    failed: list[str] = []

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def step(name: str, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # report every step, then fail at the end
            failed.append(name)
            print(json.dumps({"step": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            traceback.print_exc(file=sys.stderr)
            return None
        sync()
        rec = {"step": name, "ok": True, "seconds": round(time.perf_counter() - t0, 2), **(out or {})}
        if args.device.startswith("cuda"):
            rec["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        print(json.dumps(rec), flush=True)
        return rec

    for dtype in args.dtypes:
        loaded: dict = {}

        def load():
            loaded["target"] = load_target(args.model, device=args.device, dtype=dtype)
            t = loaded["target"]
            return {"dtype": str(next(t.model.parameters()).dtype), "n_layers": t.n_layers}

        if step(f"{dtype}: load", load) is None:
            continue
        target = loaded["target"]
        ids = target.default_layer_ids()

        def stats():
            s = analyze(target, dataset=args.dataset, **whole, max_tokens=args.tokens, use_cache=False, progress=False)
            ent = [float(x) for x in s.entropy]
            return {"layers": len(ent), "entropy_finite": all(x == x for x in ent),
                    "cka_diag_is_1": bool(abs(float(s.cka[ids[0], ids[0]]) - 1) < 1e-6)}

        step(f"{dtype}: capture+analyze", stats)

        def train():
            store = build_feature_store(target, FeatureSettings(dataset=args.dataset, **whole, max_tokens=args.tokens, max_len=256,
                                                                 layer_ids=ids))
            res = train_drafter(target, store, ids, TrainSettings(train_tokens=args.tokens, ttt_steps=2,
                                                                  draft_vocab_size=2048, batch_tokens=1024))
            loaded["head"] = load_head(res.out_dir, target)[0]
            return {"train_tokens": res.train_tokens, "steps": res.steps, "accuracy_per_step": res.accuracy}

        step(f"{dtype}: feature store + training steps", train)

        def timed(fn):
            # wall time of one call, the device's queue drained on both sides
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            return out, time.perf_counter() - t0

        def decode():
            prompts = bench_prompts("mt-bench", args.prompts, target)
            same = {"trained": 0, "oracle": 0}
            taus: dict[str, list[float]] = {"trained": [], "oracle": []}
            seconds = {"hf": 0.0, "trained": 0.0, "oracle": 0.0}
            hf_tokens = 0
            rechecks = {"trained": 0, "oracle": 0}
            diverged: dict[str, list[int]] = {"trained": [], "oracle": []}
            nocache: list[int] = []
            hf_generate(target, prompt_ids(target, prompts[0], []), 8)  # warm-up: kernels, allocator
            for p in prompts:
                pid = prompt_ids(target, p, [])
                ref, dt = timed(lambda: hf_generate(target, pid, args.max_new_tokens))
                seconds["hf"] += dt
                hf_tokens += len(ref.tokens)
                if dtype != "float32":  # HF against itself: cached one-row steps vs full recomputes
                    ids_t = torch.tensor([pid], device=target.device)
                    out = target.model.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False,
                                                use_cache=False, max_new_tokens=len(ref.tokens),
                                                pad_token_id=target.tokenizer.eos_token_id)[0, len(pid):].tolist()
                    if out != ref.tokens:
                        nocache.append(first_difference(out, ref.tokens))
                heads = {"oracle": OracleHead(target, list(map(int, pid)) + ref.tokens)}
                if "head" in loaded:
                    heads["trained"] = loaded["head"]
                for name, head in heads.items():
                    decoder = SpeculativeDecoder(target, head, TreeSpec.chain(4))
                    r, dt = timed(lambda: decoder.generate(pid, args.max_new_tokens))
                    seconds[name] += dt
                    same[name] += r.tokens == ref.tokens
                    taus[name].append(r.tau)
                    rechecks[name] += r.tie_rechecks
                    if r.tokens != ref.tokens:  # where the output leaves HF greedy's (token index)
                        diverged[name].append(first_difference(r.tokens, ref.tokens))
            # speedup = HF greedy seconds / speculative seconds over the same prompts (one run each)
            return {f"identical_{k}": f"{v}/{len(prompts)}" for k, v in same.items()} | {
                f"tau_{k}": round(sum(v) / len(v), 2) for k, v in taus.items() if v} | {
                f"speedup_{k}": round(seconds["hf"] / seconds[k], 2) for k in taus if taus[k]} | {
                "hf_tokens_per_s": round(hf_tokens / seconds["hf"], 1)} | {
                f"tie_rechecks_{k}": v for k, v in rechecks.items()} | {
                f"first_divergence_{k}": v for k, v in diverged.items() if v} | (
                {"hf_nocache_identical": f"{len(prompts) - len(nocache)}/{len(prompts)}",
                 "first_divergence_hf_nocache": nocache} if dtype != "float32" else {})

        step(f"{dtype}: speculative decoding vs HF greedy", decode)
        loaded.clear()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(json.dumps({"failed_steps": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    import shutil

    try:
        code = main()
    finally:
        if os.environ.get("WAVESURF_CACHE", "").startswith(tempfile.gettempdir()):
            shutil.rmtree(os.environ["WAVESURF_CACHE"], ignore_errors=True)
    sys.exit(code)
