"""Time to load an embedded model: first load (dequantize GGUF into a fresh cache) vs second load
(from the cached safetensors), each in a fresh process so imports count. Prints the ratio.

    python benchmarks/load_time.py [--model smollm2-135m]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CHILD = "import wavesurf; wavesurf.load_target({!r}, device='cpu')"


def timed(model: str, cache: str) -> float:
    env = {**os.environ, "WAVESURF_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD.format(model)], env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        first = timed(args.model, cache)
        second = timed(args.model, cache)
    print(f"{args.model}: first load {first:.1f} s (dequantize), second load {second:.1f} s "
          f"(incl. Python + torch + transformers import); second/first {second / first:.3f}; target: second < 5 s")


if __name__ == "__main__":
    main()
