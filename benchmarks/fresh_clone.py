"""What a newcomer waits for: clone this repository at HEAD into a temporary folder and run the
README's own commands there with an empty ``WAVESURF_CACHE``, timing each phase.

    python benchmarks/fresh_clone.py --phases tests        # the README's test command
    python benchmarks/fresh_clone.py --phases main         # the README's main-job command
    python benchmarks/fresh_clone.py --phases main --profile long   # the main job with another profile
    python benchmarks/fresh_clone.py --dry-run             # print what would run, run nothing

The commands are read from the clone's ``README.md`` (the fenced ``bash`` blocks that start with
``./setup.sh &&``: the first runs the main job, the one with ``pytest`` the tests), so this measures
what the README says. Each phase records its wall time, exit status, the 1-minute load average
before and after, and when each notebook's inner phase (``reproduce``'s progress lines) was first
and last seen; the host's pace (a fixed matrix-product loop, :data:`PACE_CODE`) is timed before and
after the phases; the result goes to ``benchmarks/results/fresh_clone-<date>.json`` through
``_common.write_result``; after a main job that finished, ``profile_summary.py`` keeps what it found
(one JSON per model, named in ``profile_summaries``). The clone and its cache are deleted afterwards, also on failure or Ctrl-C
(``--keep`` keeps them for inspection): a full disk once failed CI. The whole thing takes about an
hour for ``--phases tests,main`` on two cores; time it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("tests", "main")
#: refuse to start with less free disk than this under the temporary folder (a clone, its .venv,
#: the dequantized models, the answers and the book)
MIN_FREE_GIB = 8.0


def readme_commands(readme: str) -> dict[str, str]:
    """The README's two commands: ``main`` (``./setup.sh && ... reproduce ...``) and ``tests``
    (``./setup.sh && ... pytest ...``), from its fenced ``bash`` blocks. Refuses a README without them."""
    found: dict[str, str] = {}
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", readme, flags=re.S):
        for line in block.splitlines():
            line = line.strip()
            if not line.startswith("./setup.sh &&"):
                continue
            kind = "tests" if "pytest" in line else "main" if "reproduce" in line else None
            if kind and kind not in found:
                found[kind] = line
    missing = [p for p in PHASES if p not in found]
    if missing:
        raise SystemExit(f"README.md has no command for {', '.join(missing)}: expected a fenced bash block "
                         "with a line './setup.sh && ... pytest ...' (tests) and one with '... reproduce ...' (main)")
    return found


def parse_phases(text: str) -> list[str]:
    """``"tests,main"`` -> ``["tests", "main"]``; an unknown or repeated phase is refused."""
    phases = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases or len(set(phases)) != len(phases):
        raise argparse.ArgumentTypeError(f"phases must be a comma-separated subset of {', '.join(PHASES)} "
                                         f"without repeats; got {text!r}")
    return phases


def with_profile(command: str, profile: str) -> str:
    """The README's main command with its ``--profile`` value replaced by ``profile`` (refused
    where the command names none, or the profile does not exist)."""
    sys.path.insert(0, str(ROOT))
    from wavesurf.book.profiles import profile_names

    if profile not in profile_names():
        raise SystemExit(f"--profile {profile!r} is not a profile; available: {', '.join(profile_names())}")
    new, n = re.subn(r"--profile\s+\S+", f"--profile {profile}", command)
    if n != 1:
        raise SystemExit(f"the README's main command names {n} --profile options, expected 1: {command}")
    return new


def head_commit(root: Path = ROOT) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def free_gib(path: Path) -> float:
    return shutil.disk_usage(path).free / 2**30


#: a notebook's inner progress line as ``wavesurf reproduce`` prints it ("      04b_filtering_drafters:
#: train and score heads 12/33, ~5 min left; ...")
PROGRESS_LINE = re.compile(r"^\s+(\w+): (.+?) (\d+)/(\d+)(?=[,;\s]|$)")

#: the host's pace, timed before and after the phases: a fixed float32 matrix-product loop (the
#: shapes of a SmolLM2-135M MLP at 512 rows) in this checkout's .venv, at each thread count. The
#: same code on the same host has run 13-45% slower on some evenings; this puts that beside a
#: phase's seconds.
PACE_CODE = """
import json, sys, time, torch
scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0  # < 1 in tests only: the recorded pace is at 1
n = max(1, int(500 * scale))
out = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    x, w = torch.randn(512, 576), torch.randn(576, 1536)
    for _ in range(20):
        x @ w
    t0 = time.perf_counter()
    for _ in range(n):
        x @ w
    out[f"matmul_gflops_{threads}t"] = round(2 * 512 * 576 * 1536 * n / (time.perf_counter() - t0) / 1e9, 1)
