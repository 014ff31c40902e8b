"""Figures of the statistics in one shared style: labelled axes with units, layer ids in the vLLM
convention (0 = embeddings, N = last block before the final norm)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

STYLE = {
    "figure.dpi": 110, "savefig.dpi": 150, "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10,
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
    "legend.frameon": False,
}
LAYER_AXIS = "layer id (vLLM: 0 = embeddings, N = last block, pre-norm)"


def use_style() -> None:
    import matplotlib

    matplotlib.rcParams.update(STYLE)


def plot_entropy_curves(series: Sequence[tuple[str, Any]], ax: Any = None, normalized: bool = False,
                        mark: Sequence[int] | None = None) -> Any:
    """Matrix entropy (alpha=1, nats or normalised) across depth, one line per (label, SubsetStats)."""
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.4))
    for label, sub in series:
        y = sub.normalized_entropy if normalized else sub.entropy
        ax.plot(sub.layer_ids, y, marker="o", ms=3, label=f"{label} (n={sub.n_tokens:,})")
    for i in mark or []:
        ax.axvline(i, color="0.5", lw=0.8, ls=":")
    ax.set_xlabel(LAYER_AXIS)
    ax.set_ylabel("normalised matrix entropy" if normalized else "matrix entropy S₁ (nats)")
    ax.legend(fontsize=8)
    return ax


def plot_cka_heatmap(sub: Any, ax: Any = None, title: str | None = None, compartments: bool = True) -> Any:
    """The (N+1)x(N+1) linear CKA matrix, with compartment boundaries drawn as boxes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(4.8, 4.2))
    ids = np.asarray(sub.layer_ids)
    im = ax.imshow(sub.cka, vmin=0, vmax=1, cmap="viridis", origin="lower",
                   extent=(ids[0] - 0.5, ids[-1] + 0.5, ids[0] - 0.5, ids[-1] + 0.5))
    if compartments:
        for lo, hi in sub.compartments:
            ax.add_patch(Rectangle((lo - 0.5, lo - 0.5), hi - lo + 1, hi - lo + 1, fill=False, ec="white", lw=1.2))
    ax.grid(False)
    ax.set_xlabel("layer id")
    ax.set_ylabel("layer id")
    if title:
        ax.set_title(title)
    plt.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="linear CKA")
    return ax


def plot_boundary_frequency(layer_ids: Sequence[int], frequency: Sequence[float], ax: Any = None,
                            compartments: Sequence[tuple[int, int]] | None = None) -> Any:
    """Bars: share of leave-one-group-out (jackknife) replicates whose CKA compartments start a new
    one at each layer id (jackknife agreement, not a stability estimate); the full-data boundaries
    are marked with triangles."""
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 1.8))
    ax.bar(layer_ids, frequency, width=0.8, color="tab:blue", alpha=0.7)
    starts = [lo for lo, _ in (compartments or [])[1:]]
    if starts:
        ax.plot(starts, [1.06] * len(starts), "v", color="tab:red", ms=5)
        ax.set_title("▼ = compartment start on all data", fontsize=8, loc="left")
    ax.set_ylim(0, 1.12)
    ax.set_xlabel("layer id (vLLM): a compartment starts here")
    ax.set_ylabel("share of jackknife\nreplicates")
    return ax


# ---------------------------------------------------------------------------------------------
# Figures of the paper-companion notebooks (one function per kind of figure; notebooks only call)
def shade_compartments(ax: Any, compartments: Sequence[tuple[int, int]], label: bool = True) -> None:
    """Shade contiguous CKA compartments (inclusive layer-id ranges) as alternating bands."""
    for b, (lo, hi) in enumerate(compartments):
        ax.axvspan(lo - 0.5, hi + 0.5, color="tab:blue" if b % 2 == 0 else "tab:orange", alpha=0.08, lw=0)
        if label:
            ax.text((lo + hi) / 2, 1.0, f"C{b + 1}", transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                    fontsize=8, color="0.35")


