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
# # EAGLE-3 speed table
#
# Do the layer sets chosen from the statistics make better drafters than the default rule
# `[2, N//2, N-3]`? One EAGLE-3 head per layer set and training seed, all trained on the same
# captured tokens of the ShareGPT training split with the same budget, then measured by lossless
# speculative decoding (T = 0, batch size 1) against HF greedy `generate` in the same run
# ({ref}`methods-drafter`). Controls: the top three layers, three evenly spaced layers, the single
# top layer (EAGLE-1 style) and random sets. Tables: {download}`tables/06_speed_table.csv` (one row
# per set, seed and benchmark), {download}`tables/06_speed_table_summary.csv` and
# {download}`tables/06_tau_vs_tokens.csv`.

# %% tags=["parameters", "hide-input"]
model = "smollm2-135m"  # embedded name, local directory or HF id
dataset = "sharegpt"  # corpus of the statistics that select the layer sets
max_tokens = None  # None: the profile's analysis token budget
profile = "default"  # smoke | default | paper (drafter budgets: wavesurf.profiles)
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

# %%
# NBVAL_CHECK_OUTPUT
print(f"{target.name}: N = {target.n_layers}, default EAGLE-3 layers (vLLM ids) {target.default_layer_ids()}")

# %% tags=["hide-output"]
sets, settings, table = paper.speed_table(target, P)
paper.write_csv(table.rows, "tables/06_speed_table.csv")
paper.write_csv(table.summary, "tables/06_speed_table_summary.csv")
paper.write_csv(table.curve, "tables/06_tau_vs_tokens.csv")
datasets = list(settings.datasets)

# %% tags=["remove-input"]
from IPython.display import HTML

HTML(plots.html_table(
    table.summary, ["layer_set", "group", "layer_ids", "dataset", "seeds", "tau_mean", "tau_std", "speedup_mean",
                    "speedup_std"],
    headers={"layer_set": "layer set", "layer_ids": "ids (vLLM)", "tau_mean": "τ mean", "tau_std": "τ std",
             "speedup_mean": "speedup mean", "speedup_std": "speedup std"}, floatfmt=".3f"))

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(11, 0.32 * len(sets) * len(datasets) + 1.6), sharey=True)
plots.plot_tau_by_set(table.summary, datasets, ax=axes[0])
plots.plot_tau_by_set(table.summary, datasets, ax=axes[1], metric="speedup",
                      xlabel="speedup over HF greedy generate (tokens/s ratio)")
fig.tight_layout()
plots.save_figure(fig, "figures/06_speed_table.png")
glue("fig_speed", fig, display=False)
plt.close(fig)

fig, ax = plt.subplots(figsize=(4.6, 3.2))
plots.plot_tau_curve(table.curve, ax=ax)
ax.set_title(f"default set {target.default_layer_ids()}, {datasets[0]}")
fig.tight_layout()
plots.save_figure(fig, "figures/06_tau_vs_tokens.png")
glue("fig_curve", fig, display=False)
plt.close(fig)

# %%
# NBVAL_CHECK_OUTPUT
print("layer sets trained:", len(sets), "| lossless (T=0) on every prompt:",
      all(r["lossless"].split("/")[0] == r["lossless"].split("/")[1] for r in table.rows))

# %% tags=["remove-input"]
first = datasets[0]
by = {r["layer_set"]: r for r in table.summary if r["dataset"] == first}
best = table.best(first)
train = settings.train
glue("n_sets", len(sets), display=False)
glue("n_seeds", len(settings.seeds), display=False)
glue("n_drafters", len({r["drafter"] for r in table.rows}), display=False)
glue("train_tokens", f"{train['train_tokens']:,}", display=False)
glue("ttt_steps", train["ttt_steps"], display=False)
glue("draft_vocab", f"{train['draft_vocab_size']:,}", display=False)
glue("train_seconds", sum(float(r["train_seconds"]) for r in table.rows if r["dataset"] == first)
     / max(1, sum(1 for r in table.rows if r["dataset"] == first)), display=False)
glue("bench_prompts", settings.bench["n_prompts"], display=False)
glue("bench_tokens", settings.bench["max_new_tokens"], display=False)
glue("bench_mode", settings.bench.get("mode", "chain"), display=False)
glue("first_dataset", first, display=False)
glue("best_set", best["layer_set"], display=False)
glue("best_ids", best["layer_ids"], display=False)
glue("best_tau", float(best["tau_mean"]), display=False)
glue("best_speedup", float(best["speedup_mean"]), display=False)
glue("default_tau", float(by["default"]["tau_mean"]), display=False)
glue("default_speedup", float(by["default"]["speedup_mean"]), display=False)
glue("n_beat_default", sum(1 for n, r in by.items() if n != "default" and r["tau_mean"] > by["default"]["tau_mean"]),
     display=False)
glue("n_lossless", sum(int(r["lossless"].split("/")[0]) for r in table.rows), display=False)
glue("n_runs", sum(int(r["lossless"].split("/")[1]) for r in table.rows), display=False)

# %% [markdown]
# ```{glue:figure} fig_speed
# Acceptance length τ (left) and wall-clock speedup over HF greedy `generate` (right) per layer set
# and benchmark: bars are means over {glue:text}`n_seeds` training seeds, whiskers min-max; the
# default set is outlined. **What to see:** whether any selected set sits clearly to the right of
# the default beyond the seed spread, and whether the controls (random, last layers) are worse.
# ```
#
# {glue:text}`n_drafters` drafters ({glue:text}`n_sets` layer sets x {glue:text}`n_seeds` seeds), each
# trained on {glue:text}`train_tokens` tokens with {glue:text}`ttt_steps` unrolled steps and a
# {glue:text}`draft_vocab`-token draft vocabulary ({glue:text}`train_seconds:.0f` s of training per
# drafter on average), measured on {glue:text}`bench_prompts` prompts per benchmark with up to
# {glue:text}`bench_tokens` new tokens ({glue:text}`bench_mode` drafting). On
# {glue:text}`first_dataset` the default set reaches τ = {glue:text}`default_tau:.3f` (speedup
# {glue:text}`default_speedup:.2f`x); the best set is {glue:text}`best_set` ({glue:text}`best_ids`)
# with τ = {glue:text}`best_tau:.3f` (speedup {glue:text}`best_speedup:.2f`x);
# {glue:text}`n_beat_default` sets have a higher mean τ than the default. Speculative output was
# token-identical to HF greedy decoding in {glue:text}`n_lossless` of {glue:text}`n_runs` prompt runs.
#
# ```{glue:figure} fig_curve
# τ of the default layer set against the number of training tokens (same settings otherwise).
# **What to see:** where this profile's budget sits on the learning curve; a curve still rising at
# the right edge means the drafters of this table are undertrained and their differences small.
# ```
