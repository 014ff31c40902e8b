"""The shared figure style: every plot labels its axes (with units where there are any)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from wavesurf.book import plots  # noqa: E402
from wavesurf.stats.layer_sets import all_subsets  # noqa: E402


def _labels(ax):
    return ax.get_xlabel(), ax.get_ylabel()


def test_depth_matrix_distribution_and_sets_are_labelled(small_stats, tmp_path):
    import matplotlib.pyplot as plt

    curves = small_stats.depth_curves()
    ax = plots.plot_depth([("S1", small_stats.layer_ids, curves["S1"])], "S₁ (nats)",
                          compartments=small_stats.compartments, mark=[2, 15, 27])
    assert _labels(ax) == (plots.LAYER_AXIS, "S₁ (nats)")
    assert len(ax.patches) == len(small_stats.compartments)  # one shaded band per compartment
    ax = plots.plot_matrix(small_stats.pair_matrix(), small_stats.layer_ids, "S₂ (nats)",
                           marks={"default": [2, 15, 27]})
    assert all(_labels(ax)) and ax.figure.axes[-1].get_ylabel() == "S₂ (nats)"  # colour bar label
    sets = all_subsets(range(1, 31), 3)
    ax = plots.plot_distribution(small_stats.aggregate_entropy2(sets), "S₂ (nats)", marks={"default": 3.0})
    assert _labels(ax) == ("S₂ (nats)", "number of layer sets") and len(ax.get_lines()) == 1
    ax = plots.plot_layer_sets({"default": [2, 15, 27], "x": [1, 9, 30]}, 30)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["default", "x"]
    path = plots.save_figure(ax.figure, tmp_path / "f" / "sets.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    plt.close("all")


def test_sweep_plot():
    rows = [{"subset": "all", "kept_fraction": 1.0, "m": 0.5},
            {"subset": "filtered", "kept_fraction": 0.5, "m": 0.7}, {"subset": "random", "kept_fraction": 0.5, "m": 0.52}]
    ax = plots.plot_sweep(rows, "m", "mean thing")
    assert ax.get_ylabel() == "mean thing" and "kept fraction" in ax.get_xlabel()
    filtered, random = ax.get_lines()
    assert list(filtered.get_ydata()) == [0.7, 0.5] and list(random.get_ydata()) == [0.52, 0.5]  # both end at no filter


def test_speed_table_plots_show_intervals_and_verdicts():
    import matplotlib.pyplot as plt

    summary = [
        {"layer_set": "default", "group": "default", "layer_ids": "2 15 27", "tau": 2.1, "tau_lo": 2.0, "tau_hi": 2.2,
         "diff": 0.0, "diff_lo": 0.0, "diff_hi": 0.0, "verdict": "reference"},
        {"layer_set": "cka", "group": "selected", "layer_ids": "5 18 29", "tau": 2.3, "tau_lo": 2.2, "tau_hi": 2.4,
         "diff": 0.2, "diff_lo": 0.1, "diff_hi": 0.3, "verdict": "better"},
        {"layer_set": "bigram", "group": "floor", "layer_ids": "", "tau": 1.3, "tau_lo": 1.25, "tau_hi": 1.35,
         "diff": -0.8, "diff_lo": -0.9, "diff_hi": -0.7, "verdict": "worse"},
    ]
    ax_tau, ax_diff = plots.plot_tau_intervals(summary)
    assert "τ" in ax_tau.get_xlabel() and ax_diff.get_xlabel()
    assert len(ax_tau.get_yticklabels()) == len(summary)
    ax = plots.plot_paired_differences([dict(r, method=r["layer_set"]) for r in summary[1:]], label_key="method")
    assert ax.get_xlabel() and [t.get_text() for t in ax.get_yticklabels()] == ["cka", "bigram"]
    curve = [{"layer_set": s, "layer_ids": "2 15 27", "fraction": f, "train_tokens": int(48_000 * f), "tau": 1.5 + f,
              "tau_lo": 1.4 + f, "tau_hi": 1.6 + f} for s in ("default", "cka") for f in (0.25, 0.5, 1.0)]
    ax = plots.plot_tau_curve(curve)
    assert _labels(ax)[0] and "τ" in _labels(ax)[1] and len(ax.get_lines()) == 2 and len(ax.collections) == 2
    plt.close("all")
