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
# # Aggregate entropy of layer sets
#
# An EAGLE-3 drafter reads the concatenation of k layers. Its information is the aggregate entropy
# of the concatenated, unit-trace-scaled features ({ref}`methods-aggregate`): high when the layers
# are individually informative *and* different from each other. With α = 2 it has an exact closed
# form from purities and CKA, cheap enough to score every set. Redundancy is what a set repeats:
# the entropy the layers would have if independent minus their joint entropy.
# These statistics use the token-entropy filter the selection uses ({ref}`methods-filtering`).

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
from wavesurf.book import paper, plots, variants
from wavesurf.book.notebook import open_notebook, target_line
from wavesurf.stats.layer_sets import all_subsets

P, target = open_notebook(model, dataset, max_tokens, profile, seed, device)

# %%
# NBVAL_CHECK_OUTPUT
print(target_line(target))

# %% tags=["hide-output"]
stats = variants.profile_stats(target, P, ["selection"])["selection"]
ids = stats.layer_ids
pair_s2 = stats.pair_matrix()
cand = [i for i in ids if i >= 1]  # drafter candidates: block outputs 1..N
sets = all_subsets(cand, 3)
s2_all = stats.aggregate_entropy2(sets)
red_all = stats.redundancy2(sets)
default_ids = target.default_layer_ids()
chosen = {m: ws.select_layers(stats, k=3, method=m).layer_ids for m in ("aggregate", "combined")}
named = {"default " + paper.fmt_ids(default_ids): default_ids,
         **{f"{m} {paper.fmt_ids(v)}": v for m, v in chosen.items()}}
s2_named = {n: float(stats.aggregate_entropy2([v])[0]) for n, v in named.items()}
red_named = {n: float(stats.redundancy2([v])[0]) for n, v in named.items()}
s2_spans = red_spans = None
if stats.has_intervals:  # 95% intervals of the named sets, shaded in the distributions
    s2_jk, red_jk = stats.aggregate_entropy2_interval(list(named.values())), stats.redundancy2_interval(list(named.values()))
    s2_spans = {n: (s2_jk.low[i], s2_jk.high[i]) for i, n in enumerate(named)}
    red_spans = {n: (red_jk.low[i], red_jk.high[i]) for i, n in enumerate(named)}

# %% tags=["hide-input"]
fig = plt.figure(figsize=(15, 4.6))
ax0 = fig.add_subplot(1, 3, 1)
plots.plot_matrix(pair_s2, ids, "S₂ of the pair (nats)", ax=ax0, title="aggregate entropy of layer pairs",
                  marks={"default": default_ids, "aggregate": chosen["aggregate"]})
ax1 = fig.add_subplot(1, 3, 2)
plots.plot_distribution(s2_all, "aggregate entropy S₂ of the 3-layer set (nats)", marks=s2_named, ax=ax1,
                        title=f"all {len(sets):,} sets of 3 block outputs", spans=s2_spans)
ax2 = fig.add_subplot(1, 3, 3)
plots.plot_distribution(red_all, "redundancy (α=2, nats)", marks=red_named, ax=ax2, title="redundancy of the same sets",
                        spans=red_spans)
fig.tight_layout()
plots.save_figure(fig, "figures/03_aggregate.png")
glue("fig_aggregate", fig, display=False)
plt.close(fig)

# %% tags=["remove-input"]
dname = next(iter(named))
rank, frac = paper.rank_of(s2_all, s2_named[dname])
best = sets[int(np.argmax(s2_all))]
glue("n_sets", f"{len(sets):,}", display=False)
glue("n_tokens", f"{stats.main.n_tokens:,}", display=False)
glue("filter", stats.meta["filter"]["filter"], display=False)
glue("default_ids", paper.fmt_ids(default_ids), display=False)
glue("default_s2", s2_named[dname], display=False)
glue("default_rank", rank, display=False)
glue("default_top_percent", 100 * frac, display=False)
glue("best_ids", paper.fmt_ids(best), display=False)
glue("best_s2", float(s2_all.max()), display=False)
glue("median_s2", float(np.median(s2_all)), display=False)
glue("aggregate_ids", paper.fmt_ids(chosen["aggregate"]), display=False)
glue("combined_ids", paper.fmt_ids(chosen["combined"]), display=False)
glue("default_red2", red_named[dname], display=False)
glue("median_red2", float(np.median(red_all)), display=False)
glue("max_pair_s2", float(np.max(pair_s2)), display=False)
for m in ("aggregate", "combined"):  # each selected set minus the default, paired over resamples
    delta = float(s2_named[f"{m} {paper.fmt_ids(chosen[m])}"] - s2_named[dname])
    jk = stats.aggregate_entropy2_difference(chosen[m], default_ids) if stats.has_intervals else None
    glue(f"{m}_minus_default", paper.interval_text(delta, jk, "+.3f", verdict=True), display=False)
glue("interval_note", paper.interval_note(stats), display=False)
if stats.has_cross_covariance:  # exact alpha=1 redundancy (needs the cross-layer covariances)
    r1 = {n: float(stats.redundancy(v, alpha=1.0)) for n, v in named.items()}
    glue("red1_sentence", "Their exact α = 1 redundancies are " + ", ".join(f"{v:.3f} nats ({n})" for n, v in r1.items())
         + ".", display=False)
else:
    glue("red1_sentence", "(The exact α = 1 redundancy needs the exact CKA estimator, which this profile does not "
         "use for the filtered statistics.)", display=False)

# %% [markdown]
# ```{glue:figure} fig_aggregate
# Left: α = 2 aggregate entropy of every layer pair (diagonal: the single layer), circles the pairs
# of the default set, squares those of the maximum-aggregate-entropy set. Middle: the distribution
# of S₂ over all {glue:text}`n_sets` sets of three block outputs, with the default and selected
# sets marked (shaded: their 95% intervals over groups of conversations). Right: their α = 2
# redundancy. Filter {glue:text}`filter`,
# {glue:text}`n_tokens` positions. **What to see:** which pairs (bright) carry the most joint
# information, and how far the default set is from the top of the distribution (its rank is given
# below).
# ```
#
# Of {glue:text}`n_sets` three-layer sets, the default {glue:text}`default_ids` has S₂ =
# {glue:text}`default_s2:.3f` nats, rank {glue:text}`default_rank` ({glue:text}`default_top_percent:.1f` %
# of sets score higher); the median set has
# {glue:text}`median_s2:.3f` nats and the best set {glue:text}`best_ids` reaches
# {glue:text}`best_s2:.3f` nats. The maximum-aggregate-entropy method (re-ranked by α = 1) picks
# {glue:text}`aggregate_ids`; the combined entropy/CKA score picks {glue:text}`combined_ids`.
# Against the default, their S₂ differs by {glue:text}`aggregate_minus_default` and
# {glue:text}`combined_minus_default` nats. {glue:text}`interval_note`
# The default set's α = 2 redundancy is {glue:text}`default_red2:.3f` nats (median over sets
# {glue:text}`median_red2:.3f`). {glue:text}`red1_sentence`
