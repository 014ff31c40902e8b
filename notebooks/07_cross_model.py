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
# # Across models
#
# The same statistics for every model whose results for this profile are in the results cache,
# against relative depth (layer id / N) so models of different depth line up.

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

from wavesurf.book import paper, plots, tables, variants
from wavesurf.book.notebook import open_notebook, target_line
from wavesurf.select import cross_model_rows

P, target = open_notebook(model, dataset, max_tokens, profile, seed, device)

# %%
# NBVAL_CHECK_OUTPUT
print(target_line(target))

# %% tags=["hide-output"]
variants.profile_stats(target, P, ["base", "selection"])  # this model's results are in the cache
settings = variants.analysis_variants(P)
bases = {s.meta["model"]: s for s in variants.cached_results(settings["base"])}
selections = {s.meta["model"]: s for s in variants.cached_results(settings["selection"])}
models = sorted(bases)

# %%
# NBVAL_CHECK_OUTPUT
print("this model:", target.name, "| included:", target.name in models)

# %% tags=["hide-input"]
from wavesurf.stats.cka import cka_to_last

fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
curves = {m: s.depth_curves() for m, s in bases.items()}
plots.plot_depth([(f"{m} (N={s.n_layers})", np.array(s.layer_ids) / s.n_layers, curves[m]["S1_norm"],
                   curves[m].get("S1_norm_band")) for m, s in bases.items()],
                 "normalised S₁", ax=axes[0], xlabel="relative depth (layer id / N)")
plots.plot_depth([(m, np.array(s.layer_ids) / s.n_layers, cka_to_last(s.cka), s.band("cka_to_last"))
                  for m, s in bases.items()],
                 "CKA(i, N) with the last block", ax=axes[1], xlabel="relative depth (layer id / N)")
fig.tight_layout()
plots.save_figure(fig, "figures/07_cross_model.png")
glue("fig_cross", fig, display=False)
plt.close(fig)

# %% tags=["remove-input"]
from IPython.display import HTML

table = cross_model_rows(bases, selections, methods=("default", "aggregate", "combined"))
paper.write_csv(table, "tables/07_cross_model.csv")
HTML(tables.html_table(table))

# %% tags=["remove-input"]
glue("n_models", len(models), display=False)
glue("models", ", ".join(models), display=False)

# %% [markdown]
# ```{glue:figure} fig_cross
# Normalised α = 1 entropy (left) and CKA with the last block (right) against relative depth for
# {glue:text}`n_models` model(s) with cached results ({glue:text}`models`); light bands are 95%
# intervals over groups of conversations where a run has them. **What to see:** whether
# the entropy profile and the turnover of the representation happen at the same relative depth in
# different models — where they do, a relative-depth rule like `[2, N//2, N-3]` transfers.
# ```
#
# The table lists each model's selected sets in vLLM ids and as relative depth (id / N).
