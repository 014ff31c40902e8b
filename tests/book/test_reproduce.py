"""Profiles, notebook parameters and the reproduce pipeline (papermill into a staging dir, atomic
swap, failures kept outside the book). The analysis variants are tested in tests/book/test_variants.py,
the notebooks' shared tables in tests/book/test_paper.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from wavesurf.book.notebook import check_parameters
from wavesurf.book.profiles import PROFILES, ProfileError, get_profile, profile_names
from wavesurf.book import variants as stats_variants
from wavesurf.book.reproduce import (
    ReproduceError,
    discover_notebooks,
    reproduce,
    select_notebooks,
    write_generated,
)



# ---------------------------------------------------------------------------------------------
def test_profiles_and_unknown_profile():
    from wavesurf.book.speed_table import SpeedTableSettings

    assert profile_names() == ["smoke", "default", "long", "paper"]
    for name in profile_names():
        p = get_profile(name)
        assert p.name == name and p.analysis.max_tokens > 0 and p.analysis.sweep_filters
        SpeedTableSettings.from_profile(p.drafter)  # every drafter entry is a valid speed-table setting
    assert get_profile("long").analysis == get_profile("default").analysis  # same statistics and sets
    get_profile("smoke").drafter["train"]["train_tokens"] = -1  # a copy: the table is untouched
    assert PROFILES["smoke"]["drafter"]["train"]["train_tokens"] > 0
    with pytest.raises(Exception, match="frozen|cannot assign"):
        get_profile("smoke").analysis.max_tokens = 5  # type: ignore[misc]
    with pytest.raises(ProfileError, match="unknown profile 'fast'.*smoke, default, long, paper"):
        get_profile("fast")


def test_a_malformed_profile_entry_is_refused_by_name(monkeypatch):
    analysis = dict(PROFILES["smoke"]["analysis"])
    monkeypatch.setitem(PROFILES, "odd", {"analysis": analysis, "drafters": {}})
    with pytest.raises(ProfileError, match=r"profile 'odd': keys \['drafters'\]"):
        get_profile("odd")
    monkeypatch.setitem(PROFILES, "odd", {"analysis": {k: v for k, v in analysis.items() if k != "max_len"}})
    with pytest.raises(ProfileError, match=r"analysis keys missing \['max_len'\]"):
        get_profile("odd")


@pytest.mark.parametrize("name,value,bad", [
    ("model", "", "model=''"), ("model", 3, "model=3"),
    ("dataset", "wikipedia", "dataset='wikipedia'"),
    ("max_tokens", "lots", "max_tokens='lots'"), ("max_tokens", 0, "max_tokens=0"), ("max_tokens", True, "max_tokens=True"),
    ("profile", "fast", "unknown profile 'fast'"),
    ("seed", -1, "seed=-1"), ("seed", 1.5, "seed=1.5"),
    ("device", "gpu", "device='gpu'"),
])
def test_check_parameters_rejects_bad_values(name, value, bad):
    args = {"model": "smollm2-135m", "dataset": "sharegpt", "max_tokens": None, "profile": "smoke", "seed": 0,
            "device": "auto", name: value}
    with pytest.raises(ValueError, match=bad.replace("(", r"\(").replace(")", r"\)")):
        check_parameters(**args)


def test_check_parameters_accepts_good_values():
    p = check_parameters("gemma3-270m", "mt-bench", 5000, "paper", 3, "cuda:1")
    assert (p.model, p.max_tokens, p.profile, p.device) == ("gemma3-270m", 5000, "paper", "cuda:1")
    variants = stats_variants.analysis_variants(p)
    assert {"base", "position0", "selection"} <= set(variants)
    assert all(v.max_tokens == 5000 and v.split is None for v in variants.values())  # mt-bench is used whole
    assert variants["position0"].include_position0 and not variants["base"].include_position0
    assert [n for n in variants if n.startswith("sweep:")] == [f"sweep:{f}" for f in get_profile("paper").analysis.sweep_filters]


# ---------------------------------------------------------------------------------------------
def test_notebook_selection_by_number_or_name():
    specs = discover_notebooks()
    assert [s.number for s in specs][:8] == ["01", "02", "03", "04", "04b", "04c", "05", "06"]
    assert [s.stem for s in select_notebooks(specs, "03,01")] == ["01_entropy_compartments", "03_aggregate_entropy"]
    assert [s.number for s in select_notebooks(specs, ["02_cka_dynamics"])] == ["02"]
    assert [s.number for s in select_notebooks(specs, "04b,06")] == ["04b", "06"]
    assert select_notebooks(specs, None) == specs
    with pytest.raises(ReproduceError, match="unknown notebook.*'09'.*available: 01_entropy_compartments"):
        select_notebooks(specs, "01,09")


NB_OK = '''# %% [markdown]
# # A page

# %% tags=["parameters"]
model = "x"
dataset = "sharegpt"
max_tokens = None
profile = "default"
seed = 0
device = "auto"

# %%
from pathlib import Path
Path("figures").mkdir(exist_ok=True)
Path("figures/01_plot.png").write_bytes(b"new " + profile.encode())
print(model, profile)
'''
NB_FAIL = '''# %% [markdown]
# # Broken

# %% tags=["parameters"]
model = "x"
profile = "default"

# %%
x = 1

# %%
raise RuntimeError("boom in the third cell")
'''


def _project(tmp_path: Path, notebooks: dict[str, str]) -> Path:
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "_config.yml").write_text("title: test book\n")
    for name, text in notebooks.items():
        (tmp_path / "notebooks" / name).write_text(text)
    return tmp_path


def test_reproduce_publishes_atomically_and_keeps_failures_outside(tmp_path):
    root = _project(tmp_path, {"01_ok.py": NB_OK})
    lines: list[str] = []
    out = reproduce("smollm2-135m", "smoke", root=root, build=False, progress=False, say=lines.append)
    page = root / "book" / "results" / "smollm2-135m"
    assert (page / "01_ok.ipynb").exists() and (page / "figures" / "01_plot.png").read_bytes() == b"new smoke"
    nb = json.loads((page / "01_ok.ipynb").read_text())
    assert "".join(nb["cells"][0]["source"]).startswith("# A page (smollm2-135m)")  # per-model page title
    assert any("smollm2-135m smoke" in "".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    run = json.loads((page / "run.json").read_text())
    assert run["profile"] == "smoke" and "01_ok" in run["notebooks"] and out["notebooks"]["01_ok"] > 0
    assert any(line.startswith("[1/1] 01_ok") and "remaining" in line for line in lines)
    assert "01_ok" in (root / "book" / "generated" / "timings.md").read_text()

    # a failing notebook: the run stops naming notebook and cell; published pages stay as they were
    (root / "notebooks" / "02_broken.py").write_text(NB_FAIL)
    before = sorted(p.relative_to(page) for p in page.rglob("*"))
    with pytest.raises(ReproduceError, match=r"02_broken failed in cell \d+.*RuntimeError: boom.*kept at"):
        reproduce("smollm2-135m", "smoke", root=root, build=False, progress=False, say=lines.append)
    assert sorted(p.relative_to(page) for p in page.rglob("*")) == before
    kept = root / "runs" / "reproduce" / "failed" / "smollm2-135m" / "02_broken.ipynb"
    assert kept.exists() and "boom" in kept.read_text()
    assert not list((root / "runs" / "reproduce").glob("staging-*"))

    # another model adds pages without touching the first one's
    reproduce("gemma3-270m", "smoke", only="01", root=root, build=False, progress=False, say=lines.append)
    assert (root / "book" / "results" / "gemma3-270m" / "01_ok.ipynb").exists() and (page / "01_ok.ipynb").exists()
    answer = (root / "book" / "generated" / "answer.md").read_text()
    assert "gemma3-270m" in answer and "smollm2-135m" in answer


def test_reproduce_rejects_bad_input_before_running(tmp_path):
    root = _project(tmp_path, {"01_ok.py": NB_OK})
    with pytest.raises(ProfileError, match="unknown profile 'turbo'"):
        reproduce("smollm2-135m", "turbo", root=root, build=False)
    with pytest.raises(ReproduceError, match="unknown notebook"):
        reproduce("smollm2-135m", "smoke", only="7", root=root, build=False)
    assert not (root / "book" / "results").exists()
    # a folder that is not a checkout (here: no book/_config.yml) is named before anything runs
    (root / "book" / "_config.yml").unlink()
    with pytest.raises(ReproduceError, match=f"{root} is not a wavesurf checkout: it needs notebooks/ and book/_config.yml"):
        reproduce("smollm2-135m", "smoke", root=root, build=False)
    assert not (root / "book" / "results").exists() and not (root / "runs").exists()


def test_cli_reproduce_root_option(tmp_path, capsys):
    from wavesurf.cli import main

    assert main(["reproduce", "--root", str(tmp_path), "--no-build", "--quiet"]) == 2
    assert f"{tmp_path} is not a wavesurf checkout" in capsys.readouterr().err


def test_generated_pages_without_results(tmp_path):
    write_generated(tmp_path)
    assert "No results yet" in (tmp_path / "generated" / "answer.md").read_text()
    assert "no run yet" in (tmp_path / "generated" / "timings.md").read_text()
    assert "No drafter results yet" in (tmp_path / "generated" / "limitations.md").read_text()
    # a book outside a checkout with benchmarks gets a one-line benchmarks page
    assert "no `benchmarks/render.py`" in (tmp_path / "generated" / "benchmarks.md").read_text()


def test_benchmarks_page_renders_every_result_newest_first(tmp_path):
    """The book's benchmarks page comes from benchmarks/render.py over the checkout's JSON results:
    one section per benchmark, newest run first, with host, threads, load, commit and quiet."""
    import json
    import shutil

    from wavesurf.book.reproduce import render_benchmarks

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(root / "benchmarks" / "render.py", tmp_path / "benchmarks")
    meta = {"host": "cpu X", "machine": "x86_64", "cpus": 2, "threads": 2, "commit": "abc1234", "dirty": False}
    for name, date, load in (("b_sweep", "2026-01-01T00:00:00+00:00", 1.0), ("b_sweep", "2026-02-01T00:00:00+00:00", 4.0),
                             ("a_clone", "2026-01-05T00:00:00+00:00", 0.1)):
        (tmp_path / "benchmarks" / "results" / f"{name}-{date[:10]}.json").write_text(json.dumps(
            {"benchmark": name, "date": date, "load_average": load, **meta, "rows": [{"setting": "x", "tau": 1.25}],
             "note": "n", "phases": [{"phase": "main", "seconds": 9.5,
                                      "inner": [{"notebook": "04b", "phase": "timed runs", "first_s": 3.0}]}]}))
    page = render_benchmarks(tmp_path / "book")
    # a row's own rows (fresh_clone's inner phases) get their own table after the row's
    assert "| phase | seconds |\n|---|---|\n| main | 9.5 |" in page
    assert "phases main, inner:\n\n| notebook | phase | first_s |\n|---|---|---|\n| 04b | timed runs | 3 |" in page
    assert page.index("## `a_clone`") < page.index("## `b_sweep`")
    assert page.index("### 2026-02-01") < page.index("### 2026-01-01")
    assert "quiet: no (from load)" in page and "quiet: yes (from load)" in page and "commit `abc1234`" in page
    assert "| setting | tau |" in page and "| x | 1.25 |" in page


def test_only_reruns_some_pages_and_leaves_no_stale_figure(tmp_path):
    nb2 = NB_OK.replace("# A page", "# Second page").replace("01_plot", "02_plot")
    root = _project(tmp_path, {"01_ok.py": NB_OK, "02_two.py": nb2})
    quiet = dict(root=root, build=False, progress=False, say=lambda line: None)
    reproduce("smollm2-135m", "smoke", **quiet)
    page = root / "book" / "results" / "smollm2-135m"
    assert {p.name for p in (page / "figures").iterdir()} == {"01_plot.png", "02_plot.png"}
    # notebook 01 now writes a differently named figure: the old one must not survive next to it
    (root / "notebooks" / "01_ok.py").write_text(NB_OK.replace("01_plot", "01_renamed"))
    reproduce("smollm2-135m", "smoke", only="01", **quiet)
    assert {p.name for p in (page / "figures").iterdir()} == {"01_renamed.png", "02_plot.png"}
    assert set(json.loads((page / "run.json").read_text())["notebooks"]) == {"01_ok", "02_two"}
    # another profile never mixes with the published one: pages it did not run are dropped
    reproduce("smollm2-135m", "default", only="02", **quiet)
    assert {p.name for p in (page / "figures").iterdir()} == {"02_plot.png"}
    assert json.loads((page / "run.json").read_text())["profile"] == "default"


def test_cli_reproduce_errors(capsys):
    from wavesurf.cli import main

    assert main(["reproduce", "--profile", "turbo", "--no-build"]) == 2
    assert "wavesurf reproduce: error: unknown profile 'turbo'; available: smoke, default, long, paper" in capsys.readouterr().err
    assert main(["reproduce", "--only", "01,99", "--no-build"]) == 2
    err = capsys.readouterr().err
    assert "unknown notebook(s) ['99']" in err and "05_layer_selection" in err


def test_estimate_remaining_prefers_previous_run_then_reference(monkeypatch):
    """The ETA sums per-notebook times (previous run, else the profile's reference minutes) rather
    than averaging finished notebooks, which misled when one notebook trains every drafter."""
    from wavesurf.book import profiles
    from wavesurf.book.reproduce import estimate_remaining

    monkeypatch.setitem(profiles.PROFILES["default"], "reference_minutes",
                        {"smollm2-135m": {"01_a": 10.0, "06_b": 30.0}})
    assert estimate_remaining(["01_a", "06_b"], {}, "default", "smollm2-135m") == "~40m00s (reference machine)"
    got = estimate_remaining(["01_a", "06_b"], {"01_a": 60.0}, "default", "smollm2-135m")
    assert got == "~31m00s (previous run, reference machine)"
    assert "default model" in estimate_remaining(["06_b"], {}, "default", "gemma3-270m")
    assert estimate_remaining(["06_b", "07_c"], {}, "default", "smollm2-135m").endswith("+ unknown for 07_c")
    assert estimate_remaining(["07_c"], {}, "default", "smollm2-135m").startswith("unknown")
    # a notebook that took 1.5x its reference time rescales the reference times of the rest
    assert estimate_remaining(["06_b"], {}, "default", "smollm2-135m", finished={"01_a": 900.0}) == \
        "~45m00s (reference machine x 1.50, this run's pace)"
    # ... but not from a notebook without a reference time, nor from less than a reference minute
    assert estimate_remaining(["06_b"], {}, "default", "smollm2-135m", finished={"07_c": 900.0}) == \
        "~30m00s (reference machine)"
    monkeypatch.setitem(profiles.PROFILES["default"], "reference_minutes",
                        {"smollm2-135m": {"01_a": 0.1, "06_b": 30.0}})
    assert estimate_remaining(["06_b"], {}, "default", "smollm2-135m", finished={"01_a": 60.0}) == \
        "~30m00s (reference machine)"


def test_answer_template_lines_become_glue_references_and_bad_lines_are_refused(tmp_path):
    from wavesurf.errors import ReproduceError
    from wavesurf.book.reproduce import ANSWER_TEMPLATE, read_answer_template, repo_root

    shipped = read_answer_template(repo_root() / "book")
    assert [stem for stem, _ in shipped["lines"]][:2] == ["01_entropy_compartments", "03_aggregate_entropy"]
    assert "{model}" in shipped["figure"]
    (tmp_path / ANSWER_TEMPLATE).parent.mkdir(parents=True)
    (tmp_path / ANSWER_TEMPLATE).write_text("# comment\n05_layer_selection: picks [[ids]] ([[gain:+.3f]])\n")
    from wavesurf.book.reproduce import _fill
    text = _fill(read_answer_template(tmp_path)["lines"][0][1], "m", "05_layer_selection")
    assert text == ("picks {glue:text}`results/m/05_layer_selection.ipynb::ids:s` "
                    "({glue:text}`results/m/05_layer_selection.ipynb::gain:+.3f`)")
    (tmp_path / ANSWER_TEMPLATE).write_text("no separator here\n")
    with pytest.raises(ReproduceError, match="is not '<notebook stem>: <text>'"):
        read_answer_template(tmp_path)
    (tmp_path / ANSWER_TEMPLATE).unlink()
    assert read_answer_template(tmp_path) == shipped  # a book without its own template uses wavesurf's


def test_estimate_for_a_profile_without_reference_times_scales_the_default_by_budgets(monkeypatch):
    """A profile that was never timed on the reference machine (long, paper) gets the default
    profile's minutes scaled by the ratio of its budgets, on a CPU; on a GPU it says unknown."""
    from wavesurf.book import profiles
    from wavesurf.book.reproduce import estimate_remaining

    monkeypatch.setitem(profiles.PROFILES["default"], "reference_minutes",
                        {"smollm2-135m": {"01_a": 10.0, "04b_filtering_drafters": 30.0}})
    # the long profile without reference minutes of its own (as it is until its run is measured)
    monkeypatch.setitem(profiles.PROFILES, "long", {k: v for k, v in profiles.PROFILES["long"].items()
                                                    if k != "reference_minutes"})
    long = profiles.get_profile("long")
    assert not long.reference_minutes
    ratio = profiles.drafter_work_seconds(long.drafter) / profiles.drafter_work_seconds(
        profiles.get_profile("default").drafter)
    assert 1.5 < ratio < 6  # 4x the training tokens per head, ~1.6x the answers, two seeds as in default
    scaled = profiles.scaled_reference_minutes(long)["smollm2-135m"]
    assert scaled["01_a"] == 10.0  # the same analysis budget
    assert abs(scaled["04b_filtering_drafters"] - 30.0 * ratio) < 1e-9
    got = estimate_remaining(["01_a", "04b_filtering_drafters"], {}, "long", "smollm2-135m")
    total = 60 * (10.0 + 30.0 * ratio)
    assert got.startswith(f"~{int(round(total)) // 60}m") and "scaled by budgets" in got
    assert estimate_remaining(["01_a"], {}, "long", "smollm2-135m", on_cpu=False).startswith(
        "unknown (no previous run of this profile and no reference time for a GPU run)")
    # more work means a longer estimate: doubling the training tokens raises the drafter part
    more = dict(long.drafter, train=dict(long.drafter["train"], train_tokens=2 * long.drafter["train"]["train_tokens"]))
    assert profiles.drafter_work_seconds(more) > profiles.drafter_work_seconds(long.drafter) * 1.3
    # heads trained in bfloat16 train faster than in float32 (profiles.TRAIN_PRECISION_SPEEDUP)
    f32 = dict(long.drafter, train=dict(long.drafter["train"], precision="float32"))
    assert profiles.drafter_work_seconds(f32) > profiles.drafter_work_seconds(long.drafter) * 1.1
    # a profile with its own reference minutes keeps them
    assert profiles.scaled_reference_minutes(profiles.get_profile("default")) == \
        {"smollm2-135m": {"01_a": 10.0, "04b_filtering_drafters": 30.0}}


def test_book_table_of_drafter_budgets_matches_the_profiles(tmp_path):
    """book/reproducibility.md includes each profile's drafter budgets, generated from the profiles
    when the book is built (book/generated/profiles.md); the table must state the profiles' values."""
    from wavesurf.book.reproduce import profile_table
    from wavesurf.book.speed_table import SpeedTableSettings

    assert "generated/profiles.md" in (Path(__file__).resolve().parents[2] / "book" / "reproducibility.md").read_text()
    write_generated(tmp_path)
    text = (tmp_path / "generated" / "profiles.md").read_text()
    assert text == profile_table()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].startswith("`") and cells[0].strip("`") in PROFILES:
            rows[cells[0].strip("`")] = cells
    assert set(rows) == set(PROFILES)

    def num(cell: str) -> int:
        return int(cell.split()[0].replace(",", ""))

    for name, cells in rows.items():
        st = SpeedTableSettings.from_profile(get_profile(name).drafter)
        train_answers, heldout_answers = (num(x) for x in cells[1].split("/"))
        assert (train_answers, heldout_answers) == (st.distill.train_tokens, st.distill.heldout_tokens), name
        assert num(cells[2]) == st.train.train_tokens, name
        assert cells[3] == st.train.precision, name
        assert (num(cells[4]), num(cells[5]), num(cells[6])) == (
            st.train.ttt_steps, st.train.draft_vocab_size, len(st.seeds)), name
        prompts, new_tokens = (num(x) for x in cells[7].split("×"))
        assert (prompts, new_tokens) == (st.bench.n_prompts, st.bench.max_new_tokens), name