def plot_depth(series: Sequence[tuple[Any, ...]], ylabel: str, ax: Any = None,
               xlabel: str = LAYER_AXIS, compartments: Sequence[tuple[int, int]] | None = None,
               mark: Sequence[int] | None = None, title: str | None = None, styles: Sequence[dict] | None = None) -> Any:
    """Lines of a per-layer quantity across depth: ``series`` is [(label, x, y)] or
    [(label, x, y, (low, high))], the latter drawn with a shaded 95% interval band."""
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.4))
    if compartments:
        shade_compartments(ax, compartments)
    for n, (label, x, y, *band) in enumerate(series):
        style = {"marker": "o", "ms": 3, **((styles or [{}] * len(series))[n])}
        (line,) = ax.plot(x, y, label=label, **style)
        if band and band[0] is not None:
            ax.fill_between(x, band[0][0], band[0][1], color=line.get_color(), alpha=0.2, lw=0)
    for i in mark or []:
        ax.axvline(i, color="0.4", lw=0.8, ls=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if any(s[0] for s in series):
        ax.legend(fontsize=8)
    return ax


def plot_matrix(matrix: Any, layer_ids: Sequence[int], label: str, ax: Any = None, title: str | None = None,
                cmap: str = "viridis", vmin: float | None = None, vmax: float | None = None,
                marks: dict[str, Sequence[int]] | None = None) -> Any:
    """A layer x layer heatmap (both axes layer ids) with a labelled colour bar; ``marks`` draws
    the pairs of named layer sets as symbols."""
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(4.8, 4.2))
    ids = np.asarray(layer_ids)
    im = ax.imshow(np.asarray(matrix), origin="lower", cmap=cmap, vmin=vmin, vmax=vmax,
                   extent=(ids[0] - 0.5, ids[-1] + 0.5, ids[0] - 0.5, ids[-1] + 0.5))
    for (name, ids_), sym in zip((marks or {}).items(), ("o", "s", "^", "D", "v")):
        pts = [(a, b) for a in ids_ for b in ids_ if a != b]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=sym, s=28, facecolors="none",
                   edgecolors="white", linewidths=1.2, label=name)
    if marks:
        ax.legend(fontsize=7, loc="upper left", labelcolor="0.1", framealpha=0.7, frameon=True)
    ax.grid(False)
    ax.set_xlabel("layer id (vLLM)")
    ax.set_ylabel("layer id (vLLM)")
    if title:
        ax.set_title(title)
    plt.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=label)
    return ax


def plot_distribution(values: Any, xlabel: str, marks: dict[str, float] | None = None, ax: Any = None,
                      bins: int = 60, title: str | None = None,
                      spans: dict[str, tuple[float, float]] | None = None) -> Any:
    """Histogram of a score over many layer sets, with named sets marked as vertical lines and,
    in ``spans``, their 95% intervals shaded in the same colour."""
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.hist(np.asarray(values), bins=bins, color="0.6", edgecolor="white", lw=0.3)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (name, v) in enumerate((marks or {}).items()):
        ax.axvline(v, color=colours[n % len(colours)], lw=1.6, label=name)
        if spans and name in spans:
            ax.axvspan(*spans[name], color=colours[n % len(colours)], alpha=0.18, lw=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("number of layer sets")
    if title:
        ax.set_title(title)
    if marks:
        ax.legend(fontsize=8)
    return ax


def plot_sweep(rows: Sequence[dict[str, Any]], metric: str, ylabel: str, ax: Any = None) -> Any:
    """A metric of a token-entropy filter sweep against the kept fraction: filtered positions
    against random positions of the same count (rows of :func:`wavesurf.select.sweep_rows`), with
    95% interval whiskers where the rows carry ``<metric>_low``/``_high``."""
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(4.2, 3.2))
    for subset, style, dodge in (("filtered", {"marker": "o"}, -0.006), ("random", {"marker": "s", "ls": "--"}, 0.006)):
        sub = sorted((r for r in rows if r["subset"] in (subset, "all")), key=lambda r: float(r["kept_fraction"]))
        # whiskers side by side: the two subsets are dodged by +-0.006 in kept fraction
        x, y = [float(r["kept_fraction"]) + dodge for r in sub], [float(r[metric]) for r in sub]
        if sub and all(r.get(f"{metric}_low", "") != "" for r in sub):  # 95% interval whiskers
            err = [[yi - float(r[f"{metric}_low"]) for yi, r in zip(y, sub)],
                   [float(r[f"{metric}_high"]) - yi for yi, r in zip(y, sub)]]
            ax.errorbar(x, y, yerr=err, capsize=3, label=f"{subset} positions", **style)
        else:
            ax.plot(x, y, label=f"{subset} positions", **style)
    ax.set_xlabel("kept fraction of positions (1 = no filter)")
    ax.set_ylabel(ylabel)
    ax.invert_xaxis()
    ax.legend(fontsize=8)
    return ax


def save_figure(fig: Any, path: Any) -> Any:
    """Save ``fig`` as PNG (parents created); returns the path."""
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


