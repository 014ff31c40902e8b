"""Keep what a finished profile run found, as a result file: the speed table's floors, primary
comparison, family, null, criteria, learning curve and timed speedups, read from the tidy CSVs of
``book/results/<model>/tables/`` (a run's executed pages are never committed; this JSON is).

    python benchmarks/profile_summary.py --results /tmp/clone/book/results/smollm2-135m \
        --profile long --cloned-commit 7fa78a6

Reads only; run it on the results of a run made by ``wavesurf reproduce`` (or a fresh clone kept
with ``fresh_clone.py --keep``).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from _common import write_result

from wavesurf.book.reproduce import ACROSS_DIR


def rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise SystemExit(f"{path} is missing: is --results a book/results/<model> folder of a finished run?")
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def num(v: str) -> float | str:
    try:
        return round(float(v), 5)
    except (TypeError, ValueError):
        return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, required=True, help="book/results/<model> of a finished run")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--cloned-commit", default="", help="the commit the run was made from")
    args = ap.parse_args(argv)
    tables = args.results / "tables"
    summary = rows(tables / "06_speed_table_summary.csv")
    keep = ("layer_set", "group", "layer_ids", "seeds", "tau", "tau_lo", "tau_hi", "diff", "diff_lo", "diff_hi",
            "diff_unadj_lo", "diff_unadj_hi", "verdict", "lookup_tau", "lookup_diff", "lookup_diff_lo",
            "lookup_diff_hi", "rescue", "rescue_lo", "rescue_hi")
    run = json.loads((args.results / "run.json").read_text()) if (args.results / "run.json").is_file() else {}
    seconds = {k: v.get("seconds") for k, v in run.get("notebooks", {}).items()}
    # the across-models notebooks (07) record their time in book/across-models/run.json
    across = args.results.parent.parent / ACROSS_DIR / "run.json"
    if across.is_file():
        seconds.update({k: v.get("seconds") for k, v in json.loads(across.read_text()).get("notebooks", {}).items()})
    payload = {
        "profile": args.profile, "cloned_commit": args.cloned_commit, "results": str(args.results),
        "model": run.get("model"), "notebook_seconds": seconds,
        "speed_table": [{k: num(r.get(k, "")) for k in keep} for r in summary],
        "criteria": [{k: num(v) for k, v in r.items()} for r in rows(tables / "06_criteria.csv")],
        "curve": [{k: num(v) for k, v in r.items()} for r in rows(tables / "06_tau_vs_tokens.csv")],
        "timed": [{k: num(r[k]) for k in ("role", "layer_set", "layer_ids", "dataset", "tau", "speedup", "speedup_lo",
                                          "speedup_hi", "predicted_speedup")} for r in rows(tables / "06_timed.csv")],
        "streams_default": [{k: num(v) for k, v in r.items()} for r in rows(tables / "06_streams.csv")
                            if r["group"] == "default"],
    }
    where = write_result("profile_summary", payload)
    default = next(r for r in payload["speed_table"] if r["group"] == "default")
    print(f"default tau {default['tau']} ({default['tau_lo']}-{default['tau_hi']}); written {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
