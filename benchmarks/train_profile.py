"""Where the time of one drafter training step goes, and how much faster it could get on this CPU.

Issue 30 asks for head training at >= 1.5x the tokens/s of 111d6ab at equal settings; fused AdamW,
then fewer operations per unrolled step (shared norm and rotary tables, grouped-query attention
without repeated keys, one readout for all steps) got 1.22x at 2 threads and 1.27x at 1
(``train_throughput.py``). This script says what bounds the rest. It trains a head on a
small feature store (the same ``train_drafter`` call as ``train_throughput.py``), first unprofiled
(milliseconds per optimizer step), then under ``torch.profiler`` for ``--steps`` steps, and splits
the operators' own (self) CPU time into:

* ``gemm``: the matrix products (``mm``, ``addmm``, ``bmm``, ...), split by shape into the readout
  over the draft vocabulary (a dimension equal to ``draft_vocab_size``) and the rest;
* ``softmax and loss``, ``optimizer`` (fused AdamW, gradient clipping), ``copies and casts``
  (autocast's bfloat16 casts, ``cat``, indexing), ``elementwise`` (norms, rotary, activations);
* ``other operators``: the remaining ``aten`` operators (wrappers such as ``linear`` and
  ``matmul`` count their own time here, not their products');
* ``dispatch``: self time of everything that is not an ``aten`` operator (autograd nodes,
  Python-side wrappers, profiler records): the overhead of running a small graph op by op.

Each distinct GEMM shape is then timed alone (same dtype, same threads, a hot loop), which gives
the step's GEMM time at the speed this CPU reaches for those shapes. The result's bounds:

* ``if_only_gemm``: profiled step / GEMM time: the speed-up if everything but the matrix
  products cost nothing;
* ``if_gemm_alone_speed``: profiled step / isolated GEMM time: the same with each product also at
  its hot-loop speed.

Equal settings fix the shapes (the 128-token batch setting, which holds one conversation per
step; the 576-wide SmolLM2 head; the 4,096-token draft vocabulary), so a speed-up past these
bounds needs fewer operations, not faster ones.

    python benchmarks/train_profile.py [--threads 2] [--config default] [--steps 20]

Writes ``benchmarks/results/train_profile-<date>.json``. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from train_throughput import COMMON, CONFIGS, bench_settings, feature_store, step_clock  # noqa: E402

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
SOFTMAX_LOSS = ("softmax", "_softmax", "log_softmax", "_log_softmax", "nll_loss", "cross_entropy", "logsumexp")
OPTIMIZER = ("_fused_adam", "_foreach_", "linalg_vector_norm", "clamp", "norm")
#: operator names (after ``aten::``, up to a trailing ``_``, ``_forward`` or ``_backward...``)
COPIES = ("copy", "_to_copy", "to", "clone", "contiguous", "cat", "stack", "index", "index_select", "gather",
          "embedding", "embedding_dense", "repeat_interleave", "fill", "zero", "zeros", "empty", "empty_like",
          "as_strided", "_reshape_alias", "reshape", "view", "transpose", "t", "expand", "permute", "unsqueeze",
          "squeeze", "select", "slice", "split", "unbind", "narrow", "detach", "_unsafe_view", "resize",
          "new_zeros", "new_empty", "ones_like", "zeros_like")
ELEMENTWISE = ("mul", "add", "sub", "div", "pow", "rsqrt", "mean", "sum", "silu", "sigmoid", "neg", "masked_fill",
               "where", "cos", "sin", "exp", "tril", "ones", "eq", "ne", "lt", "gt", "argmax", "max", "sqrt",
               "reciprocal", "threshold", "arange", "rsub", "addcmul", "addcdiv", "lerp", "scatter_add", "bitwise_not",
               "logical_not", "le", "ge", "abs", "rms_norm", "_rms_norm", "relu", "gelu")


def _base(name: str) -> str:
    """``aten::mul_`` -> ``mul``, ``aten::_softmax_backward_data`` -> ``_softmax``."""
    op = name[len("aten::"):]
    for tail in ("_backward_data", "_backward", "_forward", "_out", "_"):
        if op.endswith(tail) and len(op) > len(tail):
            op = op[: -len(tail)]
            break
    return op


def category(name: str) -> str:
    """The bucket of one profiler key (operator name)."""
    if name in GEMM_OPS:
        return "gemm"
    if not name.startswith("aten::"):
        return "dispatch"
    op = _base(name)
    if op in SOFTMAX_LOSS:
        return "softmax and loss"
    if any(op.startswith(s) for s in OPTIMIZER):
        return "optimizer"
    if op in COPIES:
        return "copies and casts"
    if op in ELEMENTWISE:
        return "elementwise"
    return "other operators"


def gemm_flops(name: str, shapes: list[list[int]]) -> tuple[tuple[int, ...], float] | None:
    """``((batch, m, k, n), flops)`` of one GEMM call from its input shapes, None when unreadable."""
    mats = [s for s in shapes if len(s) >= 2]
    if len(mats) < 2:
        return None
    a, b = mats[-2], mats[-1]
    if len(a) == 2 and len(b) == 2:
        m, k, n, batch = a[0], a[1], b[1], 1
    elif len(a) == 3 and len(b) == 3:
        batch, m, k, n = a[0], a[1], a[2], b[2]
    else:
        return None
    return (batch, m, k, n), 2.0 * batch * m * k * n


def time_gemm(shape: tuple[int, ...], dtype: Any, repeats: int) -> float:
    """Seconds per call of one GEMM of ``shape`` (batch, m, k, n) alone, in a hot loop."""
    import torch

    batch, m, k, n = shape
    a = torch.randn(batch, m, k).to(dtype) if batch > 1 else torch.randn(m, k).to(dtype)
    b = torch.randn(batch, k, n).to(dtype) if batch > 1 else torch.randn(k, n).to(dtype)
    op = torch.bmm if batch > 1 else torch.mm
    for _ in range(3):
        op(a, b)
    t0 = time.perf_counter()
    for _ in range(repeats):
        op(a, b)
    return (time.perf_counter() - t0) / repeats


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from wavesurf.drafter.train import train_drafter
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    target = load_target(args.model)
    layers = [int(x) for x in args.layers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="wavesurf-train-profile-"))
    try:
        store = feature_store(target, layers, args.store_tokens, work / "store")
        settings = bench_settings(args.config, args.steps, args.warmup)
        clock, marks = step_clock(args.warmup)

        train_drafter(target, store, layers, settings, work / "plain", progress=False, callback=clock)
        plain_ms = 1000 * (marks["t1"] - marks["t0"]) / args.steps
        # real (unpadded) tokens per step: a batch below one conversation's length holds one conversation
        tokens_per_step = (marks["tok1"] - marks["tok0"]) / args.steps

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                     schedule=schedule(wait=0, warmup=args.warmup, active=args.steps, repeat=1)) as prof:
            def tick(step: int, record: dict) -> None:
                clock(step, record)
                prof.step()

            train_drafter(target, store, layers, settings, work / "profiled", progress=False, callback=tick)
        profiled_ms = 1000 * (marks["t1"] - marks["t0"]) / args.steps
        events = prof.key_averages(group_by_input_shape=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    by_category: dict[str, float] = defaultdict(float)
    gemms: dict[tuple[int, ...], dict[str, float]] = {}
    for evt in events:
        self_ms = evt.self_cpu_time_total / 1000 / args.steps
        cat = category(evt.key)
        if cat == "gemm":
            got = gemm_flops(evt.key, evt.input_shapes or [])
            if got is not None:
                shape, flops = got
                entry = gemms.setdefault(shape, {"calls": 0.0, "ms": 0.0, "gflop": 0.0})
                entry["calls"] += evt.count / args.steps
                entry["ms"] += self_ms
                entry["gflop"] += flops * evt.count / args.steps / 1e9
        by_category[cat] += self_ms
    total_ms = sum(by_category.values())
    vocab = settings.draft_vocab_size
    dtype = torch.bfloat16 if settings.precision == "bfloat16" else torch.float32

    rows, gemm_ms, gemm_alone_ms, readout_ms = [], 0.0, 0.0, 0.0
    for shape, e in sorted(gemms.items(), key=lambda kv: -kv[1]["ms"]):
        alone_s = time_gemm(shape, dtype, args.gemm_repeats)
        alone_ms = 1000 * alone_s * e["calls"]
        readout = vocab in shape[1:]
        gemm_ms += e["ms"]
        gemm_alone_ms += alone_ms
        readout_ms += e["ms"] if readout else 0.0
        rows.append({"batch_m_k_n": "x".join(map(str, shape)), "readout": readout,
                     "calls_per_step": round(e["calls"], 1), "ms_per_step": round(e["ms"], 2),
                     "gflop_per_s": round(e["gflop"] / (e["ms"] / 1000), 1) if e["ms"] else None,
                     "alone_ms_per_step": round(alone_ms, 2),
                     "alone_gflop_per_s": round(e["gflop"] / (alone_ms / 1000), 1) if alone_ms else None})
    peak = time_gemm((1, 2048, 2048, 2048), dtype, 5)
    categories = [{"category": c, "ms_per_step": round(ms, 2), "share": round(ms / total_ms, 3)}
                  for c, ms in sorted(by_category.items(), key=lambda kv: -kv[1])]
    return {
        "model": args.model, "layers": layers, "config": args.config, **CONFIGS[args.config], **COMMON,
        "steps": args.steps, "warmup": args.warmup, "store_tokens": args.store_tokens,
        "tokens_per_step": round(tokens_per_step, 1), "plain_tok_per_s": round(1000 * tokens_per_step / plain_ms, 1),
        "plain_ms_per_step": round(plain_ms, 2), "profiled_ms_per_step": round(profiled_ms, 2),
        "self_time_ms_per_step": round(total_ms, 2),
        "gemm_ms_per_step": round(gemm_ms, 2), "readout_gemm_ms_per_step": round(readout_ms, 2),
        "gemm_alone_ms_per_step": round(gemm_alone_ms, 2),
        "gemm_peak_gflop_per_s_2048": round(2 * 2048 ** 3 / peak / 1e9, 1),
        "bound_if_only_gemm": round(total_ms / gemm_ms, 2) if gemm_ms else None,
        "bound_if_gemm_alone_speed": round(total_ms / gemm_alone_ms, 2) if gemm_alone_ms else None,
        "note": "self times are per optimizer step under the profiler; bounds are ratios of self-time totals, "
                "so the profiler's own overhead (profiled vs plain ms per step) is counted as dispatch",
        "categories": categories,
        "gemm_shapes": rows[: args.top],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="2,15,27", help="vLLM ids the head reads")
    ap.add_argument("--config", default="default", choices=sorted(CONFIGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="profiled optimizer steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps first")
    ap.add_argument("--store-tokens", type=int, default=8192)
    ap.add_argument("--gemm-repeats", type=int, default=50, help="hot-loop calls per GEMM shape timed alone")
    ap.add_argument("--top", type=int, default=12, help="GEMM shapes kept in the result, most time first")
    args = ap.parse_args()
    if args.threads < 1 or args.steps < 1 or args.warmup < 1:
        raise SystemExit(f"--threads {args.threads}, --steps {args.steps} and --warmup {args.warmup} must be >= 1")
    os.environ["WAVESURF_THREADS"] = str(args.threads)
    load_before = os.getloadavg()[0]
    from _common import write_result

    payload = measure(args)
    payload.update(load_before=round(load_before, 2), quiet=load_before < 0.5)
    print(json.dumps(payload, indent=1))
    print("written", write_result("train_profile", payload))


if __name__ == "__main__":
    main()
