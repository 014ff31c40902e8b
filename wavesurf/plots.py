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
