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
# # Statistics on the positions a drafter serves
#
# The statistics of the other pages are computed on every position of human ShareGPT text: user
# turns, the assistant's turns and the chat template's tokens alike. A drafter serves none of
# those: it drafts the target's **own** answers. Here the same statistics are computed on the
# assistant tokens of the target's own greedy answers (the answers the drafters of this model
# train on; template and special tokens left out), side by side with the statistics of every
# position, and every criterion is checked against the trained heads on both. The first table
# shows which roles each token-entropy filter keeps on the human text.
# Tables: {download}`tables/04c_role_mix.csv`, {download}`tables/04c_served_selection.csv`,
# {download}`tables/04c_served_criteria.csv`.

# %% tags=["parameters", "hide-input"]
model = "smollm2-135m"  # embedded name, local directory or HF id
dataset = "sharegpt"  # corpus of the all-positions statistics
max_tokens = None  # None: the profile's analysis token budget
profile = "default"  # smoke | default | long | paper
seed = 0  # statistics controls and the random layer sets
device = "auto"  # auto, cpu, cuda, cuda:N

# %% tags=["hide-input", "hide-output"]
# Check the parameters first (a wrong type or value stops here with a clear message), then load the target.
import matplotlib.pyplot as plt
import numpy as np
from myst_nb import glue

from wavesurf.book import paper, plots, tables, variants
from wavesurf.book.notebook import open_notebook
from wavesurf.criteria import criteria_sentence
from wavesurf.select import selection_rows
from wavesurf.stats.filtering import role_shares

P, target = open_notebook(model, dataset, max_tokens, profile, seed, device)

# %% tags=["hide-output"]
# every position of the statistics corpus (cached by the earlier pages), then the served positions
# (the target's answers are cached by the drafter pages; one capture for both served variants)
text_names = ["base", *[n for n in variants.sweep_variant_names(P) if n != "base"], "selection"]
text = variants.profile_stats(target, P, list(dict.fromkeys(text_names)))
served = variants.profile_stats(target, P, list(variants.SERVED_VARIANTS))
selection_from = variants.selection_variant_names(P)

# %%
# NBVAL_CHECK_OUTPUT
print(f"{target.name}: served positions = assistant tokens of {served['served'].meta['dataset'].split('#')[0]}; "
      f"the profile selects layer sets from the {'served' if selection_from[0] == 'served' else 'all'}-positions statistics")

# %% tags=["hide-output"]
ROLES = ("user", "assistant", "template", "system", "text")
role_rows = []
for name, stats in [*text.items(), *served.items()]:
    f = stats.meta["filter"]
    shares = role_shares(f, "kept")
    row = {"statistics": "served" if name.startswith("served") else "all positions", "variant": name,
           "filter": f["filter"], "kept_tokens": f["kept_tokens"]}
    row.update({f"{r}_share": round(shares.get(r, 0.0), 4) if shares else None for r in ROLES})
    role_rows.append(row)
role_rows = [{k: v for k, v in r.items() if any(x.get(k) for x in role_rows)} for r in role_rows]  # roles present
paper.write_csv(role_rows, "tables/04c_role_mix.csv")

# %% tags=["remove-input"]
from IPython.display import HTML

HTML(tables.html_table([{k: "–" if v is None else v for k, v in r.items()} for r in role_rows],  # – : not counted
                       headers={"kept_tokens": "kept positions", **{f"{r}_share": f"{r} share" for r in ROLES}},
                       floatfmt=".3f"))

# %% tags=["hide-input"]
# normalised S1 across depth, all positions against served positions (95% bands over conversation groups)
fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), gridspec_kw={"width_ratios": [1.4, 1, 1]})
ca, cs = text["base"].depth_curves(), served["served"].depth_curves()
ids = text["base"].layer_ids
plots.plot_depth([("all positions", ids, ca["S1_norm"], ca.get("S1_norm_band")),
                  ("served positions", ids, cs["S1_norm"], cs.get("S1_norm_band"))],
                 "normalised S₁", ax=axes[0], styles=[{}, {"ls": "--", "marker": "s"}])
axes[0].set_xlabel("layer id (vLLM)")
axes[0].set_title("matrix entropy across depth", pad=10)
plots.plot_cka_heatmap(text["base"].main, ax=axes[1], title="CKA, all positions")
plots.plot_cka_heatmap(served["served"].main, ax=axes[2], title="CKA, served positions")
fig.tight_layout()
plots.save_figure(fig, "figures/04c_served_positions.png")
glue("fig_served", fig, display=False)
plt.close(fig)

# %% tags=["hide-output"]
# the sets each selection method picks from the filtered statistics of either kind of position
pick_all = {r["method"]: r for r in selection_rows(text["selection"], k=3)}
pick_served = {r["method"]: r for r in selection_rows(served["served:selection"], k=3)}
selection_table = [{"method": m, "all_positions": " ".join(map(str, pick_all[m]["layer_ids"])),
                    "served_positions": " ".join(map(str, pick_served[m]["layer_ids"])),
                    "same_set": pick_all[m]["layer_ids"] == pick_served[m]["layer_ids"]}
                   for m in pick_all if m in pick_served]
paper.write_csv(selection_table, "tables/04c_served_selection.csv")

