"""The benchmark scripts that keep the documents honest: ``fresh_clone.py`` (the README's commands on
a fresh clone; only its argument handling and dry run here, the real run takes an hour) and
``render.py`` (benchmarks/README.md's results section is what the result files say)."""
from __future__ import annotations

import argparse
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRESH = runpy.run_path(str(ROOT / "benchmarks" / "fresh_clone.py"))


def test_fresh_clone_reads_the_readme_commands_that_ci_runs():
    commands = FRESH["readme_commands"]((ROOT / "README.md").read_text())
    assert commands["main"].startswith("./setup.sh && .venv/bin/wavesurf reproduce ")
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert commands["tests"] == ci  # the README's test command is exactly CI's
    with pytest.raises(SystemExit, match="no command for tests"):
        FRESH["readme_commands"]("```bash\n./setup.sh && .venv/bin/wavesurf reproduce --profile smoke\n```\n")


def test_fresh_clone_phases_are_checked():
    assert FRESH["parse_phases"]("tests") == ["tests"]
    assert FRESH["parse_phases"](" main , tests ") == ["main", "tests"]
    for bad in ("", "tests,tests", "build", "tests,main,book"):
        with pytest.raises(argparse.ArgumentTypeError, match="subset of tests, main"):
            FRESH["parse_phases"](bad)


def test_fresh_clone_keeps_what_a_finished_main_job_found(tmp_path):
    """The profile comes from the main command; only results folders with a speed table are summarised,
    and a folder that is not a finished run gives None (the message printed), writing nothing."""
    assert FRESH["profile_of"]("./setup.sh && .venv/bin/wavesurf reproduce --model m --profile long") == "long"
    assert FRESH["profile_of"]("./setup.sh && .venv/bin/wavesurf reproduce --model m") == "default"
    (tmp_path / "book" / "results" / "a" / "tables").mkdir(parents=True)
    (tmp_path / "book" / "results" / "a" / "tables" / "06_speed_table_summary.csv").write_text("layer_set\n")
    (tmp_path / "book" / "results" / "b" / "tables").mkdir(parents=True)  # a run that stopped before 06
    assert FRESH["result_dirs"](tmp_path) == [tmp_path / "book" / "results" / "a"]
    before = sorted((ROOT / "benchmarks" / "results").glob("profile_summary-*.json"))
    assert FRESH["keep_profile_summary"](tmp_path / "book" / "results" / "b", "default", "abc") is None
    assert sorted((ROOT / "benchmarks" / "results").glob("profile_summary-*.json")) == before


