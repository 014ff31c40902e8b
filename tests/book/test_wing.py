"""The two parts of the package stay apart: the library never imports the book wing
(``wavesurf/book``), and inside the library no import runs back up the data flow
(``ARCHITECTURE.md``). Every import is read from the source, function-level ones included."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "wavesurf"

#: modules above the numerical core and the drafter: nothing in ``stats`` or ``drafter`` imports them
UPPER = ("wavesurf.select", "wavesurf.criteria", "wavesurf.bench", "wavesurf.distill", "wavesurf.cli",
         "wavesurf.book")
#: infrastructure every part uses: it imports no science module
INFRASTRUCTURE = ("errors", "cache", "_version", "_lazy", "tdist", "progress", "settings_cli", "packed",
                  "distributed", "taps", "consumers")
SCIENCE = ("wavesurf.stats", "wavesurf.drafter", "wavesurf.select", "wavesurf.criteria", "wavesurf.bench",
           "wavesurf.distill", "wavesurf.capture", "wavesurf.book")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (``from . import x`` gives ``pkg.x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # `from . import plots` names a module
    return {m for m in found if m.startswith("wavesurf")}


def under(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def library_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "book" not in p.relative_to(PACKAGE).parts[:1]]


def test_the_resolver_reads_relative_and_function_level_imports(tmp_path):
    assert {"wavesurf.drafter.head", "wavesurf.progress", "wavesurf.progress.progress_bar"} <= \
        imports(PACKAGE / "drafter" / "acceptance.py")
    assert "wavesurf.book.plots" in imports(PACKAGE / "book" / "notebook.py")  # `from . import plots`


def test_the_library_never_imports_the_book_wing():
    offenders = {module_name(p): sorted(m for m in imports(p) if under(m, ("wavesurf.book",)))
                 for p in library_modules() if p.name != "cli.py"}
    assert not {k: v for k, v in offenders.items() if v}, "the library imports the book wing"
    assert len(library_modules()) > 40  # the walk found the library


def test_no_import_runs_back_up():
    back = {}
    for p in library_modules():
        name = module_name(p)
        if under(name, ("wavesurf.stats", "wavesurf.drafter")):
            bad = sorted(m for m in imports(p) if under(m, UPPER))
        elif name.rsplit(".", 1)[-1] in INFRASTRUCTURE and name.count(".") == 1:
            bad = sorted(m for m in imports(p) if under(m, SCIENCE))
        else:
            continue
        if bad:
            back[name] = bad
    assert not back, f"imports that run back up the data flow: {back}"


def test_a_long_module_says_why_at_its_top():
    """No module over ~450 lines (470 with slack) without a reason written in its docstring."""
    long = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        n = len(p.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        if n > 470 and "Over ~450 lines because" not in doc:
            long[module_name(p)] = n
    assert not long, f"modules over ~450 lines without a reason at their top: {long}"
