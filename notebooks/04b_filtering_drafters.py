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
# # Token filtering: the drafter side
#
# The statistics side (the token-filtering page of this model) shows how token-entropy filtering changes entropy,
# CKA and the selected sets. Here the question is whether it matters for the drafter: each selection
# method's set chosen from all positions against the set chosen from the filtered positions, each
# trained and scored exactly like the speed table (same drafters and offline acceptance, read from
# the cache), compared by the paired difference of their acceptance length.
# Table: {download}`tables/04b_filtering_drafters.csv`.

# %% tags=["parameters", "hide-input"]
model = "smollm2-135m"  # embedded name, local directory or HF id
dataset = "sharegpt"  # corpus of the statistics that select the layer sets
max_tokens = None  # None: the profile's analysis token budget
profile = "default"  # smoke | default | long | paper
seed = 0  # statistics controls and the random layer sets
device = "auto"  # auto, cpu, cuda, cuda:N

# %% tags=["hide-input", "hide-output"]
# Check the parameters first (a wrong type or value stops here with a clear message), then load the target.
import matplotlib.pyplot as plt
from myst_nb import glue

from wavesurf.book import paper, plots, tables
from wavesurf.book.notebook import open_notebook

P, target = open_notebook(model, dataset, max_tokens, profile, seed, device)

# %% tags=["hide-output"]
sets, settings, table = paper.profile_speed_table(target, P)
filter_name = P.profile_spec.analysis.selection_filter

# %%
# NBVAL_CHECK_OUTPUT
print(f"{target.name}: methods compared with and without the filter {filter_name}:", ", ".join(settings.methods))

# %% tags=["hide-output"]
# each method with and without filtering; a set chosen by both keeps one drafter (same set, no difference)
rows = table.filtering_rows(settings.methods)
paper.write_csv(rows, "tables/04b_filtering_drafters.csv")

# %% tags=["remove-input"]
from IPython.display import HTML

HTML(tables.html_table(rows, headers={"layer_ids": "ids, all positions", "filtered_layer_ids": "ids, filtered",
                                     "same_set": "same set", "tau": "τ, all", "filtered_tau": "τ, filtered",
                                     "diff": "Δ filtered − all", "diff_lo": "Δ lo", "diff_hi": "Δ hi"},
                      floatfmt=".3f"))

# %% tags=["hide-input"]
fig, ax = plt.subplots(figsize=(5.6, 0.45 * len(rows) + 1.4))
plots.plot_paired_differences(rows, ax=ax, label_key="method",
                              xlabel=f"paired Δτ, filtered ({filter_name}) − all positions")
fig.tight_layout()
plots.save_figure(fig, "figures/04b_filtering_drafters.png")
glue("fig_filter_tau", fig, display=False)
plt.close(fig)

# %% tags=["remove-input"]
changed = [r for r in rows if not r["same_set"]]
glue("filter_name", filter_name, display=False)
glue("n_methods", len(rows), display=False)
glue("n_same_set", len(rows) - len(changed), display=False)
glue("n_filter_better", sum(1 for r in changed if r["verdict"] == "better"), display=False)
glue("n_filter_worse", sum(1 for r in changed if r["verdict"] == "worse"), display=False)
glue("n_filter_noise", sum(1 for r in changed if r["verdict"] == "within noise"), display=False)
glue("draft_len", table.info["draft_len"], display=False)

# %% [markdown]
# ```{glue:figure} fig_filter_tau
# Paired difference of offline acceptance length (draft length {glue:text}`draft_len`) between the
# drafter reading each method's set chosen from the positions kept by the filter
# {glue:text}`filter_name` and the drafter reading the set chosen from all positions (95% bootstrap
# interval resampling held-out sequences and training seeds, seeds paired; one interval per method,
# not adjusted over the methods). **What to see:** an interval entirely right of
# zero means filtering picked a better set for the drafter; methods where both statistics pick the
# same set sit at zero without an interval.
# ```
#
# For {glue:text}`n_same_set` of the {glue:text}`n_methods` methods filtering does not change the
# selected set. Where it does, the filtered set is better beyond the interval for
# {glue:text}`n_filter_better`, worse for {glue:text}`n_filter_worse`, and within noise for
# {glue:text}`n_filter_noise` methods.
