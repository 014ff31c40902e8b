"""Progress that reaches the terminal from inside a notebook: the bars and phases of the library
write their state to the file the environment names, ``reproduce`` prints it while a notebook runs."""
from __future__ import annotations

import time

import pytest

from wavesurf import progress
from wavesurf.progress import ENV, describe, phase, progress_bar, read, remaining_seconds


def test_bars_and_phases_report_to_the_named_file_only(tmp_path, monkeypatch):
    path = tmp_path / "progress.json"
    monkeypatch.delenv(ENV, raising=False)
    bar = progress_bar(total=4, desc="train L2,15,27", unit="step", disable=True)
    bar.update(2)
    bar.close()
    phase("train and score heads", 1, 3)
    assert not path.exists()  # no file named: plain bars, no-op phases

    monkeypatch.setenv(ENV, str(path))
    phase("train and score heads", 2, 3)
    bar = progress_bar(total=10, desc="train L2,15,27", unit="step", disable=False)
    for _ in range(4):
        bar.update(1)
    bar.close()  # closing always writes the last state
    state = read(path)
    assert state["phase"]["label"] == "train and score heads" and state["phase"]["index"] == 2
    assert state["bar"]["desc"] == "train L2,15,27" and state["bar"]["n"] == 4 and state["bar"]["total"] == 10
    line = describe(state)
    assert line.startswith("train and score heads 2/3") and "train L2,15,27: 4/10 step" in line
    # a disabled bar (progress=False) stays silent even with a file
    phase("timed runs", 1, 2)
    quiet = progress_bar(total=5, desc="quiet", disable=True)
    quiet.update(5)
    quiet.close()
    assert "bar" not in read(path) and read(path)["phase"]["label"] == "timed runs"
    assert read(tmp_path / "absent.json") is None and describe(None) == ""


def test_time_left_in_a_phase_is_the_mean_step_time_times_the_steps_left():
    t0 = 1000.0
    state = {"phase": {"label": "train and score heads", "index": 3, "total": 5, "started": t0, "time": t0 + 20}}
    # 2 steps took 20 s: 3 steps left (the current one included) take 30 s, 5 s of it already spent
    assert remaining_seconds(state, now=t0 + 25) == pytest.approx(25.0)
    assert "~25s left" in describe(state, now=t0 + 25)
    state["phase"]["index"] = 1
    assert remaining_seconds(state, now=t0) is None  # nothing finished yet: no estimate


def test_a_phase_keeps_its_start_across_steps(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "p.json"))
    phase("heads", 1, 3)
    started = read(tmp_path / "p.json")["phase"]["started"]
    time.sleep(0.01)
    phase("heads", 2, 3)
    assert read(tmp_path / "p.json")["phase"]["started"] == started
    phase("timed runs", 1, 2)
    assert read(tmp_path / "p.json")["phase"]["started"] > started
    assert progress.MIN_INTERVAL_S > 0


def test_reproduce_prints_a_notebooks_inner_progress_while_it_runs(monkeypatch):
    from wavesurf.book.reproduce import watch_progress

    monkeypatch.delenv(ENV, raising=False)
    lines: list[str] = []
    with watch_progress("04b_filtering_drafters", lines.append, after="~1m (previous run)", every_s=0.0,
                        poll_s=0.02) as path:
        import os

        assert os.environ[ENV] == str(path)  # the kernel papermill starts inherits it
        phase("train and score heads", 1, 33)
        deadline = time.time() + 5
        while not lines and time.time() < deadline:
            time.sleep(0.02)
    assert lines and lines[0].startswith("      04b_filtering_drafters: train and score heads 1/33")
    assert lines[0].endswith("| after this notebook: ~1m (previous run)")
    assert ENV not in __import__("os").environ and not path.exists()  # nothing left behind
