"""What the speed table's resampling costs against notebook 06's own time, measured in one run.

Notebook 06 re-reads every head, score and timed run from the cache and then resamples: the
two-level intervals of every drafter with the max-T family (sequences and seeds), the same for
the heads drafting after lookup, the percentiles of the selected sets in the null of random sets,
and the rank correlation of each criterion with τ (sets, sequences and seeds). This script loads
the same cached table (the profile's run must have happened: nothing is trained here), times each
resampling step ``--repeats`` times (median) and divides their sum by notebook 06's recorded time
in ``book/results/<model>/run.json`` (or ``--notebook-seconds``).

Target (issue 31): the resampling adds at most 5% to notebook 06's time.

    python benchmarks/resampling_cost.py --profile default [--model smollm2-135m] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import write_result

ROOT = Path(__file__).resolve().parent.parent


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls of ``fn`` and its last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def notebook_seconds(model: str, book: Path) -> tuple[float | None, str]:
    """Notebook 06's time and which run it was (first, uncached, or the latest) from run.json."""
    from wavesurf.book.reproduce import results_dir_name

    path = book / "results" / results_dir_name(model) / "run.json"
    if not path.is_file():
        return None, f"{path} is missing"
    entry = json.loads(path.read_text())["notebooks"].get("06_speed_table") or {}
    return entry.get("seconds"), f"{path} (profile {json.loads(path.read_text()).get('profile')})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--profile", default="default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--book", type=Path, default=ROOT / "book", help="the book whose run.json holds notebook 06's time")
    ap.add_argument("--notebook-seconds", type=float, default=None, help="notebook 06's time, instead of run.json's")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1; got {args.repeats}")

    import torch

    from wavesurf.book import paper
    from wavesurf.book.notebook import check_parameters
    from wavesurf.book.speed_table import _family_intervals, _null_ranks
    from wavesurf.book.verdicts import CONTROL
    from wavesurf.criteria import criteria_vs_tau, set_criteria
    from wavesurf.models import load_target

    threads = torch.get_num_threads()
    params = check_parameters(args.model, "sharegpt", None, args.profile, 0, "cpu")
    target = load_target(args.model)
    t0 = time.perf_counter()
    sets, settings, table = paper.profile_speed_table(target, params, progress=False)
    load_s = time.perf_counter() - t0
    acc = settings.acceptance
    groups = [table.runs[s.name] for s in sets] + [table.runs["bigram"], table.runs["lookup"], table.runs[CONTROL]]
    stats = paper.profile_stats(target, params, ["selection"], progress=False)["selection"]
    trained = [s for s in sets if s.name in table.runs]
    criteria = [set_criteria(stats, s.layer_ids) for s in trained]
    steps = {
        "family intervals (every drafter, max-T)": lambda: _family_intervals(groups, sets, acc),
        "null percentiles of the selected sets": lambda: _null_ranks(sets, table.runs, acc, settings.n_random),
        "criteria against tau (sets, sequences, seeds)": lambda: criteria_vs_tau(
            criteria, [table.runs[s.name] for s in trained], acc.draft_len, level=acc.level, n_boot=acc.n_boot),
    }
    rows = []
    for name, fn in steps.items():
        seconds, _ = timed(fn, args.repeats)
        rows.append({"step": name, "seconds": round(seconds, 4)})
        print(f"{name}: {seconds:.3f} s")
    # the lookup family has the same shape as the first (one drafter per set plus lookup alone)
    rows.append({"step": "intervals after lookup (same shape as the family; counted again)", "seconds": rows[0]["seconds"]})
    resampling = sum(r["seconds"] for r in rows)
    nb, source = (args.notebook_seconds, "--notebook-seconds") if args.notebook_seconds else notebook_seconds(args.model, args.book)
    share = resampling / nb if nb else None
    if share is None:
        print(f"resampling {resampling:.2f} s; notebook 06's time is unknown ({source})")
    else:
        print(f"resampling {resampling:.2f} s of notebook 06's {nb:.1f} s ({source}): {share:.1%}")
    where = write_result("resampling_cost", {
        "model": args.model, "profile": args.profile, "threads": threads, "repeats": args.repeats,
        "drafters": len(groups), "seeds": table.info.get("seed_counts") or table.info.get("seeds"),
        "sequences": table.info["heldout_sequences"], "n_boot": acc.n_boot,
        "steps": rows, "resampling_seconds": round(resampling, 3), "cached_table_load_seconds": round(load_s, 1),
        "notebook_06_seconds": nb, "notebook_06_source": source,
        "share_of_notebook_06": round(share, 4) if share is not None else None,
        "target": "<= 5% of notebook 06's time (issue 31)",
        "wavesurf_cache": os.environ.get("WAVESURF_CACHE", "default")})
    print(f"written {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
