"""Whether bfloat16 pays on this CPU: what ``TrainSettings(precision="auto")`` decides, checked by
timing. Two measurements, float32 against bfloat16, in one process:

* one matrix product at a draft head's shapes (rows x 576 by 576 x 1536, as ``F.linear`` with the
  weight stored [out, in]), median of ``--repeats``;
* ``train_drafter`` at the default profile's head settings (128-token batches, 3 unrolled steps, a
  4,096-id draft vocabulary) for ``--steps`` optimizer steps after ``--warmup`` untimed ones, on a
  feature store of ShareGPT's training split built here (``--store-tokens``);
* the floating-point work of one training token (``torch.utils.flop_counter.FlopCounterMode`` over
  the same runs, forward and backward), so each speed reads as GFLOP/s beside the matrix product's:
  how far from what this CPU multiplies the training runs, and so how much a faster step could gain.

    python benchmarks/precision_speed.py [--steps 20] [--warmup 2] [--store-tokens 4096] [--repeats 9]

The result (tokens/s and GFLOP/s per precision, their ratio, the CPU's bfloat16 flags and what "auto" chose)
goes to ``benchmarks/results/precision_speed-<date>.json``. Threads: as the package sets them
(``WAVESURF_THREADS``, else every core). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


#: a draft head's matrix product: hidden size in, MLP width out (SmolLM2-135M)
HIDDEN, WIDTH = 576, 1536
#: the layers every head here reads (the default set)
LAYERS = [2, 15, 27]


def matmul_ms(rows: int, dtype, repeats: int) -> float:
    import torch

    x, w = torch.randn(rows, HIDDEN).to(dtype), torch.randn(WIDTH, HIDDEN).to(dtype)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per precision")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (one-time costs)")
    ap.add_argument("--store-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()

    import torch

    from _common import write_result
    from wavesurf.drafter.train import cpu_has_bfloat16, resolve_precision
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability "
          f"{torch.backends.cpu.get_cpu_capability()}, native bfloat16: {cpu_has_bfloat16()}")
    matmul = [{"rows": rows, **{f"{name}_ms": round(matmul_ms(rows, dt, args.repeats), 2)
                                for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}}
              for rows in (128, 1024)]
    for m in matmul:
        m["bfloat16_over_float32"] = round(m["bfloat16_ms"] / m["float32_ms"], 2)
        for name in ("float32", "bfloat16"):  # 2 flops per multiply-add
            m[f"{name}_gflops"] = round(2 * m["rows"] * HIDDEN * WIDTH / (m[f"{name}_ms"] * 1e-3) / 1e9, 1)
        print(f"matmul {m['rows']} x {HIDDEN} x {WIDTH}: float32 {m['float32_ms']} ms ({m['float32_gflops']} GFLOP/s), "
              f"bfloat16 {m['bfloat16_ms']} ms ({m['bfloat16_gflops']} GFLOP/s)")

    target = load_target("smollm2-135m", device="cpu")
    with tempfile.TemporaryDirectory(prefix="precision-speed-") as tmp:  # the store and heads go with it
        store_tokens, train, flops_per_token = _train_speeds(target, Path(tmp), args)
    ratio = round(train["bfloat16"]["tokens_per_s"] / train["float32"]["tokens_per_s"], 3)
    for precision, v in train.items():  # the training's own rate beside the fastest head-shaped product's
        best = max(m[f"{precision}_gflops"] for m in matmul)
        v["gflops"] = round(v["tokens_per_s"] * flops_per_token / 1e9, 1)
        v["of_best_matmul_rate"] = round(v["gflops"] / best, 3)
        print(f"train {precision}: {v['gflops']} GFLOP/s, {v['of_best_matmul_rate']:.0%} of the fastest "
              f"product's {best} GFLOP/s")
    out = write_result("precision_speed", {
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bfloat16": cpu_has_bfloat16(), "auto_chooses": resolve_precision("auto", "cpu"),
        "settings": {**COMMON, "steps": args.steps, "warmup": args.warmup, "store_tokens": store_tokens},
        "train_mflop_per_token": round(flops_per_token / 1e6, 2),
        "matmul": matmul, "train": [{"precision": p, **v} for p, v in train.items()],
        "train_bfloat16_over_float32": ratio})
    print(f"bfloat16 / float32 training speed: {ratio}x; auto chooses {resolve_precision('auto', 'cpu')}; {out}")


#: the default profile's head settings (no checkpoint inside the timed steps)
COMMON = {"ttt_steps": 3, "draft_vocab_size": 4096, "batch_tokens": 128, "lr": 1e-3, "warmup_steps": 10,
          "checkpoint_every": 10_000}


def _train_speeds(target, work: Path, args: argparse.Namespace) -> tuple[int, dict, float]:
    """The tokens of a store of ShareGPT's training split built under ``work``; per precision the
    tokens/s of ``args.steps`` training steps on it (a run of warmup + steps minus a run of warmup
    alone); and the floating-point operations of one training token, counted the same way (float32)."""
    from torch.utils.flop_counter import FlopCounterMode

    from wavesurf.drafter.features import FeatureSettings, build_feature_store
    from wavesurf.drafter.train import TrainSettings, train_drafter

    store = build_feature_store(target, FeatureSettings(dataset="sharegpt", split="train", max_tokens=args.store_tokens,
                                                        max_len=512, batch_tokens=4096, layer_ids=LAYERS),
                                path=work / "store", progress=False)
    train = {}
    for precision in ("float32", "bfloat16"):
        runs = {}
        for steps in (args.warmup, args.warmup + args.steps):  # the difference times the steps alone
            t0 = time.perf_counter()
            res = train_drafter(target, store, LAYERS, TrainSettings(**COMMON, max_steps=steps, precision=precision),
                                work / f"{precision}-{steps}", progress=False)
            runs[steps] = (time.perf_counter() - t0, res.train_tokens)
        (s0, n0), (s1, n1) = runs[args.warmup], runs[args.warmup + args.steps]
        train[precision] = {"tokens": n1 - n0, "seconds": round(s1 - s0, 2), "tokens_per_s": round((n1 - n0) / (s1 - s0), 1)}
        print(f"train {precision}: {train[precision]['tokens_per_s']} tok/s over {args.steps} steps")
    counted = {}
    for steps in (1, 3):  # the difference leaves out what a run does once (the vocabulary map, saving)
        with FlopCounterMode(display=False) as counter:
            res = train_drafter(target, store, LAYERS, TrainSettings(**COMMON, max_steps=steps),
                                work / f"flops-{steps}", progress=False)
        counted[steps] = (counter.get_total_flops(), res.train_tokens)
    flops_per_token = (counted[3][0] - counted[1][0]) / (counted[3][1] - counted[1][1])
    print(f"train: {flops_per_token / 1e6:.1f} MFLOP per token (forward and backward)")
    return store.tokens, train, flops_per_token


if __name__ == "__main__":
    main()
