"""``wavesurf reproduce``: jupytext notebooks -> papermill -> the book tree -> ``jupyter-book build``.

Each notebook of ``notebooks/`` (py:percent, ``NN_name.py``) is converted with jupytext, run with
papermill on a kernel of the current Python (a kernelspec installed offline into this
environment), with the model and profile injected into its ``parameters`` cell. Executed notebooks,
their figures and tables are written into a staging directory and swapped into
``book/results/<model>/`` only when every notebook of the run succeeded, so a page never shows a
figure of an older run next to new ones, and another model's pages stay untouched. Notebooks that
compare models (``SCOPE_ALL``) land in ``book/across-models/``. A failing notebook stops the run;
its partial executed copy is kept under ``runs/reproduce/failed/`` (outside the book).

Over ~450 lines because running, staging, publishing atomically and the generated pages (profiles,
answer, limitations, benchmarks) are one transaction over the book tree.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ReproduceError
from .profiles import BASE_PROFILE, DRAFTER_NOTEBOOKS, get_profile, scaled_reference_minutes

KERNEL_NAME = "wavesurf-python"
#: the least seconds between two lines of a notebook's inner progress in the terminal
PROGRESS_EVERY_S = 30.0
#: notebooks that read every model's cached results rather than one model's
SCOPE_ALL = {"07"}
ACROSS_DIR = "across-models"



@dataclass(frozen=True)
class NotebookSpec:
    number: str  # "01"
    stem: str  # "01_entropy_compartments"
    path: Path

    @property
    def scope(self) -> str:
        return "all" if self.number in SCOPE_ALL else "model"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def discover_notebooks(notebook_dir: Path | None = None) -> list[NotebookSpec]:
    """The ``NN_name.py`` (or ``NNa_name.py``) notebooks of ``notebook_dir`` in number order; the
    number prefixes the notebook's figures and tables (``figures/NN_*.png``)."""
    notebook_dir = Path(notebook_dir or repo_root() / "notebooks")
    specs = []
    for p in sorted(notebook_dir.glob("[0-9][0-9]*_*.py")):
        m = re.fullmatch(r"(\d\d[a-z]?)_\w+", p.stem)
        if m:
            specs.append(NotebookSpec(m.group(1), p.stem, p))
    if not specs:
        raise ReproduceError(f"no notebooks (NN_name.py) found in {notebook_dir}")
    return specs


def select_notebooks(specs: Sequence[NotebookSpec], only: str | Sequence[str] | None) -> list[NotebookSpec]:
    """``only`` as '01,03' (numbers or full stems); unknown entries raise with the list available."""
    if only is None or only == "" or only == []:
        return list(specs)
    items = [x.strip() for x in (only.split(",") if isinstance(only, str) else only) if x.strip()]
    chosen, unknown = [], []
    for item in items:
        match = [s for s in specs if item in (s.number, s.stem, s.number.lstrip("0"), s.path.name)]
        if not match:
            unknown.append(item)
        chosen.extend(m for m in match if m not in chosen)
    if unknown or not chosen:
        raise ReproduceError(f"--only {','.join(items)!r}: unknown notebook(s) {unknown or items}; available: "
                             + ", ".join(s.stem for s in specs))
    return sorted(chosen, key=lambda s: s.number)


def results_dir_name(model: str) -> str:
    """The folder of a model's pages under ``book/results/`` (its cache-safe name, never empty)."""
    from ..cache import safe_name as _safe

    return _safe(model).strip("._") or "model"


# ---------------------------------------------------------------------------------------------
def kernel_argv() -> list[str]:
    """The kernel command: this very Python, kernel-level warnings off (e.g. the plain-TCP notice)."""
    return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--IPKernelApp.log_level=ERROR"]


