"""Tables a reader can read on the book's pages: tidy rows as HTML that fits the page.

A results page is read in a laptop window (about 1,400 px, the text column narrower), and the
speed table has a dozen columns. So the table scrolls inside its own box instead of running off
the page; numbers are right-aligned in tabular figures, so decimals line up; layer ids, intervals
and other short cells stay on one line; the header row stays short (``headers`` renames columns)
and wraps before a cell does. Styles are inline, so the table looks the same in Jupyter, in
papermill's executed notebook and in the built book.
"""
from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import numpy as np

#: cells up to this many characters never wrap (layer ids, numbers, short verdicts)
NOWRAP_CHARS = 24
_WRAP = "overflow-x:auto;max-width:100%;margin:0.5em 0"
_TABLE = "border-collapse:collapse;font-size:0.85em;line-height:1.3"
_TH = "padding:0.2em 0.5em;border-bottom:1px solid #999;text-align:left;vertical-align:bottom;max-width:9em"
_TD = "padding:0.15em 0.5em;border-bottom:1px solid #ddd;vertical-align:top"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)


def html_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, floatfmt: str = ".4g",
               headers: dict[str, str] | None = None, intervals: dict[str, tuple[str, str]] | None = None) -> str:
    """An HTML table (no pandas) of tidy rows inside a box that scrolls sideways when the table
    is wider than the page; ``headers`` renames columns, ``floatfmt`` formats floats;
    ``intervals`` maps a column to its (low, high) columns, shown in one cell as ``v (lo to hi)``
    (one column instead of three, so the columns a page is about stay in view)."""
    columns = list(columns or (rows[0].keys() if rows else []))
    headers, intervals = headers or {}, intervals or {}

    def text_of(v: Any) -> str:
        if isinstance(v, float | np.floating):
            return format(float(v), floatfmt)
        if isinstance(v, list | tuple):  # layer ids, as in the CSV
            return " ".join(map(str, v))
        return str(v)

    def cell(v: Any, bounds: tuple[Any, Any] | None = None) -> str:
        text = text_of(v)
        if bounds is not None and all(_is_number(b) for b in bounds):
            text += f" ({text_of(bounds[0])} to {text_of(bounds[1])})"
        style = _TD
        if _is_number(v):
            style += ";text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap"
        elif len(text) <= NOWRAP_CHARS:
            style += ";white-space:nowrap"
        return f'<td style="{style}">{html.escape(text)}</td>'

    head = "".join(f'<th style="{_TH}">{html.escape(headers.get(c, c))}</th>' for c in columns)
    body = "".join("<tr>" + "".join(cell(r.get(c, ""), tuple(r.get(b, "") for b in intervals[c]) if c in intervals
                                         else None) for c in columns) + "</tr>" for r in rows)
    return (f'<div class="wavesurf-table-wrap" style="{_WRAP}"><table class="wavesurf-table" style="{_TABLE}">'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


__all__ = ["NOWRAP_CHARS", "html_table"]