t0 = time.perf_counter()
sum(i * i for i in range(max(1, int(3_000_000 * scale))))
out["python_loop_s"] = round((time.perf_counter() - t0) / scale, 3)
print(json.dumps(out))
"""


def host_pace(python: Path = ROOT / ".venv" / "bin" / "python", scale: float = 1.0) -> dict | None:
    """:data:`PACE_CODE` run in ``python`` (None where that interpreter is missing or fails);
    ``scale`` < 1 runs a fraction of the loops (the tests' check that it measures, not a pace)."""
    if not python.exists():
        return None
    try:
        proc = subprocess.run([str(python), "-c", PACE_CODE, str(scale)], capture_output=True, text=True,
                              timeout=300)
        return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def inner_phases(lines: list[tuple[float, str]]) -> list[dict]:
    """From ``(seconds since the phase began, line)``: where each notebook's inner phase was first
    and last seen in the progress lines, in order of first sight."""
    seen: dict[tuple[str, str], dict] = {}
    for t, line in lines:
        m = PROGRESS_LINE.match(line)
        if not m:
            continue
        key = (m.group(1), m.group(2))
        row = seen.setdefault(key, {"notebook": key[0], "phase": key[1], "total": int(m.group(4)),
                                    "first_s": round(t, 1)})
        row["last_s"], row["last_index"] = round(t, 1), int(m.group(3))
    return list(seen.values())


def run_phase(name: str, command: str, cwd: Path, env: dict[str, str], log: Path, timeout: float | None) -> dict:
    """Run one command through bash, its output to ``log`` line by line; wall time, exit status,
    load before/after and the inner phases its progress lines name (:func:`inner_phases`)."""
    load_before = round(os.getloadavg()[0], 2)
    t0 = time.perf_counter()
    stamped: list[tuple[float, str]] = []
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL)) if timeout else None
        if timer:
            timer.start()
        for line in proc.stdout:
            out.write(line)
            out.flush()  # the log can be followed while the phase runs
            stamped.append((time.perf_counter() - t0, line.rstrip("\n")))
        rc = proc.wait()
        timed_out = timer is not None and not timer.is_alive() and rc < 0
        if timer:
            timer.cancel()
    seconds = time.perf_counter() - t0
    tail = [line for _, line in stamped if line.strip()][-3:]
    return {"phase": name, "command": command, "seconds": round(seconds, 1), "exit": 124 if timed_out else rc,
            "load_before": load_before, "load_after": round(os.getloadavg()[0], 2), "tail": " / ".join(tail),
            "inner": inner_phases(stamped)}


def profile_of(command: str) -> str:
    """The profile a main command runs (its ``--profile`` value; ``default`` where it names none)."""
    m = re.search(r"--profile\s+(\S+)", command)
    return m.group(1) if m else "default"


def result_dirs(clone: Path) -> list[Path]:
    """The clone's ``book/results/<model>`` folders that hold a finished speed table."""
    return sorted(p.parent.parent for p in (clone / "book" / "results").glob("*/tables/06_speed_table_summary.csv"))


