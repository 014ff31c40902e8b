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
# # CKA dynamics across depth
#
# How similar are the representations of two layers? Linear CKA ({ref}`methods-cka`) compares
# the token-by-token geometry of two layers, 1 for the same geometry up to rotation and isotropic
# scaling, 0 for unrelated ones. We show the full layer × layer matrix, the similarity of each
# layer to the next one (where the representation changes fastest) and to the last block (how
# far each layer is from what the model finally predicts from).

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

P, target = open_notebook(model, dataset, max_tokens, profile, seed, device)

# %%
# NBVAL_CHECK_OUTPUT
print(target_line(target))

# %% tags=["hide-output"]
base = variants.profile_stats(target, P, ["base"])["base"]
ids = base.layer_ids
from wavesurf.stats.cka import cka_to_last, neighbour_cka

nxt, last = neighbour_cka(base.cka), cka_to_last(base.cka)
iv = base.has_intervals
nxt_jk = base.interval("cka_next") if iv else None

# %% tags=["hide-input"]
fig = plt.figure(figsize=(11, 6.0))
grid = fig.add_gridspec(2, 2, height_ratios=[4.2, 1.5])
ax0 = fig.add_subplot(grid[0, 0])
plots.plot_cka_heatmap(base.main, ax=ax0, title="linear CKA (boxes: compartments)")
ax1 = fig.add_subplot(grid[0, 1])
plots.plot_depth([("CKA(i, i+1): next layer", ids[:-1], nxt, base.band("cka_next")),
                  ("CKA(i, N): last block", ids, last, base.band("cka_to_last"))],
                 "linear CKA", ax=ax1, compartments=base.compartments, mark=target.default_layer_ids())
ax1.set_ylim(0, 1.05)
ax2 = fig.add_subplot(grid[1, 0])
if iv:
    plots.plot_boundary_frequency(ids, base.boundary_frequency(), ax=ax2, compartments=base.compartments)
else:
    ax2.set_axis_off()
fig.tight_layout()
plots.save_figure(fig, "figures/02_cka.png")
glue("fig_cka", fig, display=False)
plt.close(fig)

# %% tags=["remove-input"]
k_jump = int(np.argmin(nxt))
default_ids = target.default_layer_ids()
default_cka = base.pair_cka(default_ids)  # every pair of default layers
glue("n_tokens", f"{base.main.n_tokens:,}", display=False)
glue("estimator", base.meta["estimator_used"], display=False)
glue("min_next", paper.interval_text(nxt[k_jump], nxt_jk, ".3f", k_jump), display=False)
glue("min_next_layer", ids[k_jump], display=False)
glue("min_next_layer_to", ids[k_jump] + 1, display=False)
glue("median_next", float(np.median(nxt)), display=False)
glue("mean_next_inner", float(np.mean(nxt[1:])), display=False)
glue("cka_embed_last", float(last[0]), display=False)
half = next((lid for lid, v in zip(ids, last) if v >= 0.5), ids[-1])
glue("first_half_last", half, display=False)
glue("default_pairs", "; ".join(f"CKA({a}, {b}) = {v:.2f}" for (a, b), v in default_cka.items()), display=False)
glue("default_mean_cka", float(np.mean(list(default_cka.values()))), display=False)
glue("n_compartments", len(base.compartments), display=False)
starts = [ids.index(lo) for lo, _ in base.compartments[1:]]
if iv and starts:
    freq = base.boundary_frequency()
    glue("boundary_sentence", "In the leave-one-group-out (jackknife) replicates, these boundaries recur in "
         + ", ".join(f"{100 * freq[k]:.0f} %" for k in starts) + " of cases (id " + ", ".join(str(ids[k]) for k in starts)
         + f"), and {int(np.sum(freq > 0) - len(starts))} other ids ever start a compartment. "
         + paper.jackknife_agreement_note(base), display=False)
else:
    glue("boundary_sentence", "", display=False)
glue("interval_note", paper.interval_note(base), display=False)

# %% [markdown]
# ```{glue:figure} fig_cka
# Left: linear CKA between every pair of layer ids (vLLM convention; {glue:text}`estimator` estimator,
# {glue:text}`n_tokens` positions), white boxes the compartments; below it, the share of jackknife
# replicates (one group of conversations left out) in which a compartment starts at each id. Right: CKA of
# each layer with the next one and with the last block, with 95% interval bands; dotted verticals
# mark the default EAGLE-3 layers. **What to see:** bright square blocks along the diagonal are
# groups of layers that share a geometry; dips of the next-layer CKA mark where the representation
# turns over; a boundary missing from some jackknife replicates hangs on one group of conversations.
# ```
#
# Neighbouring blocks are similar (median CKA(i, i+1) = {glue:text}`median_next:.3f`), except where
# the representation turns over: the sharpest change is from id {glue:text}`min_next_layer` to
# {glue:text}`min_next_layer_to` (CKA {glue:text}`min_next`). The embedding output has CKA
# {glue:text}`cka_embed_last:.3f` with the last block, and the first layer whose CKA with the last
# block reaches 0.5 is id {glue:text}`first_half_last`. The default layers are pairwise
# {glue:text}`default_pairs` (mean {glue:text}`default_mean_cka:.3f`): they sit in different parts
# of the {glue:text}`n_compartments` compartments: a rule spread over depth by construction
# samples several compartments, one reason such defaults can stay competitive.
# {glue:text}`boundary_sentence` {glue:text}`interval_note`
