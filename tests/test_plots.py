"""The shared figure style: every plot labels its axes (with units where there are any)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402

from wavesurf import paper, plots  # noqa: E402


def _labels(ax):
    return ax.get_xlabel(), ax.get_ylabel()


def test_depth_matrix_distribution_and_sets_are_labelled(small_stats, tmp_path):
    import matplotlib.pyplot as plt

    curves = paper.depth_curves(small_stats)
    ax = plots.plot_depth([("S1", small_stats.layer_ids, curves["S1"])], "S₁ (nats)",
                          compartments=small_stats.compartments, mark=[2, 15, 27])
    assert _labels(ax) == (plots.LAYER_AXIS, "S₁ (nats)")
    assert len(ax.patches) == len(small_stats.compartments)  # one shaded band per compartment
    ax = plots.plot_matrix(paper.pair_matrix(small_stats), small_stats.layer_ids, "S₂ (nats)",
                           marks={"default": [2, 15, 27]})
    assert all(_labels(ax)) and ax.figure.axes[-1].get_ylabel() == "S₂ (nats)"  # colour bar label
    sets = paper.all_subsets(range(1, 31), 3)
    ax = plots.plot_distribution(paper.aggregate_entropy2(small_stats, sets), "S₂ (nats)", marks={"default": 3.0})
    assert _labels(ax) == ("S₂ (nats)", "number of layer sets") and len(ax.get_lines()) == 1
    ax = plots.plot_layer_sets({"default": [2, 15, 27], "x": [1, 9, 30]}, 30)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["default", "x"]
    path = plots.save_figure(ax.figure, tmp_path / "f" / "sets.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    plt.close("all")


def test_sweep_plot_and_html_table():
    rows = [{"subset": "all", "kept_fraction": 1.0, "m": 0.5},
            {"subset": "filtered", "kept_fraction": 0.5, "m": 0.7}, {"subset": "random", "kept_fraction": 0.5, "m": 0.52}]
    ax = plots.plot_sweep(rows, "m", "mean thing")
    assert ax.get_ylabel() == "mean thing" and "kept fraction" in ax.get_xlabel()
    filtered, random = ax.get_lines()
    assert list(filtered.get_ydata()) == [0.7, 0.5] and list(random.get_ydata()) == [0.52, 0.5]  # both end at no filter
    html = plots.html_table([{"a": "<b>", "b": np.float64(1.234567)}], headers={"a": "A"})
    assert "<th>A</th>" in html and "&lt;b&gt;" in html and "1.235" in html
