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
# # Token-entropy filtering
#
# Many positions are easy: the model is already sure of the next token, and its hidden state
# there says little about what a drafter must learn. Token-entropy filtering
# ({ref}`methods-filtering`) keeps only positions whose next-token entropy is at least a
# threshold (a quantile of the run's token entropies), the same positions for every layer. Any
# smaller sample changes statistics, so every filtered result is shown beside a **random subset of
# the same size**: only the difference between the two is the effect of filtering.
#
# This page is the statistics half of the filtering study; the drafter half (acceptance length of
# drafters trained on the sets selected with and without filtering) is added with the drafter
# chapters.

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

import wavesurf as ws
from wavesurf.book import paper, plots, tables, variants
from wavesurf.book.notebook import open_notebook, target_line
from wavesurf.select import sweep_rows
from wavesurf.stats.results import control_view

P, target = open_notebook(model, dataset, max_tokens, profile, seed, device)

# %%
# NBVAL_CHECK_OUTPUT
print(target_line(target))

# %% tags=["hide-output"]
names = variants.sweep_variant_names(P)
sweep = variants.profile_stats(target, P, names)
rows = sweep_rows(sweep, method="combined")
paper.write_csv(rows, "tables/04_token_filtering.csv")
sel = variants.profile_stats(target, P, ["selection"])["selection"]
ctrl = control_view(sel)
ids = sel.layer_ids

# %% tags=["hide-input"]
fig, axes = plt.subplots(2, 2, figsize=(10, 7))
axes = axes.ravel()
cf, cr = sel.depth_curves(), ctrl.depth_curves()
plots.plot_depth([(f"filtered ({sel.meta['filter']['filter']})", ids, cf["S1_norm"], cf.get("S1_norm_band")),
                  ("random, same size", ids, cr["S1_norm"], cr.get("S1_norm_band"))],
                 "normalised S₁", ax=axes[0], compartments=sel.compartments, styles=[{}, {"ls": "--", "marker": "s"}])
axes[0].set_xlabel("layer id (vLLM)")
plots.plot_sweep(rows, "mean_normalized_entropy", "mean normalised S₁ over layers", ax=axes[1])
plots.plot_sweep(rows, "mean_neighbour_cka", "mean CKA(i, i+1)", ax=axes[2])
plots.plot_sweep(rows, "mean_cka_to_last", "mean CKA(i, N)", ax=axes[3])
fig.tight_layout()
plots.save_figure(fig, "figures/04_filtering.png")
glue("fig_filtering", fig, display=False)
plt.close(fig)

# %% tags=["remove-input"]
from IPython.display import HTML

cols = ["filter", "subset", "threshold_nats", "kept_fraction", "tokens", "mean_normalized_entropy",
        "mean_neighbour_cka", "mean_cka_to_last", "n_compartments", "selected_ids"]
if any("mean_neighbour_cka_minus_random" in r for r in rows):  # filtered minus random, with its interval
    cols[-1:-1] = ["mean_neighbour_cka_minus_random", "mean_neighbour_cka_minus_random_low",
                   "mean_neighbour_cka_minus_random_high", "selected_jackknife_agreement"]
HTML(tables.html_table(rows, cols, headers={"threshold_nats": "threshold (nats)", "kept_fraction": "kept",
                                           "mean_normalized_entropy": "mean S₁/max", "mean_neighbour_cka": "mean CKA(i,i+1)",
                                           "mean_cka_to_last": "mean CKA(i,N)", "n_compartments": "compartments",
                                           "selected_ids": "combined picks",
                                           "mean_neighbour_cka_minus_random": "Δ CKA(i,i+1) vs random",
                                           "mean_neighbour_cka_minus_random_low": "Δ 95% low",
                                           "mean_neighbour_cka_minus_random_high": "Δ 95% high",
                                           "selected_jackknife_agreement": "jackknife agreement of picks"}))

# %% tags=["remove-input"]
f = sel.meta["filter"]
de = cf["S1_norm"] - cr["S1_norm"]
sel_f = ws.select_layers(sel, k=3, method="combined").layer_ids
sel_r = ws.select_layers(ctrl, k=3, method="combined").layer_ids
sel_all = ws.select_layers(sweep["base"], k=3, method="combined").layer_ids
glue("filter", f["filter"], display=False)
glue("threshold", float(f["threshold_nats"]), display=False)
glue("kept_percent", 100 * float(f["kept_fraction"]), display=False)
glue("kept_tokens", f"{f['kept_tokens']:,}", display=False)
glue("candidate_tokens", f"{f['candidate_tokens']:,}", display=False)
iv = sel.has_intervals and ctrl.has_intervals
from wavesurf.stats.cka import cka_to_last, neighbour_cka

for name, q, value in (("mean_entropy_gain", "mean_normalized_entropy", np.mean(de)),
                       ("next_cka_gain", "mean_cka_next", np.mean(neighbour_cka(sel.cka)) - np.mean(neighbour_cka(ctrl.cka))),
                       ("last_cka_gain", "mean_cka_to_last", np.mean(cka_to_last(sel.cka)) - np.mean(cka_to_last(ctrl.cka)))):
    glue(name, paper.interval_text(value, sel.control_difference(q) if iv else None, "+.4f", verdict=True), display=False)
glue("interval_note", paper.interval_note(sel), display=False)
glue("layers_higher", int(np.sum(de > 0)), display=False)
glue("n_ids", len(ids), display=False)
glue("sel_filtered", paper.fmt_ids(sel_f), display=False)
glue("sel_random", paper.fmt_ids(sel_r), display=False)
glue("sel_all", paper.fmt_ids(sel_all), display=False)
glue("sets_agree", "the same set" if sel_f == sel_r else "a different set", display=False)
glue("compartments_agree", float(sel.meta.get("compartment_agreement_with_control", float("nan"))), display=False)
glue("n_filters", len(names) - 1, display=False)

# %% [markdown]
# ```{glue:figure} fig_filtering
# Top left: normalised α = 1 entropy across depth on the positions kept by the filter
# {glue:text}`filter` (solid) and on a random subset of the same size (dashed). The other three:
# summaries against the kept fraction for {glue:text}`n_filters` thresholds (1 = no filter):
# mean normalised entropy, mean next-layer CKA, mean CKA with the last block, filtered (circles)
# against random (squares); bands and whiskers are 95% intervals over groups of conversations.
# **What to see:** the gap between filtered and random curves is the effect of choosing uncertain
# positions, when it is wider than the whiskers; the random curve alone shows what a smaller sample does.
# ```
#
# The filter {glue:text}`filter` keeps tokens whose next-token entropy is at least
# {glue:text}`threshold:.3f` nats: {glue:text}`kept_tokens` of {glue:text}`candidate_tokens`
# positions ({glue:text}`kept_percent:.1f` %). On them the normalised entropy differs from the
# random control by {glue:text}`mean_entropy_gain` on average and is higher at
# {glue:text}`layers_higher` of {glue:text}`n_ids` layer ids; the mean next-layer CKA differs by
# {glue:text}`next_cka_gain` and the mean CKA to the last block by {glue:text}`last_cka_gain`
# (filtered minus random, paired: both subsets come from the same conversations).
# {glue:text}`interval_note` The combined selection picks
# {glue:text}`sel_filtered` on filtered positions, {glue:text}`sel_random` on the random control
# ({glue:text}`sets_agree`) and {glue:text}`sel_all` without a filter; filtered and random
# compartments agree at {glue:text}`compartments_agree:.2f` (adjusted agreement, 1 = identical).
