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
# trained and measured exactly like the speed table (same drafters, read from the cache).
# Table: {download}`tables/04b_filtering_drafters.csv`.

# %% tags=["parameters", "hide-input"]
model = "smollm2-135m"  # embedded name, local directory or HF id
dataset = "sharegpt"  # corpus of the statistics that select the layer sets
max_tokens = None  # None: the profile's analysis token budget
profile = "default"  # smoke | default | paper
seed = 0  # statistics controls and the random layer sets
device = "auto"  # auto, cpu, cuda, cuda:N

# %% tags=["hide-input"]
# Check the parameters first: a wrong type or value stops here with a clear message.
import matplotlib.pyplot as plt
from myst_nb import glue

import wavesurf as ws
from wavesurf import paper, plots

P = paper.check_parameters(model, dataset, max_tokens, profile, seed, device)
ws.models.configure_torch()  # WAVESURF_THREADS, TF32 off
plots.use_style()

# %% tags=["hide-output"]
target = ws.load_target(P.model, device=P.device)
sets, settings, table = paper.speed_table(target, P)
filter_name = P.profile_dict["analysis"]["selection_filter"]

# %%
# NBVAL_CHECK_OUTPUT
print(f"{target.name}: methods compared with and without the filter {filter_name}:", ", ".join(settings.methods))

# %% tags=["hide-output"]
# each method with and without filtering; a set chosen by both keeps one drafter (aliases)
names = {s.name: s for s in sets}
for s in sets:
    for alias in s.aliases:
        names[alias] = s
rows = []
for method in settings.methods:
    for variant, name in (("all positions", method), (f"filtered ({filter_name})", method + "+filter")):
        s = names[name]
        for r in table.summary:
            if r["layer_set"] == s.name:
                rows.append({"method": method, "statistics": variant, "layer_ids": r["layer_ids"],
                             "dataset": r["dataset"], "tau_mean": r["tau_mean"], "tau_std": r["tau_std"],
                             "speedup_mean": r["speedup_mean"]})
paper.write_csv(rows, "tables/04b_filtering_drafters.csv")

# %% tags=["remove-input"]
from IPython.display import HTML

HTML(plots.html_table(rows, headers={"layer_ids": "ids (vLLM)", "tau_mean": "τ mean", "tau_std": "τ std",
                                     "speedup_mean": "speedup"}, floatfmt=".3f"))

# %% tags=["hide-input"]
first = settings.datasets[0]
fig, ax = plt.subplots(figsize=(5.6, 3.2))
methods = list(settings.methods)
for j, variant in enumerate(["all positions", f"filtered ({filter_name})"]):
    vals = [next(float(r["tau_mean"]) for r in rows if r["method"] == m and r["statistics"] == variant
                 and r["dataset"] == first) for m in methods]
    ax.bar([i + (j - 0.5) * 0.38 for i in range(len(methods))], vals, width=0.38, label=variant)
ax.set_xticks(range(len(methods)))
ax.set_xticklabels(methods)
ax.set_ylabel("acceptance length τ (tokens/forward)")
ax.set_xlabel("selection method")
ax.axhline(next(float(r["tau_mean"]) for r in table.summary if r["layer_set"] == "default" and r["dataset"] == first),
           color="black", ls="--", lw=1, label="default rule")
ax.legend(fontsize=8)
ax.set_title(first)
fig.tight_layout()
plots.save_figure(fig, "figures/04b_filtering_drafters.png")
glue("fig_filter_tau", fig, display=False)
plt.close(fig)

# %% tags=["remove-input"]
pairs = [(next(float(r["tau_mean"]) for r in rows if r["method"] == m and r["statistics"] == "all positions"
               and r["dataset"] == first),
          next(float(r["tau_mean"]) for r in rows if r["method"] == m and r["statistics"] != "all positions"
               and r["dataset"] == first)) for m in methods]
glue("filter_name", filter_name, display=False)
glue("n_methods", len(methods), display=False)
glue("n_filter_better", sum(1 for a, b in pairs if b > a), display=False)
glue("n_same_set", sum(1 for m in methods if names[m] is names[m + "+filter"]), display=False)
glue("mean_delta", sum(b - a for a, b in pairs) / len(pairs), display=False)
glue("first_dataset", first, display=False)

# %% [markdown]
# ```{glue:figure} fig_filter_tau
# Acceptance length on {glue:text}`first_dataset` of the drafter reading each method's set, chosen
# from all positions or from the positions kept by the filter {glue:text}`filter_name` (mean over
# seeds; dashed: the default rule). **What to see:** whether the filtered statistics pick sets that
# accept more tokens; bars of equal height where both pick the same set.
# ```
#
# For {glue:text}`n_same_set` of the {glue:text}`n_methods` methods filtering does not change the
# selected set. Filtered statistics give a higher mean τ for {glue:text}`n_filter_better` of
# {glue:text}`n_methods` methods; the mean change is {glue:text}`mean_delta:+.3f` tokens per forward.