def keep_profile_summary(results: Path, profile: str, commit: str) -> str | None:
    """What the run found, kept before the clone is deleted: ``profile_summary.py`` on one model's
    results (its speed table, floors, embedding-only control, null, timed runs); the JSON's path
    relative to the repository, or None where it failed (its message printed)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_summary.py"), "--results", str(results),
                           "--profile", profile, "--cloned-commit", commit], cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout.strip() or proc.stderr.strip()[-2000:], flush=True)
    m = re.search(r"written (\S+)", proc.stdout)
    return str(Path(m.group(1)).resolve().relative_to(ROOT)) if proc.returncode == 0 and m else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", type=parse_phases, default=list(PHASES),
                    help="which README commands to run, in order (default: tests,main)")
    ap.add_argument("--tmp", type=Path, default=None, help="folder for the clone (default: the system's temp folder)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per phase (default: none)")
    ap.add_argument("--keep", action="store_true", help="keep the clone and its cache afterwards")
    ap.add_argument("--profile", default=None,
                    help="run the main command with this profile instead of the README's (e.g. long)")
    ap.add_argument("--dry-run", action="store_true", help="print the clone, commands and cache, run nothing")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.timeout is not None and args.timeout <= 0:
        raise SystemExit(f"--timeout must be positive; got {args.timeout}")
    commit = head_commit()
    commands = readme_commands((ROOT / "README.md").read_text())
    if args.profile:
        commands["main"] = with_profile(commands["main"], args.profile)
    base = Path(args.tmp or tempfile.gettempdir())
    if args.dry_run:
        print(f"would clone {ROOT} at {commit[:10]} into a new folder under {base}, with WAVESURF_CACHE "
              f"empty inside it, and run:")
        for phase in args.phases:
            print(f"  {phase}: {commands[phase]}")
        print("then write benchmarks/results/fresh_clone-<date>.json and "
              + ("keep the clone" if args.keep else "delete the clone and its cache"))
        return 0
    if free_gib(base) < MIN_FREE_GIB:
        raise SystemExit(f"{base} has {free_gib(base):.1f} GiB free; a fresh clone's run needs about {MIN_FREE_GIB:g}")
    work = Path(tempfile.mkdtemp(prefix="wavesurf-fresh-", dir=base))
    clone, cache = work / "clone", work / "cache"
    # unbuffered: a line is stamped when it is printed, not when a pipe's buffer fills
    env = {**os.environ, "WAVESURF_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    phases: list[dict] = []
    summaries: list[str | None] = []
    load0 = round(os.getloadavg()[0], 2)
    pace_before = host_pace()
    try:
        t0 = time.perf_counter()
        subprocess.run(["git", "clone", "--quiet", "--no-local", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "--quiet", commit], cwd=clone, check=True)
        phases.append({"phase": "clone", "seconds": round(time.perf_counter() - t0, 1), "exit": 0})
        for phase in args.phases:
            cache.mkdir(exist_ok=True)
            result = run_phase(phase, commands[phase], clone, env, work / f"{phase}.log", args.timeout)
            phases.append(result)
            print(f"{phase}: exit {result['exit']} in {result['seconds']:.0f} s "
                  f"(load {result['load_before']} -> {result['load_after']})", flush=True)
            if result["exit"] != 0:
                break
        disk = sum(f.stat().st_size for f in work.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30
        if any(p["phase"] == "main" and p["exit"] == 0 for p in phases):
            summaries = [keep_profile_summary(d, profile_of(commands["main"]), commit[:10]) for d in result_dirs(clone)]
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import write_result

    where = write_result("fresh_clone", {
        "cloned_commit": commit[:10], "profile": args.profile or "as in the README", "load_before": load0, "phases": phases, "total_seconds": round(sum(p["seconds"] for p in phases), 1),
        "host_pace": {"before": pace_before, "after": host_pace(), "code": "benchmarks/fresh_clone.py PACE_CODE"},
        "disk_gib": round(disk, 2), "ok": all(p["exit"] == 0 for p in phases),
        "profile_summaries": [x for x in summaries if x],
        "note": "an empty WAVESURF_CACHE; pip's own download cache as found on the host"})
    print(f"written {where}")
    return 0 if all(p["exit"] == 0 for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
