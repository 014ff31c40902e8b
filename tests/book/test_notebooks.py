"""The notebooks: structure (one tagged `parameters` cell, then validation), bad parameters stop
with a clear error, and every notebook run through papermill with the `smoke` profile and then
checked by nbval (`--nbval-lax`: each cell runs without error; cells marked
`# NBVAL_CHECK_OUTPUT` must reproduce their output exactly) on the real model."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from wavesurf.book.reproduce import (
    ReproduceError,
    discover_notebooks,
    ensure_kernel,
    execute_notebook,
    notebook_parameters,
    repo_root,
)

NOTEBOOKS = discover_notebooks()
REQUIRED = {"model", "dataset", "max_tokens", "profile", "seed", "device"}
SANITIZE = repo_root() / "notebooks" / "nbval_sanitize.cfg"


def _cells(spec):
    import jupytext

    return jupytext.read(spec.path, fmt="py:percent").cells


@pytest.mark.parametrize("spec", NOTEBOOKS, ids=lambda s: s.stem)
def test_notebook_structure(spec):
    import ast

    cells = _cells(spec)
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# "), "first cell: the page title"
    tagged = [i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{spec.stem}: exactly one cell tagged 'parameters', found {len(tagged)}"
    names = {t.id for node in ast.parse(cells[tagged[0]].source).body for t in getattr(node, "targets", [])}
    assert REQUIRED <= names, f"{spec.stem}: the parameters cell needs {sorted(REQUIRED - names)}"
    assert "open_notebook(model, dataset, max_tokens, profile, seed, device)" in cells[tagged[0] + 1].source
    code = "\n".join(c.source for c in cells if c.cell_type == "code")
    assert "# NBVAL_CHECK_OUTPUT" in code
    assert "glue(" in code
    assert not list(spec.path.parent.glob("*.ipynb")), "notebooks are committed as jupytext text only"


def test_bad_parameter_stops_in_the_validation_cell(tmp_path):
    spec = next(s for s in NOTEBOOKS if s.number == "02")
    params = {**notebook_parameters("smollm2-135m", "smoke"), "max_tokens": "lots"}
    with pytest.raises(ReproduceError, match=r"02_cka_dynamics failed in cell \d+.*ParameterError: parameter "
                                             r"max_tokens='lots' is not allowed"):
        execute_notebook(spec, tmp_path / "02.ipynb", params, ensure_kernel(), progress=False)


def test_notebooks_smoke_profile_through_papermill_and_nbval(smollm, tmp_path):
    """papermill runs every notebook with the smoke profile (the reference outputs), then nbval
    re-runs them in a fresh kernel and compares the NBVAL_CHECK_OUTPUT cells."""
    kernel = ensure_kernel()
    params = notebook_parameters("smollm2-135m", "smoke", device="cpu")
    for spec in NOTEBOOKS:
        execute_notebook(spec, tmp_path / f"{spec.stem}.ipynb", params, kernel, progress=False)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
           "--nbval-sanitize-with", str(SANITIZE), "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
           *[f"{spec.stem}.ipynb" for spec in NOTEBOOKS]]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert " passed" in out and "failed" not in out
    for spec in NOTEBOOKS:  # every notebook wrote its figures
        assert list((tmp_path / "figures").glob(f"{spec.number}_*.png")), spec.stem
    _build_book_from(tmp_path, tmp_path / "project")


def _build_book_from(executed: Path, project: Path) -> None:
    """The book builds with warnings as errors from these executed notebooks: every glue key the
    prose and the generated introduction quote exists, citations resolve, figures are found."""
    import json
    import shutil

    from wavesurf.book.reproduce import ACROSS_DIR, build_book, finish_page, hardware, write_generated

    book = project / "book"
    shutil.copytree(repo_root() / "book", book, symlinks=False,
                    ignore=shutil.ignore_patterns("_build", "results", ACROSS_DIR, "generated"))
    for name in ("_config.yml", "_toc.yml"):
        (book / name).unlink(missing_ok=True)
        shutil.copy(repo_root() / name, book / name)
    for scope_dir, specs in ((book / "results" / "smollm2-135m", [s for s in NOTEBOOKS if s.scope == "model"]),
                             (book / ACROSS_DIR, [s for s in NOTEBOOKS if s.scope == "all"])):
        scope_dir.mkdir(parents=True)
        for spec in specs:
            shutil.copy(executed / f"{spec.stem}.ipynb", scope_dir)
            finish_page(scope_dir / f"{spec.stem}.ipynb", "smollm2-135m" if spec.scope == "model" else None)
        for sub in ("figures", "tables"):
            shutil.copytree(executed / sub, scope_dir / sub)
        (scope_dir / "run.json").write_text(json.dumps({
            "model": "smollm2-135m", "profile": "smoke", "hardware": hardware(),
            "notebooks": {s.stem: {"seconds": 1.0, "finished": "now"} for s in specs}}))
    write_generated(book, primary="smollm2-135m")
    html = build_book(book)
    intro = (html.parent / "intro.html").read_text()
    assert "The answer in numbers" in intro and "01_entropy_depth.png" in intro


def test_every_page_describes_its_target_in_one_line(smollm):
    from wavesurf.book.notebook import target_line

    assert target_line(smollm) == ("smollm2-135m: N = 30 blocks, d = 576, default EAGLE-3 layers (vLLM ids) "
                                   "[2, 15, 27]")
    pages = [s.stem for s in NOTEBOOKS if "print(target_line(target))" not in s.path.read_text()]
    assert pages == ["04b_filtering_drafters", "04c_served_positions"], pages  # they print their own subject
