"""Time to load an embedded model: first load (dequantize the GGUF into a fresh cache) vs second
load (from the cached safetensors), each in a fresh process. Prints load_target's own time and the
process total (Python start + torch/transformers imports + load).

    python benchmarks/load_time.py [--model smollm2-135m]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CHILD = ("import time, wavesurf; t = time.perf_counter(); wavesurf.load_target({!r}, device='cpu'); "
         "print(time.perf_counter() - t)")


def timed(model: str, cache: str) -> tuple[float, float]:
    env = {**os.environ, "WAVESURF_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD.format(model)], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        first, first_total = timed(args.model, cache)
        second, second_total = timed(args.model, cache)
    print(f"{args.model}: first load_target {first:.1f} s (dequantize; process {first_total:.1f} s), "
          f"second load_target {second:.1f} s (process incl. imports {second_total:.1f} s); "
          f"second/first {second / first:.3f}; target: second load < 5 s")


if __name__ == "__main__":
    main()
