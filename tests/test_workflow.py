"""The CI workflow that tests every push and publishes the book from main: it lints clean with
actionlint and zizmor (both from PyPI, run offline), and it runs the README's own two commands."""
from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"


def _tool(name: str) -> str:
    """The linter installed beside this Python (setup.sh installs both from requirements.txt)."""
    here = Path(sys.executable).with_name(name)
    found = str(here) if here.exists() else shutil.which(name)
    assert found, f"{name} is not installed; run ./setup.sh (requirements.txt pins it)"
    return found


@pytest.mark.skipif(not (platform.system() == "Linux" and platform.machine() == "x86_64"),
                    reason="the linters' wheels are installed on Linux x86_64 only (requirements.txt)")
def test_the_workflow_lints_clean():
    lint = subprocess.run([_tool("actionlint"), str(WORKFLOW)], capture_output=True, text=True, cwd=ROOT)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    audit = subprocess.run([_tool("zizmor"), "--offline", "--config", str(ROOT / ".github" / "zizmor.yml"),
                            str(WORKFLOW)], capture_output=True, text=True, cwd=ROOT)
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_the_workflow_runs_the_readme_commands_and_deploys_the_built_book():
    flow = yaml.safe_load(WORKFLOW.read_text())
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    steps = {job: [s.get("run", "") for s in spec["steps"]] for job, spec in flow["jobs"].items()}
    assert ".ci/run" in steps["tests"]  # the README's test command, exactly as CI calls it
    main = next(ln.strip() for ln in readme.splitlines() if ln.strip().startswith("./setup.sh &&") and "reproduce" in ln)
    assert main in steps["book"]
    test_cmd = next(ln.strip() for ln in readme.splitlines() if ln.strip().startswith("./setup.sh &&") and "pytest" in ln)
    assert test_cmd in ci
    uploads = [s for s in flow["jobs"]["book"]["steps"] if "upload-pages-artifact" in s.get("uses", "")]
    assert uploads and uploads[0]["with"]["path"] == "book/_build/html"
    assert flow["jobs"]["book"]["if"].endswith("refs/heads/main'") and flow["jobs"]["deploy"]["needs"] == "book"
    # the cache of models, answers and heads is the one the library reads
    assert all("WAVESURF_CACHE" in str(s.get("with", {}).get("path", "")) for j in ("tests", "book")
               for s in flow["jobs"][j]["steps"] if "actions/cache" in s.get("uses", ""))
    assert re.search(r"WAVESURF_CACHE:", WORKFLOW.read_text())
