"""Tables that fit the page: a box that scrolls sideways, numbers right-aligned, short cells on one line."""
from __future__ import annotations

import re

import numpy as np

from wavesurf.book.tables import NOWRAP_CHARS, html_table


def test_html_table_escapes_formats_and_fits_the_page():
    long_text = "x " * NOWRAP_CHARS
    page = html_table([{"a": "<b>", "b": np.float64(1.234567), "ids": [2, 15, 27], "why": long_text},
                       {"a": "c", "b": 3, "ids": "8 11 29", "why": "short"}], headers={"a": "A"})
    assert page.startswith('<div class="wavesurf-table-wrap" style="overflow-x:auto')  # scrolls inside its box
    assert re.search(r"<th [^>]*>A</th>", page) and "&lt;b&gt;" in page and ">1.235<" in page
    cells = re.findall(r'<td style="([^"]*)">([^<]*)</td>', page)
    style = dict((text, st) for st, text in cells)
    assert "text-align:right" in style["1.235"] and "tabular-nums" in style["3"]  # numbers line up
    assert "white-space:nowrap" in style["2 15 27"] and "white-space:nowrap" in style["8 11 29"]
    assert "nowrap" not in style[long_text]  # prose may wrap
    assert "text-align:right" not in style["&lt;b&gt;"]
    assert html_table([]).count("<tr>") == 1  # an empty table keeps its (empty) header row


def test_an_interval_shares_its_estimate_cell():
    page = html_table([{"tau": 1.286, "lo": 1.248, "hi": 1.323}, {"tau": 1.2, "lo": "", "hi": ""}], ["tau"],
                      floatfmt=".3f", intervals={"tau": ("lo", "hi")})
    assert ">1.286 (1.248 to 1.323)<" in page and ">1.200<" in page  # no bounds: the estimate alone
    assert page.count("<th ") == 1  # one column instead of three