def test_a_run_of_the_speed_table_without_its_drafter_notebook_is_warned_once(monkeypatch):
    """`--only 06` on a book where 04b never ran for the profile: 06 would train every head itself,
    so the run says so with 04b's estimate; not when 04b runs too or ran before."""
    from wavesurf.book import profiles
    from wavesurf.book.reproduce import drafter_work_note

    monkeypatch.setitem(profiles.PROFILES["default"], "reference_minutes",
                        {"smollm2-135m": {"04b_filtering_drafters": 30.0, "06_speed_table": 2.0}})
    note = drafter_work_note(["05_layer_selection", "06_speed_table"], {}, "default", "smollm2-135m")
    assert note is not None and note.startswith("note: 06_speed_table reads the heads")
    assert "~30m" in note and "profile default" in note
    assert drafter_work_note(["04b_filtering_drafters", "06_speed_table"], {}, "default", "smollm2-135m") is None
    assert drafter_work_note(["06_speed_table"], {"04b_filtering_drafters": 1800.0}, "default", "smollm2-135m") is None
    assert drafter_work_note(["01_entropy_compartments"], {}, "default", "smollm2-135m") is None


def test_reference_minutes_are_the_profiles_own_per_model_else_the_default_scaled(monkeypatch):
    from wavesurf.book import profiles

    monkeypatch.setitem(profiles.PROFILES["default"], "reference_minutes",
                        {"smollm2-135m": {"04b_filtering_drafters": 30.0}, "gemma3-270m": {"04b_filtering_drafters": 40.0}})
    monkeypatch.setitem(profiles.PROFILES["long"], "reference_minutes", {"smollm2-135m": {"04b_filtering_drafters": 90.0}})
    long = profiles.get_profile("long")
    ratio = profiles.drafter_work_seconds(long.drafter) / profiles.drafter_work_seconds(
        profiles.get_profile("default").drafter)
    got = profiles.scaled_reference_minutes(long)
    assert got["smollm2-135m"] == {"04b_filtering_drafters": 90.0}  # measured with this profile: kept
    assert abs(got["gemma3-270m"]["04b_filtering_drafters"] - 40.0 * ratio) < 1e-9  # never measured: scaled
