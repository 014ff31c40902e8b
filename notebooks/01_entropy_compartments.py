# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (wavesurf)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Matrix entropy across depth
#
# How much information does each layer's hidden state carry? For every layer id 0..N we compute
# the Rényi matrix entropy of the token covariance (α = 1, von Neumann, and α = 2, collision
# entropy; {ref}`methods-entropy`), raw in nats and normalised by its maximum `log min(n−1, d)`.
# The background bands are the depth compartments found from the CKA matrix
# ({ref}`methods-compartments`). Statistics drop position 0 of every sequence by default (the BOS
# token is an attention sink whose single row can dominate the covariance); the dashed curves keep it.

# %% tags=["parameters", "hide-input"]
model = "smollm2-135m"  # embedded name, local directory or HF id
dataset = "sharegpt"  # sharegpt, mt-bench, humaneval or a .jsonl path
max_tokens = None  # None: the profile's analysis token budget
profile = "default"  # smoke | default | long | paper
seed = 0  # random control subsets and minibatch shuffling
device = "auto"  # auto, cpu, cuda, cuda:N

# %% tags=["hide-input", "hide-output"]
# Check the parameters first (a wrong type or value stops here with a clear message), then load the target.
import matplotlib.pyplot as plt
import numpy as np
from myst_nb import glue

from wavesurf.book import paper, plots, variants
from wavesurf.book.notebook import open_notebook, target_line
from wavesurf.stats import compartment_label

P, target = open_notebook(model, dataset, max_tokens, profile, seed, device)

# %%
# NBVAL_CHECK_OUTPUT
print(target_line(target))

# %% tags=["hide-output"]
stats = variants.profile_stats(target, P)  # every variant the statistics notebooks read, one capture
base, pos0 = stats["base"], stats["position0"]
cb, cp = base.depth_curves(), pos0.depth_curves()
ids = base.layer_ids

# %% tags=["hide-input"]
fig, axes = plt.subplots(2, 2, figsize=(10, 6.2), sharex=True)
panels = [("S1", "S₁ (α=1, nats)"), ("S1_norm", "S₁ / log min(n−1, d)"),
          ("S2", "S₂ (α=2, nats)"), ("S2_norm", "S₂ / log min(n−1, d)")]
for ax, (key, ylabel) in zip(axes.ravel(), panels):
    plots.plot_depth([("position 0 excluded", ids, cb[key], cb.get(f"{key}_band")),
                      ("position 0 included", ids, cp[key], cp.get(f"{key}_band"))],
                     ylabel, ax=ax, compartments=base.compartments, mark=target.default_layer_ids(),
                     styles=[{}, {"ls": "--", "marker": "x"}])
    ax.set_xlabel("")
for ax in axes[1]:
    ax.set_xlabel(plots.LAYER_AXIS)
fig.tight_layout()
plots.save_figure(fig, "figures/01_entropy_depth.png")
glue("fig_entropy_depth", fig, display=False)
plt.close(fig)

# %% tags=["remove-input"]
k_max = int(np.argmax(cb["S1"]))
k_min = int(np.argmin(cb["S1"][1:])) + 1
blocks = base.compartments
glue("n_tokens", f"{base.main.n_tokens:,}", display=False)
glue("n_tokens_pos0", f"{pos0.main.n_tokens:,}", display=False)
glue("s1_max_layer", ids[k_max], display=False)
s1_jk = base.interval("entropy") if base.has_intervals else None
glue("s1_max", paper.interval_text(cb["S1"][k_max], s1_jk, ".2f", k_max), display=False)
glue("s1_max_norm", float(cb["S1_norm"][k_max]), display=False)
glue("s1_min_layer", ids[k_min], display=False)
glue("s1_min", paper.interval_text(cb["S1"][k_min], s1_jk, ".2f", k_min), display=False)
glue("s1_embed", float(cb["S1"][0]), display=False)
glue("s1_last", float(cb["S1"][-1]), display=False)
glue("eff_rank_max", float(base.main.effective_rank[k_max]), display=False)
glue("n_compartments", len(blocks), display=False)
glue("compartments", ", ".join(f"{a}–{b}" for a, b in blocks), display=False)
d1 = cp["S1"] - cb["S1"]
higher, lower = (base, pos0) if np.mean(d1) < 0 else (pos0, base)  # the shift as a positive number
d1_jk = paper.paired_difference(higher, lower, "mean_entropy") if base.has_intervals and pos0.has_intervals else None
glue("pos0_mean_shift", paper.interval_text(abs(np.mean(d1)), d1_jk, ".3f", verdict=True), display=False)
glue("interval_note", paper.interval_note(base), display=False)
glue("pos0_max_shift", float(np.max(np.abs(d1))), display=False)
glue("pos0_max_shift_layer", ids[int(np.argmax(np.abs(d1)))], display=False)
glue("pos0_direction", "lowers" if np.mean(d1) < 0 else "raises", display=False)
default_ids = target.default_layer_ids()
glue("default_ids", paper.fmt_ids(default_ids), display=False)
glue("default_blocks", ", ".join(compartment_label(i, blocks) for i in default_ids), display=False)

# %% [markdown]
# ```{glue:figure} fig_entropy_depth
# Matrix entropy of every layer id (vLLM convention) of this model on {glue:text}`n_tokens` statistics
# positions. Top: α = 1; bottom: α = 2; left in nats, right normalised to [0, 1]. Light bands
# around the lines: 95% intervals over groups of conversations; shaded columns:
# CKA compartments C1… ({glue:text}`compartments`); dotted verticals: the default EAGLE-3 layers
# {glue:text}`default_ids`. **What to see:** how entropy changes across depth and where it
# changes relative to the compartment boundaries, and how far keeping position 0 (dashed) moves it.
# ```
#
# In this run the most informative layer by α = 1 entropy is id {glue:text}`s1_max_layer`
# (S₁ = {glue:text}`s1_max` nats, {glue:text}`s1_max_norm:.2f` of the maximum, an effective rank
# of {glue:text}`eff_rank_max:.0f` dimensions); the least informative block output is id
# {glue:text}`s1_min_layer` (S₁ = {glue:text}`s1_min` nats). {glue:text}`interval_note` The embedding output (id 0) has
# S₁ = {glue:text}`s1_embed:.2f` nats and the last block {glue:text}`s1_last:.2f` nats.
# The CKA matrix splits depth into {glue:text}`n_compartments` compartments
# ({glue:text}`compartments`); the default layers {glue:text}`default_ids` fall into
# {glue:text}`default_blocks`.
#
# Keeping position 0 ({glue:text}`n_tokens_pos0` positions) {glue:text}`pos0_direction` the
# α = 1 entropy by {glue:text}`pos0_mean_shift` nats on average (paired interval: both runs
# resample the same conversations), by up to
# {glue:text}`pos0_max_shift:.3f` nats at layer {glue:text}`pos0_max_shift_layer` — one row per
# sequence is enough to move a spectrum, which is why the statistics exclude it.