# %% tags=["remove-input"]
HTML(tables.html_table(selection_table, headers={"all_positions": "ids, all positions (vLLM)",
                                                 "served_positions": "ids, served positions (vLLM)",
                                                 "same_set": "same set"}))

# %% tags=["hide-output"]
# every criterion on both kinds of statistics against the heads the drafter pages trained (cached)
sets, settings, table = paper.profile_speed_table(target, P, progress=False)
trained = [s for s in sets if s.name in table.runs]
criteria_rows = []
for label, stats in (("all positions", text["selection"]), ("served positions", served["served:selection"])):
    _, rows = paper.criteria_against_heads(stats, trained, table, settings, seed)
    criteria_rows += [{"statistics": label, **r} for r in rows]
paper.write_csv(criteria_rows, "tables/04c_served_criteria.csv")

# %% tags=["remove-input"]
HTML(tables.html_table([r for r in criteria_rows if np.isfinite(r["rho"])],  # criteria with a correlation
                       ["statistics", "criterion", "sets", "rho", "agrees"],
                       headers={"rho": "ρ (Spearman, 95% CI)"}, intervals={"rho": ("rho_lo", "rho_hi")}, floatfmt="+.2f"))

# %% tags=["remove-input"]
base_mix = role_shares(text["base"].meta["filter"], "kept")
sel_mix = role_shares(text["selection"].meta["filter"], "kept")
glue("n_all", f"{text['base'].n_tokens:,}", display=False)
glue("n_served", f"{served['served'].n_tokens:,}", display=False)
glue("selection_filter", text["selection"].meta["filter"]["filter"], display=False)
if base_mix and sel_mix:
    glue("role_sentence", f"Of every position of the human text, {100 * base_mix.get('assistant', 0):.0f} % are "
         f"assistant tokens; among the positions the filter {text['selection'].meta['filter']['filter']} keeps, "
         f"{100 * sel_mix.get('assistant', 0):.0f} % are, and {100 * sel_mix.get('user', 0):.0f} % are user tokens.",
         display=False)
else:
    glue("role_sentence", "This cached analysis was made before the roles of kept positions were counted; "
         "clear its cache entry to see them.", display=False)
diff = cs["S1_norm"] - ca["S1_norm"]
if text["base"].has_intervals and served["served"].has_intervals:  # independent samples: the errors add
    # normalised-entropy standard errors (each curve's S1 error over its own maximum entropy)
    se = np.hypot(text["base"].interval("entropy").se * ca["S1_norm"] / ca["S1"],
                  served["served"].interval("entropy").se * cs["S1_norm"] / cs["S1"])
    z = diff / np.maximum(se, 1e-12)
    beyond = int(np.sum(np.abs(z) > 1.96))
    glue("entropy_sentence", f"Served positions have {'higher' if np.mean(diff) > 0 else 'lower'} normalised entropy "
         f"on average ({np.mean(diff):+.3f}); the two curves differ beyond about two standard errors at {beyond} of "
         f"{len(ids)} layer ids, most at id {ids[int(np.argmax(np.abs(diff)))]} ({diff[int(np.argmax(np.abs(diff)))]:+.3f}).",
         display=False)
else:
    glue("entropy_sentence", f"Served positions have {'higher' if np.mean(diff) > 0 else 'lower'} normalised entropy on "
         f"average ({np.mean(diff):+.3f}), largest difference at id {ids[int(np.argmax(np.abs(diff)))]}; "
         + paper.interval_note(served["served"]), display=False)
glue("compartments_all", len(text["base"].compartments), display=False)
glue("compartments_served", len(served["served"].compartments), display=False)
glue("n_same", sum(r["same_set"] for r in selection_table), display=False)
glue("n_methods", len(selection_table), display=False)
glue("selects_from", "served" if selection_from[0] == "served" else "all", display=False)
glue("criteria_all", criteria_sentence([r for r in criteria_rows if r["statistics"] == "all positions"]), display=False)
glue("criteria_served", criteria_sentence([r for r in criteria_rows if r["statistics"] == "served positions"]),
     display=False)

# %% [markdown]
# ```{glue:figure} fig_served
# Left: normalised α = 1 matrix entropy across depth on every position of the human text
# ({glue:text}`n_all` positions) and on the assistant tokens of the target's own answers
# ({glue:text}`n_served` positions), with 95% bands over groups of conversations. Middle and right:
# linear CKA between every pair of layer ids on each, compartments boxed. **What to see:** where the
# curves part, the positions a drafter serves carry a different spectrum than the text the paper
# measures; the heatmaps show whether the compartments move.
# ```
#
# {glue:text}`role_sentence` {glue:text}`entropy_sentence` The all-positions statistics split the
# depth into {glue:text}`compartments_all` compartments, the served ones into
# {glue:text}`compartments_served`. With the filter {glue:text}`selection_filter`,
# {glue:text}`n_same` of {glue:text}`n_methods` selection methods pick the same set from both. This
# profile selects the layer sets of the drafter pages from the {glue:text}`selects_from`-positions
# statistics (`analysis.selection_positions`).
#
# **Which statistics predict the drafters?** On all positions: {glue:text}`criteria_all` On served
# positions: {glue:text}`criteria_served`