def ensure_kernel() -> str:
    """Install (offline) a kernelspec running this very Python into this environment; return its name."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        if KernelSpecManager().get_kernel_spec(KERNEL_NAME).argv == kernel_argv():
            return KERNEL_NAME
    except NoSuchKernel:
        pass
    folder = Path(sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL_NAME
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"argv": kernel_argv(), "display_name": "Python 3 (wavesurf)", "language": "python",
            "metadata": {"debugger": False}}
    tmp = folder / "kernel.json.tmp"
    tmp.write_text(json.dumps(spec, indent=1))
    os.replace(tmp, folder / "kernel.json")
    return KERNEL_NAME


def to_notebook(spec: NotebookSpec, kernel: str) -> Any:
    """The jupytext notebook of ``spec`` with the kernelspec set (no outputs)."""
    import jupytext

    nb = jupytext.read(spec.path, fmt="py:percent")
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": "Python 3 (wavesurf)", "language": "python"}
    nb.metadata.pop("jupytext", None)
    return nb


def notebook_parameters(model: str, profile: str, dataset: str = "sharegpt", max_tokens: int | None = None,
                        seed: int = 0, device: str = "auto") -> dict[str, Any]:
    return {"model": model, "dataset": dataset, "max_tokens": max_tokens, "profile": profile, "seed": seed,
            "device": device}


def _say(line: str) -> None:
    """Print a progress line at once, also into a pipe (``reproduce ... | tee run.log``), where
    Python would otherwise hold it in a block buffer for many minutes."""
    print(line, flush=True)


@contextlib.contextmanager
def watch_progress(label: str, say: Callable[[str], None], after: str = "",
                   every_s: float = PROGRESS_EVERY_S, poll_s: float = 2.0) -> Iterator[Path]:
    """While the block runs, the kernel it starts reports its progress to a temporary file
    (:mod:`wavesurf.progress`, through the environment variable it names); a thread prints that
    state with ``say`` when it changed, at most every ``every_s`` seconds: the phase (step i of n,
    time left) and the current bar, then ``after`` (what the notebooks after this one take).
    Yields the file's path; the file and the variable are gone afterwards."""
    from ..progress import ENV, describe, read

    fd, name = tempfile.mkstemp(prefix="wavesurf-progress-", suffix=".json")
    os.close(fd)
    path = Path(name)
    path.unlink()
    old = os.environ.get(ENV)
    os.environ[ENV] = str(path)
    stop = threading.Event()

    def loop() -> None:
        last_line, last_time = "", 0.0
        while not stop.wait(poll_s):
            line = describe(read(path))
            if line and line != last_line and time.monotonic() - last_time >= every_s:
                say(f"      {label}: {line}" + (f" | after this notebook: {after}" if after else ""))
                last_line, last_time = line, time.monotonic()

    thread = threading.Thread(target=loop, name="wavesurf-progress", daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join(timeout=5)
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
        for leftover in [path, *path.parent.glob(path.name + ".*.tmp")]:
            leftover.unlink(missing_ok=True)


def execute_notebook(spec: NotebookSpec, out_path: Path, parameters: dict[str, Any], kernel: str,
                     progress: bool = True, timeout_s: int | None = None,
                     say: Callable[[str], None] | None = None, after: str = "") -> float:
    """Run one notebook with papermill into ``out_path`` (cwd = its folder); seconds taken.
    With ``progress`` and ``say``, the notebook's inner progress (phase, item i of n, time left)
    is printed while it runs (:func:`watch_progress`; ``after``: the estimate for the notebooks
    after it). A failure raises :class:`ReproduceError` naming the notebook, cell and error."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    watch = watch_progress(spec.stem, say, after) if progress and say is not None else contextlib.nullcontext()
    t0 = time.perf_counter()
    try:
        with watch:
            pm.execute_notebook(to_notebook(spec, kernel), str(out_path), parameters=parameters, kernel_name=kernel,
                                cwd=str(out_path.parent), progress_bar=progress, execution_timeout=timeout_s,
                                log_output=False)
    except PapermillExecutionError as exc:
        raise ReproduceError(f"notebook {spec.stem} failed in cell {exc.cell_index} (execution count "
                             f"{exc.exec_count}): {exc.ename}: {exc.evalue}") from None
    return time.perf_counter() - t0


def finish_page(path: Path, model: str | None) -> None:
    """Book touches on an executed notebook: the model in the page title (so per-model pages
    differ) and the papermill-injected parameters folded like the defaults."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if model and cell.cell_type == "markdown" and cell.source.startswith("# "):
            first, _, rest = cell.source.partition("\n")
            if f"({model})" not in first:
                cell.source = f"{first} ({model})\n{rest}"
            model = None
        tags = cell.metadata.get("tags", [])
        if "injected-parameters" in tags and "hide-input" not in tags:
            cell.metadata["tags"] = [*tags, "hide-input"]
    nbformat.write(nb, path)


# ---------------------------------------------------------------------------------------------
def _fmt_s(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _previous_times(final: Path, profile: str, field: str = "seconds") -> dict[str, float]:
    run = final / "run.json"
    if not run.exists():
        return {}
    try:
        info = json.loads(run.read_text())
    except ValueError:
        return {}
    if info.get("profile") != profile:
        return {}
    return {k: float(v.get(field, v["seconds"])) for k, v in info.get("notebooks", {}).items()}


def _stage(final: Path, stage: Path, rerun: Sequence[NotebookSpec], profile: str, say: Callable[[str], None]) -> dict:
    """Start the staging dir: a copy of the published dir minus what this run regenerates (only
    when it was made with the same profile); returns the carried-over run.json notebook entries."""
    if stage.exists():
        shutil.rmtree(stage)
    carried: dict[str, Any] = {}
    if final.exists():
        info = json.loads((final / "run.json").read_text()) if (final / "run.json").exists() else {}
        if info.get("profile") == profile:
            shutil.copytree(final, stage)
            prefixes = tuple(f"{s.number}_" for s in rerun)
            for p in list(stage.rglob("*")):
                if p.is_file() and p.name.startswith(prefixes) and (p.parent == stage or p.parent.parent == stage):
                    p.unlink()
            carried = {k: v for k, v in info.get("notebooks", {}).items() if not k.startswith(prefixes)}
        else:
            say(f"  (published pages in {final} were made with profile {info.get('profile')!r}; "
                f"they are replaced, not mixed with profile {profile!r})")
    stage.mkdir(parents=True, exist_ok=True)
    return carried


def _swap(stage: Path, final: Path, trash: Path) -> None:
    """Replace ``final`` by ``stage`` (two renames on one filesystem; the old tree is deleted after)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    old = trash / f"old-{final.name}-{os.getpid()}"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(stage, final)
    if old.exists():
        shutil.rmtree(old)


def hardware() -> dict[str, Any]:
    import torch

    from ..models import processor_name

    info = {"machine": platform.machine(), "processor": processor_name(),
            "cpu_count": os.cpu_count(), "torch_threads": int(os.environ.get("WAVESURF_THREADS", 0)) or os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    return info


def _runs_on_cpu(device: str) -> bool:
    """Whether the notebooks' model runs on the CPU (``device`` as the notebooks take it)."""
    from ..errors import DeviceError
    from ..models import pick_device

    try:
        return pick_device(device) == "cpu"
    except DeviceError:  # e.g. cuda asked for but absent: the notebook refuses it with its own message
        return False


#: reference minutes the notebooks finished in this run must add up to before their pace rescales
#: the reference times of the rest (a few seconds of short notebooks say little about a machine)
PACE_MIN_REFERENCE_MINUTES = 1.0


def estimate_remaining(remaining: Sequence[str], previous: dict[str, float], profile: str, model: str,
                       finished: dict[str, float] | None = None, on_cpu: bool = True) -> str:
    """Time left for the notebooks in ``remaining``: each from the previous run of this profile
    when there is one, else from the profile's ``reference_minutes`` (an empty-cache run of the
    default model on the 2-core reference machine), else unknown. Notebooks differ by orders of
    magnitude (the drafter ones train every head), so averaging the finished ones would mislead;
    but the notebooks ``finished`` in this run (seconds) that have reference times say how fast
    this machine is against the reference one, and once they add up to
    :data:`PACE_MIN_REFERENCE_MINUTES` their ratio scales the remaining reference times (measured:
    the main job's notebooks took 1.4-1.7x their reference times on a slower 2-core host).

    A profile without reference minutes of its own for ``model`` borrows the base profile's, scaled by the
    ratio of the budgets (:func:`wavesurf.book.profiles.scaled_reference_minutes`), but only ``on_cpu``:
    CPU throughputs say nothing about a GPU run, which then reads "unknown" until it has a
    previous run."""
    spec = get_profile(profile)
    refs = spec.reference_minutes
    scaled = model not in refs and on_cpu and spec.name != BASE_PROFILE
    if scaled:
        refs = scaled_reference_minutes(spec)
    ref = refs.get(model) or refs.get("smollm2-135m") or {}
    ref_label = "reference machine" + ("" if model in refs else ", default model")
    if scaled and ref:
        ref_label += f", {BASE_PROFILE} profile's times scaled by budgets"
    done = {stem: sec for stem, sec in (finished or {}).items() if stem in ref}
    done_ref = sum(ref[stem] for stem in done)
    pace = sum(done.values()) / (60.0 * done_ref) if done_ref >= PACE_MIN_REFERENCE_MINUTES else 1.0
    if pace != 1.0:
        ref_label += f" x {pace:.2f}, this run's pace"
    total, sources, unknown = 0.0, set(), []
    for stem in remaining:
        if stem in previous:
            total += previous[stem]
            sources.add("previous run")
        elif stem in ref:
            total += 60.0 * ref[stem] * pace
            sources.add(ref_label)
        else:
            unknown.append(stem)
    if unknown and len(unknown) == len(remaining):
        why = "no reference time" + ("" if on_cpu else " for a GPU run")
        return f"unknown (no previous run of this profile and {why})"
    text = f"~{_fmt_s(total)} ({', '.join(sorted(sources))})"
    return text + (f" + unknown for {', '.join(unknown)}" if unknown else "")


#: the notebooks that read the speed table (wavesurf.book.paper.profile_speed_table): whichever of
#: them runs first on a cache without the profile's heads generates the answers and trains the heads
SPEED_TABLE_NOTEBOOKS = ("04b_filtering_drafters", "04c_served_positions", "06_speed_table")


def drafter_work_note(stems: Sequence[str], previous: dict[str, float], profile: str, model: str,
                      on_cpu: bool = True) -> str | None:
    """A warning for a run (``--only``) that reads the speed table without its drafter notebook and
    has no earlier run of it for this profile: the first reader then trains every head itself,
    which its own time estimate (made on a warm cache) does not include. None when not needed."""
    readers = [s for s in stems if s in SPEED_TABLE_NOTEBOOKS]
    if not readers or any(s in DRAFTER_NOTEBOOKS for s in stems) or any(s in previous for s in DRAFTER_NOTEBOOKS):
        return None
    extra = estimate_remaining(list(DRAFTER_NOTEBOOKS), {}, profile, model, on_cpu=on_cpu)
    return (f"note: {readers[0]} reads the heads that {', '.join(DRAFTER_NOTEBOOKS)} trains, which has not run for "
            f"profile {profile} here; if they are not cached, {readers[0]} generates the target's answers and "
            f"trains them first: {extra} more than its estimate")


def reproduce(model: str, profile: str = "default", only: str | Sequence[str] | None = None, *,
              dataset: str = "sharegpt", max_tokens: int | None = None, seed: int = 0, device: str = "auto",
              root: Path | None = None, build: bool = True, progress: bool = True,
              say: Callable[[str], None] = _say) -> dict[str, Any]:
    """Run the notebooks for ``model`` with ``profile`` into the book and build it; a summary dict."""
    get_profile(profile)  # unknown profile -> clear error before anything runs
    from .notebook import check_parameters

    check_parameters(model, dataset, max_tokens, profile, seed, device)
    root = Path(root or repo_root())
    if not (root / "notebooks").is_dir() or not (root / "book" / "_config.yml").is_file():
        raise ReproduceError(f"{root} is not a wavesurf checkout: it needs notebooks/ and book/_config.yml "
                             "(pass the checkout's folder as root)")
    book = root / "book"
    specs = select_notebooks(discover_notebooks(root / "notebooks"), only)
    kernel = ensure_kernel()
    params = notebook_parameters(model, profile, dataset, max_tokens, seed, device)
    work = root / "runs" / "reproduce"
    dirs = {"model": book / "results" / results_dir_name(model), "all": book / ACROSS_DIR}
    stages = {scope: work / f"staging-{scope}-{results_dir_name(model)}" for scope in dirs}
    previous = {**_previous_times(dirs["model"], profile), **_previous_times(dirs["all"], profile)}
    first_times = {**_previous_times(dirs["model"], profile, "first_seconds"),
                   **_previous_times(dirs["all"], profile, "first_seconds")}
    scopes = sorted({s.scope for s in specs})
    say(f"wavesurf reproduce: {len(specs)} notebook(s) for {model}, profile {profile}: "
        + ", ".join(s.stem for s in specs))
    carried = {scope: _stage(dirs[scope], stages[scope], [s for s in specs if s.scope == scope], profile, say)
               for scope in scopes}
    on_cpu = _runs_on_cpu(device)
    note = drafter_work_note([s.stem for s in specs], previous, profile, model, on_cpu=on_cpu)
    if note:
        say(note)
    times: dict[str, float] = {}
    t_run = time.perf_counter()
    for n, spec in enumerate(specs, 1):
        elapsed = time.perf_counter() - t_run
        eta = estimate_remaining([s.stem for s in specs[n - 1:]], previous, profile, model, finished=times,
                                 on_cpu=on_cpu)
        say(f"[{n}/{len(specs)}] {spec.stem}  elapsed {_fmt_s(elapsed)}, remaining {eta}")
        out = stages[spec.scope] / f"{spec.stem}.ipynb"
        later = [s.stem for s in specs[n:]]
        after = estimate_remaining(later, previous, profile, model, finished=times, on_cpu=on_cpu) if later else ""
        try:
            times[spec.stem] = execute_notebook(spec, out, params, kernel, progress=progress, say=say, after=after)
        except (ReproduceError, KeyboardInterrupt) as exc:
            failed = work / "failed" / results_dir_name(model)
            failed.mkdir(parents=True, exist_ok=True)
            kept = failed / out.name
            if out.exists():
                shutil.copy2(out, kept)
            for stage in stages.values():
                shutil.rmtree(stage, ignore_errors=True)
            where = f"; the partial notebook is kept at {kept}" if kept.exists() else ""
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise ReproduceError(f"{exc}{where}. Nothing was published: the book keeps its previous pages.") from None
        finish_page(out, model if spec.scope == "model" else None)
        say(f"      done in {_fmt_s(times[spec.stem])}")
    hw = hardware()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    for scope in scopes:
        entries = dict(carried[scope])
        for s in specs:
            if s.scope == scope:  # keep the first (uncached) time of this profile beside this run's
                first = first_times.get(s.stem, times[s.stem])
                entries[s.stem] = {"seconds": round(times[s.stem], 1), "first_seconds": round(first, 1),
                                   "finished": stamp}
        info = {"model": model, "profile": profile, "parameters": params, "notebooks": entries, "hardware": hw,
                "finished": stamp}
        (stages[scope] / "run.json").write_text(json.dumps(info, indent=2))
        _swap(stages[scope], dirs[scope], work)
    write_generated(book, primary=results_dir_name(model))
    total = time.perf_counter() - t_run
    say(f"notebooks done in {_fmt_s(total)}; pages in {dirs['model']}")
    summary = {"model": model, "profile": profile, "notebooks": {k: round(v, 1) for k, v in times.items()},
               "notebook_seconds": round(total, 1), "results_dir": str(dirs["model"])}
    if build:
        t0 = time.perf_counter()
        html = build_book(book, say=say)
        summary.update({"book_seconds": round(time.perf_counter() - t0, 1), "book": str(html)})
        say(f"book built in {_fmt_s(summary['book_seconds'])}: {html}")
    return summary


# ---------------------------------------------------------------------------------------------
def build_book(book: Path, say: Callable[[str], None] = _say) -> Path:
    """``jupyter-book build book/ -W`` (warnings are errors; nothing is executed or fetched)."""
    exe = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "jupyter_book.cli.main"]
    cmd += ["build", str(book), "-W", "-n", "--quiet"]
    proc = subprocess.run(cmd, cwd=book.parent, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        causes = [ln for ln in lines if any(w in ln for w in ("WARNING", "ERROR", "Warning", "Error:"))][:20]  # -W: the first warning stops it
        tail = "\n".join(causes + ["..."] + lines[-12:] if causes else lines[-30:])
        raise ReproduceError(f"jupyter-book build failed (exit {proc.returncode}):\n{tail}")
    return book / "_build" / "html" / "index.html"


ANSWER_TEMPLATE = Path("templates") / "answer.md.tpl"


LIMITS_TEMPLATE = Path("templates") / "limitations.md.tpl"


def read_answer_template(book: Path, template: Path = ANSWER_TEMPLATE) -> dict[str, Any]:
    """The introduction's prose, kept in the book (``book/templates/answer.md.tpl``; a book
    without one uses wavesurf's own): one ``(notebook stem, text)`` line per notebook and the key
    figure's caption. ``template=LIMITS_TEMPLATE`` reads the discussion's limitations the same way."""
    path = book / template
    if not path.is_file():
        path = repo_root() / "book" / template
    if not path.is_file():
        raise ReproduceError(f"{book / template} is missing: the introduction's prose lives there")
    lines, figure = [], ""
    for raw in path.read_text().splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        head, sep, text = raw.partition(": ")
        if not sep:
            raise ReproduceError(f"{path}: line {raw[:60]!r} is not '<notebook stem>: <text>' or 'figure: <caption>'")
        if head == "figure":
            figure = text
        else:
            lines.append((head, text))
    return {"lines": lines, "figure": figure}


def _fill(text: str, model: str, stem: str) -> str:
    """Replace ``[[key]]`` / ``[[key:fmt]]`` with a MyST glue reference into ``model``'s page ``stem``."""
    def ref(match: re.Match) -> str:
        key, _, fmt = match.group(1).partition(":")
        return f"{{glue:text}}`results/{model}/{stem}.ipynb::{key}:{fmt or 's'}`"

    return re.sub(r"\[\[([^\]]+)\]\]", ref, text)


def write_generated(book: Path, primary: str | None = None) -> None:
    """``book/generated/answer.md`` (the introduction's numbers, glued from each model's pages)
    and ``timings.md`` (time per notebook, from each run.json)."""
    gen = book / "generated"
    gen.mkdir(parents=True, exist_ok=True)
    results = book / "results"
    models = sorted(p.name for p in results.iterdir() if (p / "run.json").exists()) if results.exists() else []
    if primary in models:
        models.remove(primary)
        models.insert(0, primary)
    template = read_answer_template(book) if models else {"lines": [], "figure": ""}
    parts = []
    figure_done = False
    for m in models:
        d = results / m
        have = {p.stem for p in d.glob("*.ipynb")}
        info = json.loads((d / "run.json").read_text())

        lines = [f"### {info['model']} (profile `{info['profile']}`)", ""]
        lines += [_fill(text, m, stem) for stem, text in template["lines"] if stem in have]
        fig = d / "figures" / "01_entropy_depth.png"
        if not figure_done and fig.exists():
            lines += ["", f"```{{figure}} results/{m}/figures/01_entropy_depth.png", ":name: fig-key-entropy",
                      ":width: 100%", "", template["figure"].replace("{model}", info["model"]), "```"]
            figure_done = True
        parts.append("\n".join(lines))
    if not parts:
        parts = ["No results yet: run `wavesurf reproduce --model smollm2-135m --profile default`."]
    (gen / "answer.md").write_text("\n\n".join(parts) + "\n")
    limits = read_answer_template(book, LIMITS_TEMPLATE)["lines"] if models else []
    parts = []
    for m in models:
        have = {p.stem for p in (results / m).glob("*.ipynb")}
        lines = [_fill(text, m, stem) for stem, text in limits if stem in have]
        if lines:
            info = json.loads((results / m / "run.json").read_text())
            parts.append("\n".join([f"**{info['model']}** (profile `{info['profile']}`)", ""] + lines))
    (gen / "limitations.md").write_text("\n\n".join(parts or ["No drafter results yet."]) + "\n")
    (gen / "profiles.md").write_text(profile_table())
    (gen / "benchmarks.md").write_text(render_benchmarks(book))

    rows = ["| model | profile | notebook | seconds, this run | seconds, first run of the profile | finished |",
            "|---|---|---|---:|---:|---|"]
    hw_lines = []
    for d in [results / m for m in models] + [book / ACROSS_DIR]:
        if not (d / "run.json").exists():
            continue
        info = json.loads((d / "run.json").read_text())
        where = "all models" if d.name == ACROSS_DIR else info["model"]
        for stem, v in info["notebooks"].items():
            rows.append(f"| {where} | {info['profile']} | {stem} | {v['seconds']:.1f} | "
                        f"{v.get('first_seconds', v['seconds']):.1f} | {v['finished']} |")
        hw = info.get("hardware", {})
        hw_lines.append(f"- {where}: {hw.get('processor')} with {hw.get('cpu_count')} CPU cores, "
                        f"{hw.get('torch_threads')} torch threads, GPU {hw.get('gpu') or 'none'}, "
                        f"Python {hw.get('python')}, torch {hw.get('torch')}")
    text = "\n".join(rows) + "\n\nMachines:\n\n" + ("\n".join(hw_lines) or "- (no run yet)") + "\n"
    (gen / "timings.md").write_text(text)


def _seed_counts(st) -> str:
    """Seeds per layer set in words: ``2``, or ``2 (3 default/primary, 1 random)``."""
    lead, null = len(st.primary_seeds or st.seeds), len(st.null_seeds or st.seeds)
    extra = [f"{lead} default/primary"] if lead != len(st.seeds) else []
    extra += [f"{null} random"] if null != len(st.seeds) else []
    return f"{len(st.seeds)}" + (f" ({', '.join(extra)})" if extra else "")


def profile_table() -> str:
    """The profiles as the book states them (``book/generated/profiles.md``): what each is for and
    its analysis budget, then the speed table's drafter budgets, all read from
    :mod:`wavesurf.book.profiles`, so the book cannot disagree with the code."""
    from .profiles import profile_names
    from .speed_table import SpeedTableSettings

    rows = ["| profile | purpose | analysis tokens |", "|---|---|---:|"]
    budgets = ["| profile | target answers (train / held-out tokens) | training tokens per head | head arithmetic | "
               "unrolled steps | draft vocabulary | seeds | timed prompts × new tokens |", "|---|---|---:|---|---:|---:|---:|---|"]
    for name in profile_names():
        prof = get_profile(name)
        rows.append(f"| `{name}` | {prof.description} | {prof.analysis.max_tokens:,} |")
        st = SpeedTableSettings.from_profile(prof.drafter)
        train, bench = st.train, st.bench
        mode = ", dynamic tree" if bench.mode == "tree" else ""
        budgets.append(f"| `{name}` | {st.distill.train_tokens:,} / {st.distill.heldout_tokens:,} | "
                       f"{train.train_tokens:,} | {train.precision} | {train.ttt_steps} | "
                       f"{train.draft_vocab_size:,} | {_seed_counts(st)} | {bench.n_prompts} × {bench.max_new_tokens} "
                       f"({', '.join(st.datasets)}{mode}) |")
    return "\n".join(rows) + "\n\nDrafter budgets (the speed table):\n\n" + "\n".join(budgets) + "\n"


def render_benchmarks(book: Path) -> str:
    """The benchmarks page (``book/generated/benchmarks.md``): every JSON result under the checkout's
    ``benchmarks/results/``, rendered by ``benchmarks/render.py`` run as a script file, so the
    package never imports the benchmarks; a checkout without them gets a one-line page."""
    import runpy

    script = book.parent / "benchmarks" / "render.py"
    if not script.is_file():
        return "This checkout has no `benchmarks/render.py`, so no benchmark results are shown.\n"
    return runpy.run_path(str(script))["render_page"](book.parent / "benchmarks" / "results")