def plot_layer_sets(sets: dict[str, Sequence[int]], n_layers: int, ax: Any = None,
                    compartments: Sequence[tuple[int, int]] | None = None) -> Any:
    """One row per named layer set, its ids marked on the depth axis 0..N."""
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 0.45 * len(sets) + 1.0))
    if compartments:
        shade_compartments(ax, compartments)
    names = list(sets)
    for row, name in enumerate(names):
        ids = list(sets[name])
        ax.plot(ids, [row] * len(ids), "o", ms=7)
        for i in ids:
            ax.annotate(str(i), (i, row), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    ax.set_ylim(-0.6, len(names) - 0.3)
    ax.set_xlim(-0.5, n_layers + 0.5)
    ax.set_xlabel(LAYER_AXIS)
    ax.grid(axis="y", alpha=0)
    return ax


def plot_tau_intervals(summary: Sequence[dict[str, Any]], ax_tau: Any = None, ax_diff: Any = None) -> tuple[Any, Any]:
    """Two panels over the layer sets (rows): offline acceptance length τ with its bootstrap
    interval (left), and the paired difference to the default set with its interval (right; the
    dashed line is "no difference"). Colour = verdict: better / worse / within noise / reference."""
    import matplotlib.pyplot as plt

    use_style()
    rows = sorted(summary, key=lambda r: (r["group"] != "default", r["group"] == "floor", -float(r["tau"])))
    if ax_tau is None or ax_diff is None:
        _, (ax_tau, ax_diff) = plt.subplots(1, 2, figsize=(10, 0.32 * len(rows) + 1.4), sharey=True)
    colours = {"reference": "black", "better": "tab:green", "worse": "tab:red", "within noise": "tab:grey"}
    ys = np.arange(len(rows))
    for y, r in zip(ys, rows):
        c = colours.get(r["verdict"], "tab:blue")
        ax_tau.errorbar(r["tau"], y, xerr=[[r["tau"] - r["tau_lo"]], [r["tau_hi"] - r["tau"]]], fmt="o", color=c,
                        capsize=2, ms=4)
        if r["group"] != "default":
            ax_diff.errorbar(r["diff"], y, xerr=[[r["diff"] - r["diff_lo"]], [r["diff_hi"] - r["diff"]]], fmt="o",
                             color=c, capsize=2, ms=4)
    labels = [f"{r['layer_set']} [{r['layer_ids']}]" if r["layer_ids"] else r["layer_set"] for r in rows]
    ax_tau.set_yticks(ys)
    ax_tau.set_yticklabels(labels, fontsize=8)
    if not ax_tau.yaxis_inverted():
        ax_tau.invert_yaxis()
    d = rows[0].get("draft_len", "")
    ax_tau.set_xlabel(f"offline acceptance length τ at draft length {d} (tokens per target forward)")
    ax_diff.axvline(0.0, color="black", lw=0.8, ls="--")
    ax_diff.set_xlabel("paired difference to the default set (τ)")
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=v) for v, c in colours.items()]
    ax_diff.legend(handles=handles, fontsize=7, loc="best")
    return ax_tau, ax_diff


def plot_paired_differences(rows: Sequence[dict[str, Any]], ax: Any = None, label_key: str = "layer_set",
                            xlabel: str = "paired difference (τ)") -> Any:
    """One point per row at ``diff`` with its interval ``diff_lo``..``diff_hi``; dashed zero line;
    colour by ``verdict``."""
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(5.6, 0.45 * len(rows) + 1.4))
    colours = {"better": "tab:green", "worse": "tab:red", "within noise": "tab:grey", "same set": "tab:blue"}
    for y, r in enumerate(rows):
        ax.errorbar(r["diff"], y, xerr=[[r["diff"] - r["diff_lo"]], [r["diff_hi"] - r["diff"]]], fmt="o", capsize=2,
                    ms=4, color=colours.get(r["verdict"], "black"))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([str(r[label_key]) for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0.0, color="black", lw=0.8, ls="--")
    ax.set_xlabel(xlabel)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=v) for v, c in colours.items()]
    ax.legend(handles=handles, fontsize=7, loc="best")
    return ax


def plot_tau_curve(curve: Sequence[dict[str, Any]], ax: Any = None) -> Any:
    """Offline acceptance length against the drafter's training tokens, one line per layer set,
    with the bootstrap interval as a band."""
    import matplotlib.pyplot as plt

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(4.6, 3.2))
    for name in dict.fromkeys(r["layer_set"] for r in curve):
        pts = sorted((int(r["train_tokens"]), float(r["tau"]), float(r["tau_lo"]), float(r["tau_hi"]))
                     for r in curve if r["layer_set"] == name)
        x = [p[0] for p in pts]
        ids = next(r["layer_ids"] for r in curve if r["layer_set"] == name)
        (line,) = ax.plot(x, [p[1] for p in pts], marker="o", label=f"{name} [{ids}]")
        ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts], color=line.get_color(), alpha=0.2)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen by the drafter")
    d = curve[0].get("draft_len", "") if curve else ""
    ax.set_ylabel(f"offline τ at draft length {d} (tokens/forward)")
    ax.legend(fontsize=7)
    return ax


def plot_set_landscape(every: Any, trained: Sequence[tuple[str, float, float, float]], ax: Any = None,
                       xlabel: str = "redundancy S2 of the set (nats)",
                       ylabel: str = "aggregate entropy S2 of the set (nats)", every_label: str = "every k-subset") -> Any:
    """Every k-subset of layers as a grey point (``every``: [m, 2] of x, y) and the trained sets on
    top (``trained``: name, x, y, tau), coloured by their heads' tau: whether the criteria place
    the sets drafters rank high where a selection would look."""
    import matplotlib.pyplot as plt
    import numpy as np

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(5.6, 4.0))
    every = np.asarray(every, dtype=np.float64)
    ax.scatter(every[:, 0], every[:, 1], s=3, color="0.8", label=every_label, rasterized=True)
    if trained:
        xs, ys, taus = (np.array([t[i] for t in trained], dtype=np.float64) for i in (1, 2, 3))
        points = ax.scatter(xs, ys, c=taus, cmap="viridis", s=36, edgecolor="black", linewidth=0.5, zorder=3)
        plt.colorbar(points, ax=ax, label="heads' offline τ (tokens/forward)")
        for name, x, y, _ in trained:
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, loc="lower right")
    return ax

