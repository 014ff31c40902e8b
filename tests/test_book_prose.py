"""Every number in the book's prose comes from a run: a chapter (``book/*.md``) or a template of the
generated pages (``book/templates/*.tpl``) may not type a digit-bearing number by hand. Numbers
are glued (MyST-NB ``{glue:...}`` roles in the notebooks, ``[[key]]`` fields in the templates) or
rendered from result files into ``book/generated/`` (timings, profiles, benchmarks), which this test
does not read.

Not prose, so not checked: fenced code blocks (commands), inline code (identifiers, options, layer
ids such as ``[2, N//2, N-3]``), math (equations and their labels), MyST roles (citations with their
years, cross-references, glue), link targets, labels and HTML comments. A digit inside a name
(EAGLE-3, SmolLM2-135M, Gemma-3-270M, S₁) is part of the name. What remains is checked against
:data:`ALLOWED`, a short list of constants that are definitions, not measurements."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parents[1] / "book"
CHAPTERS = sorted(BOOK.glob("*.md")) + sorted((BOOK / "templates").glob("*.tpl"))

#: constants that may be typed: each is a definition or a requirement, never a measurement
ALLOWED = (
    "Python 3.11+",  # the supported Python, as in setup.sh and pyproject.toml
    "α = 1",  # the orders of the Rényi entropy, named in headings and captions
    "α = 2",
    "id 0",  # the vLLM layer-id convention: id 0 is the embedding output
)

_FENCE = re.compile(r"^(`{3,}|~{3,})(.*?)$(.*?)^\1\s*$", re.M | re.S)
_STRIP = [
    re.compile(r"<!--.*?-->", re.S),  # HTML comments
    re.compile(r"\$\$.*?\$\$(\s*\([\w-]+\))?", re.S),  # display math and its equation label
    re.compile(r"\$[^$\n]+\$"),  # inline math
    re.compile(r"\{[\w:-]+\}`[^`]*`"),  # MyST roles: {cite:p}`...`, {glue:text}`...`, {ref}`...`
    re.compile(r"`[^`\n]+`"),  # inline code
    re.compile(r"\]\([^)\s]+\)"),  # link targets
    re.compile(r"^\([\w-]+\)=\s*$", re.M),  # MyST labels
    re.compile(r"\[\[[^\]]+\]\]"),  # template fields (glued)
]
#: a number: digits not glued to a preceding name (letters, digits, or a hyphen after a name)
_NUMBER = re.compile(r"(?<![\w.])(?<!\w-)\d[\d,.]*")


def prose(text: str, template: bool = False) -> str:
    """``text`` with everything that is not prose removed (see the module docstring)."""
    def fence(match: re.Match) -> str:
        info = match.group(2).strip()
        return match.group(3) if info.startswith("{") and not info.startswith("{code") else ""

    if template:  # comment lines, and the "<notebook stem>: " or "figure: " head of each line
        text = "\n".join(line.partition(": ")[2] for line in text.splitlines() if not line.startswith("#"))
    text = _FENCE.sub(fence, text)
    for pattern in _STRIP:
        text = pattern.sub(" ", text)
    for constant in ALLOWED:
        text = text.replace(constant, " ")
    return text


def typed_numbers(text: str, template: bool = False) -> list[str]:
    """The hand-typed numbers of a chapter, each with a little context."""
    body = prose(text, template)
    return [body[max(0, m.start() - 30):m.end() + 10].replace("\n", " ") for m in _NUMBER.finditer(body)]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.relative_to(BOOK).as_posix())
def test_chapter_types_no_number(path):
    found = typed_numbers(path.read_text(), template=path.suffix == ".tpl")
    assert not found, (f"{path.relative_to(BOOK.parent)} types numbers by hand; glue them from a run, render them "
                       f"from a result file, or remove them: " + " | ".join(found))


def test_the_check_finds_typed_numbers_and_spares_glue_code_math_and_names():
    text = ("Heads reach τ ≈ 1.97 at 840 tokens/s and 2.4x; a 95% interval over 15 conversations.\n"
            "Glued: {glue:text}`default_tau:.3f`, cited {cite:p}`li2025eagle3`, code `[2, N//2, N-3]`,\n"
            "math $c_5/c_1$ and $$S_2 = 2 \\log k$$ (eq-x), names EAGLE-3, SmolLM2-135M, Gemma-3-270M, S₁, α = 2.\n"
            "```bash\nwavesurf reproduce --only 01,03\n```\n")
    found = [f.split()[-1] for f in typed_numbers(text)]
    assert len(typed_numbers(text)) == 5, found
    for number in ("1.97", "840", "2.4x", "95%", "15"):
        assert any(number.rstrip("x%") in f for f in typed_numbers(text)), number
    assert typed_numbers("06_speed_table: τ = [[default_tau:.3f]] ([[ci]])\n# 12 comments\n", template=True) == []
    assert typed_numbers("06_speed_table: about 12 heads\n", template=True)
