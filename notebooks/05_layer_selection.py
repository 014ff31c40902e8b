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
# # Layer selection
#
# Every selection method of {ref}`methods-selection` applied to the same statistics (token-entropy
# filtered), side by side with the default EAGLE-3 rule `[2, N//2, N-3]`. Layer ids are in the vLLM
# convention; the SGLang/SpecForge column gives the same tensors as "output of block k" ids.
# The table is also written as tidy CSV ({download}`tables/05_layer_selection.csv`).

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
from myst_nb import glue

from wavesurf.book import paper, plots, tables, variants
from wavesurf.book.notebook import open_notebook, target_line
from wavesurf.select import selection_rows

P, target = open_notebook(model, dataset, max_tokens, profile, seed, device)

# %%
# NBVAL_CHECK_OUTPUT
print(target_line(target))

# %% tags=["hide-output"]
selection_variant = variants.selection_variant_names(P)[1]  # the profile's analysis.selection_positions
stats = variants.profile_stats(target, P, [selection_variant])[selection_variant]
rows = selection_rows(stats, k=3)
paper.write_csv(rows, "tables/05_layer_selection.csv")
by = {r["method"]: r for r in rows}

# %% tags=["remove-input"]
from IPython.display import HTML

iv_cols = (["delta_aggregate_entropy2_low", "delta_aggregate_entropy2_high", "redundancy2_low", "redundancy2_high",
            "jackknife_agreement"] if stats.has_intervals else [])
HTML(tables.html_table(
    rows, ["method", "layer_ids", "sglang_layer_ids", "mean_entropy_nats", "mean_pairwise_cka", "aggregate_entropy2_nats",
           "redundancy2_nats", "delta_aggregate_entropy2_vs_default", *iv_cols],
    headers={"layer_ids": "ids (vLLM)", "sglang_layer_ids": "ids (SGLang)", "mean_entropy_nats": "mean S₁ (nats)",
             "mean_pairwise_cka": "mean CKA", "aggregate_entropy2_nats": "S₂ of set (nats)",
             "redundancy2_nats": "R₂ (nats)", "delta_aggregate_entropy2_vs_default": "ΔS₂ vs default (nats)",
             "delta_aggregate_entropy2_low": "ΔS₂ 95% low", "delta_aggregate_entropy2_high": "ΔS₂ 95% high",
             "redundancy2_low": "R₂ 95% low", "redundancy2_high": "R₂ 95% high",
             "jackknife_agreement": "jackknife agreement"}))

# %% tags=["remove-input"]
HTML(tables.html_table(rows, ["method", "reason"]))

# %% tags=["hide-input"]
sets = {r["method"]: r["layer_ids"] for r in rows}
fig, ax = plt.subplots(figsize=(7.5, 2.8))
plots.plot_layer_sets(sets, target.n_layers, ax=ax, compartments=stats.compartments)
ax.set_title("selected layer sets (shaded: CKA compartments)", pad=14)
fig.tight_layout()
plots.save_figure(fig, "figures/05_sets.png")
glue("fig_sets", fig, display=False)
plt.close(fig)

# %%
# NBVAL_CHECK_OUTPUT
print("default rule (vLLM ids):", by["default"]["layer_ids"], "| SGLang ids:", by["default"]["sglang_layer_ids"])

# %% tags=["remove-input"]
for m, r in by.items():
    glue(f"ids_{m}", paper.fmt_ids(r["layer_ids"]), display=False)
    glue(f"s2_{m}", float(r["aggregate_entropy2_nats"]), display=False)
    glue(f"cka_{m}", float(r["mean_pairwise_cka"]), display=False)
others = [m for m in by if m != "default"]
best = max(others, key=lambda m: by[m]["aggregate_entropy2_nats"])
glue("n_methods", len(others), display=False)
glue("n_differ", sum(not by[m]["same_as_default"] for m in others), display=False)
glue("best_method", best, display=False)
best_jk = stats.aggregate_entropy2_difference(sets[best], sets["default"]) if stats.has_intervals else None
glue("best_gain", paper.interval_text(by[best]["delta_aggregate_entropy2_vs_default"], best_jk, "+.3f", verdict=True),
     display=False)
if stats.has_intervals:
    glue("recurrence_sentence", "Leaving out one group of conversations at a time, each method picks the same set in "
         + ", ".join(f"{100 * by[m]['jackknife_agreement']:.0f} % ({m})" for m in others) + " of the replicates "
         "(aggregate compared on its α = 2 ranking, as a replicate has no cross-covariances for the α = 1 re-ranking): "
         "a method whose pick recurs rarely is choosing among sets its statistics cannot tell apart. "
         + paper.jackknife_agreement_note(stats), display=False)
else:
    glue("recurrence_sentence", paper.interval_note(stats), display=False)
glue("n_tokens", f"{stats.main.n_tokens:,}", display=False)
glue("filter", stats.meta["filter"]["filter"], display=False)
glue("positions", "assistant tokens of the target's own answers (the positions a drafter serves)"
     if selection_variant.startswith("served") else f"every position of {stats.meta['dataset']}", display=False)

# %% [markdown]
# ```{glue:figure} fig_sets
# The layer ids each method selects (k = 3) on {glue:text}`n_tokens` positions kept by the filter
# {glue:text}`filter` among {glue:text}`positions`, over the CKA compartments. **What to see:** which compartments each method
# draws from, compared with the default rule's spread over depth.
# ```
#
# The default rule reads {glue:text}`ids_default` (S₂ = {glue:text}`s2_default:.3f` nats, mean
# pairwise CKA {glue:text}`cka_default:.3f`). Entropy alone picks {glue:text}`ids_entropy`, maximum
# aggregate entropy {glue:text}`ids_aggregate` (S₂ = {glue:text}`s2_aggregate:.3f` nats), one layer
# per CKA compartment {glue:text}`ids_cka` and the combined score {glue:text}`ids_combined`
# (mean pairwise CKA {glue:text}`cka_combined:.3f`). {glue:text}`n_differ` of the
# {glue:text}`n_methods` methods differ from the default; the largest aggregate-entropy gain over
# it is {glue:text}`best_gain` nats ({glue:text}`best_method`). {glue:text}`recurrence_sentence`
# Whether these sets also make better drafters is measured in the drafter chapters.