def test_fresh_clone_dry_run_runs_nothing_and_writes_nothing(tmp_path):
    before = sorted((ROOT / "benchmarks" / "results").glob("fresh_clone-*.json"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fresh_clone.py"), "--dry-run", "--phases", "tests",
                           "--tmp", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "-m pytest -q -n 2 --dist loadfile" in proc.stdout and "delete the clone" in proc.stdout
    assert list(tmp_path.iterdir()) == []
    assert sorted((ROOT / "benchmarks" / "results").glob("fresh_clone-*.json")) == before
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fresh_clone.py"), "--phases", "book"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "subset of tests, main" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fresh_clone.py"), "--timeout", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--timeout must be positive" in proc.stderr


def test_benchmarks_readme_results_section_is_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fresh_clone_can_run_the_main_command_with_another_profile():
    main = "./setup.sh && .venv/bin/wavesurf reproduce --model smollm2-135m --profile default"
    assert FRESH["with_profile"](main, "long") == main.replace("--profile default", "--profile long")
    with pytest.raises(SystemExit, match="'longer' is not a profile; available: smoke, default, long, paper"):
        FRESH["with_profile"](main, "longer")
    with pytest.raises(SystemExit, match="names 0 --profile options"):
        FRESH["with_profile"]("./setup.sh && .venv/bin/wavesurf reproduce --model smollm2-135m", "long")


def test_every_benchmark_script_is_in_the_readme_table():
    table = (ROOT / "benchmarks" / "README.md").read_text().split("## ")[0]
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
    missing = [s for s in scripts if f"| `{s}` |" not in table]
    assert not missing, f"benchmarks/README.md's table of scripts lacks {missing}"


def test_train_profile_buckets_operators_and_counts_gemm_flops():
    prof = runpy.run_path(str(ROOT / "benchmarks" / "train_profile.py"))
    category, flops = prof["category"], prof["gemm_flops"]
    assert [category(k) for k in ("aten::mm", "aten::addmm", "aten::bmm")] == ["gemm"] * 3
    assert category("aten::_softmax_backward_data") == category("aten::nll_loss_forward") == "softmax and loss"
    assert category("aten::_fused_adamw_") == category("aten::_foreach_norm") == "optimizer"
    assert category("aten::_to_copy") == category("aten::cat") == "copies and casts"
    assert category("aten::mul") == category("aten::rsqrt") == "elementwise"
    assert category("autograd::engine::evaluate_function: MmBackward0") == "dispatch"
    # addmm(bias [n], a [m, k], b [k, n]) and bmm([B, m, k], [B, k, n]): 2 m k n flops per product
    assert flops("aten::addmm", [[4096], [128, 576], [576, 4096]]) == ((1, 128, 576, 4096), 2.0 * 128 * 576 * 4096)
    assert flops("aten::bmm", [[9, 128, 64], [9, 64, 128]]) == ((9, 128, 64, 128), 2.0 * 9 * 128 * 64 * 128)
    assert flops("aten::mm", [[128]]) is None


def test_fresh_clone_phase_records_inner_phases_and_its_timeout(tmp_path):
    """The phase's output is kept line by line; each notebook's inner phase, in the line
    ``reproduce`` prints (wavesurf.progress.describe), gets where it was first and last seen; a
    phase past its timeout is killed and exits 124."""
    from wavesurf.progress import describe

    def line(label, i, n):
        state = {"phase": {"label": label, "index": i, "total": n, "started": 0.0, "time": 1.0}}
        return f"      04b_filtering_drafters: {describe(state, now=2.0)} | after this notebook: ~9 min"

    script = tmp_path / "lines.txt"
    script.write_text("\n".join(["Executing 04b", line("the target's answers", 1, 2), line("the target's answers", 2, 2),
                                 line("train and score heads", 1, 33), "done"]) + "\n")
    got = FRESH["run_phase"]("main", f"cat {script}; sleep 0.3; echo {line('timed runs', 1, 6)!r}", tmp_path,
                             {"PATH": "/usr/bin:/bin"}, tmp_path / "main.log", None)
    assert got["exit"] == 0 and (tmp_path / "main.log").read_text().startswith("Executing 04b\n")
    inner = got["inner"]
    assert [(r["phase"], r["total"], r["last_index"]) for r in inner] == [
        ("the target's answers", 2, 2), ("train and score heads", 33, 1), ("timed runs", 6, 1)]
    assert {r["notebook"] for r in inner} == {"04b_filtering_drafters"}
    assert inner[-1]["first_s"] >= 0.3 > inner[0]["first_s"]
    slow = FRESH["run_phase"]("tests", "echo started; sleep 30", tmp_path, {"PATH": "/usr/bin:/bin"},
                              tmp_path / "tests.log", 0.5)
    assert slow["exit"] == 124 and slow["seconds"] < 10 and slow["tail"] == "started"


def test_fresh_clone_host_pace_is_a_measurement_or_none(tmp_path):
    assert FRESH["host_pace"](tmp_path / "no-python") is None
    pace = FRESH["host_pace"](Path(sys.executable), scale=0.02)
    assert set(pace) == {"matmul_gflops_1t", "matmul_gflops_2t", "python_loop_s"} and min(pace.values()) > 0
