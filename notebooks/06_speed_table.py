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
# `[2, N//2, N-3]`? One EAGLE-3 head per layer set and training seed, all trained with the same
# budget on the same tokens: the target's **own greedy answers** to ShareGPT training prompts, which
# is what a head sees when it drafts ({ref}`methods-drafter`). Each head is scored by **exact offline
# chain acceptance** on the target's greedy answers to held-out prompts: one teacher-forced unroll of
# the head gives the acceptance length τ that greedy chain decoding would reach on those answers,
# without timing noise. Intervals resample both things that are random here, the held-out sequences
# and the training seeds (with one seed: sequences only, and the table says so); the difference to
# the default set is **paired** (the same resampled sequences and seeds for both heads). Every layer
# set is compared with the default, so the differences get **simultaneous** 95% intervals (max-T
# over the family; the per-comparison ones are the `diff_unadj_*` columns). A set "beats" the
# default only when its simultaneous interval excludes zero and every training seed agrees. A bigram table
# counted from the training answers is the floor any head should clear. A small target's greedy
# answers repeat themselves, so every head is also scored the way it is timed: **n-gram lookup
# first** (the tokens that followed the latest earlier occurrence of the context's last 1–3 tokens,
# {ref}`methods-drafter`) and the head after it, with the same paired intervals. Then the default set, the
# best selected set and the best control are timed in real speculative decoding (T = 0, batch 1)
# against HF greedy `generate`. Tables: {download}`tables/06_speed_table.csv` (one row per set and
# seed), {download}`tables/06_speed_table_summary.csv`, {download}`tables/06_timed.csv` and
# {download}`tables/06_tau_vs_tokens.csv`.

# %% tags=["parameters", "hide-input"]
model = "smollm2-135m"  # embedded name, local directory or HF id
dataset = "sharegpt"  # corpus of the statistics that select the layer sets
max_tokens = None  # None: the profile's analysis token budget
profile = "default"  # smoke | default | long | paper (drafter budgets: wavesurf.book.profiles)
seed = 0  # statistics controls and the random layer sets
device = "auto"  # auto, cpu, cuda, cuda:N

# %% tags=["hide-input", "hide-output"]
# Check the parameters first (a wrong type or value stops here with a clear message), then load the target.
import matplotlib.pyplot as plt
from myst_nb import glue

from wavesurf.book import paper, plots, tables, variants
from wavesurf.book.notebook import open_notebook, target_line
from wavesurf.book.verdicts import not_evidence_note, question_answer, seeds_clause

P, target = open_notebook(model, dataset, max_tokens, profile, seed, device)

# %%
# NBVAL_CHECK_OUTPUT
print(target_line(target))

# %% tags=["hide-output"]
sets, settings, table = paper.profile_speed_table(target, P)
paper.write_csv(table.rows, "tables/06_speed_table.csv")
paper.write_csv(table.summary, "tables/06_speed_table_summary.csv")
paper.write_csv(table.timed, "tables/06_timed.csv")
paper.write_csv(table.curve, "tables/06_tau_vs_tokens.csv")
paper.write_csv(table.streams, "tables/06_streams.csv")

# %% tags=["remove-input"]
from IPython.display import HTML

HTML(tables.html_table(
    table.summary, ["layer_set", "layer_ids", "seeds", "tau", "diff", "verdict", "diff_unadj", "rescue", "lookup_tau",
                    "lookup_diff", "group", "tau_seed_std"],
    headers={"layer_set": "layer set", "layer_ids": "ids (vLLM)", "tau": "τ (95% CI)",
             "diff": "Δ vs default (simultaneous CI)", "diff_unadj": "Δ (per-comparison CI)",
             "rescue": "acc. where bigram misses", "lookup_tau": "τ, lookup first", "lookup_diff": "Δ, lookup first",
             "tau_seed_std": "seed std"},
    intervals={"tau": ("tau_lo", "tau_hi"), "diff": ("diff_lo", "diff_hi"), "rescue": ("rescue_lo", "rescue_hi"),
               "lookup_tau": ("lookup_tau_lo", "lookup_tau_hi"), "lookup_diff": ("lookup_diff_lo", "lookup_diff_hi"),
               "diff_unadj": ("diff_unadj_lo", "diff_unadj_hi")},
    floatfmt=".3f"))

# %% tags=["remove-input"]
HTML(tables.html_table(
    table.streams, ["layer_set", "layer_id", "share", "contribution_rms", "stream_rms", "tau_without", "drop", "drop_lo",
                    "drop_hi"],
    headers={"layer_set": "layer set", "layer_id": "layer (vLLM id)", "share": "share of fc input",
             "contribution_rms": "RMS of fc part", "stream_rms": "RMS of stream", "tau_without": "τ without it",
             "drop": "τ lost", "drop_lo": "95% lo", "drop_hi": "95% hi"}, floatfmt=".3f"))

# %% tags=["hide-input"]
head_rows = [r for r in table.summary if r["layer_set"] != "lookup"]  # lookup alone is in the next figure
fig, axes = plt.subplots(1, 2, figsize=(11, 0.3 * len(head_rows) + 1.6), sharey=True)
plots.plot_tau_intervals(head_rows, axes[0], axes[1])
fig.tight_layout()
plots.save_figure(fig, "figures/06_speed_table.png")
glue("fig_speed", fig, display=False)
plt.close(fig)

lookup_rows = table.lookup_rows()
fig, axes = plt.subplots(1, 2, figsize=(11, 0.3 * max(len(lookup_rows), 1) + 1.6), sharey=True)
if lookup_rows:
    plots.plot_tau_intervals(lookup_rows, axes[0], axes[1])
    axes[0].set_xlabel(f"offline τ at draft length {table.info['draft_len']}, n-gram lookup first (tokens per target forward)")
fig.tight_layout()
plots.save_figure(fig, "figures/06_speed_table_lookup.png")
glue("fig_speed_lookup", fig, display=False)
plt.close(fig)

fig, ax = plt.subplots(figsize=(5.2, 3.4))
plots.plot_tau_curve(table.curve, ax=ax)
fig.tight_layout()
plots.save_figure(fig, "figures/06_tau_vs_tokens.png")
glue("fig_curve", fig, display=False)
plt.close(fig)

# %%
# NBVAL_CHECK_OUTPUT
print("layer sets trained:", len(sets), "| lossless (T=0) on every timed prompt:",
      all(r["lossless_prompts"] == r["prompts"] for r in table.timed))

# %% tags=["remove-input"]
HTML(tables.html_table(
    table.timed, ["role", "layer_set", "layer_ids", "dataset", "draft_len_run", "min_confidence", "predicted_speedup",
                  "tau", "speedup", "speedup_lo", "speedup_hi", "tokens_per_second", "hf_tokens_per_second", "lossless_prompts", "prompts"],
    headers={"layer_set": "layer set", "layer_ids": "ids (vLLM)", "tau": "τ (timed runs)",
             "draft_len_run": "draft len (0 = plain)", "min_confidence": "threshold",
             "predicted_speedup": "predicted", "speedup_lo": "95% CI lo", "speedup_hi": "hi",
             "tokens_per_second": "tokens/s", "hf_tokens_per_second": "HF tokens/s", "lossless_prompts": "lossless",
             "prompts": "of"}, floatfmt=".3f"))

# %% tags=["remove-input"]
default = table.row("default")
best = table.best(("selected", "selected+filter", "control"))
floor = table.row("bigram")
lookup = table.row("lookup")
train = settings.train
timed_default = [r for r in table.timed if r["role"] == "default"]
glue("verdict", table.verdict, display=False)
control = table.row("embedding-only")
rank = table.info["can_rank"]
glue("control_tau", float(control["tau"]), display=False)
glue("control_margin", f"{rank['embedding-only']['margin']:+.3f} ({rank['embedding-only']['margin_lo']:+.3f} to "
                       f"{rank['embedding-only']['margin_hi']:+.3f})", display=False)
glue("floor_margin", f"{rank['bigram']['margin']:+.3f} ({rank['bigram']['margin_lo']:+.3f} to "
                     f"{rank['bigram']['margin_hi']:+.3f})", display=False)
glue("default_rescue", f"{default['rescue']:.3f} ({default['rescue_lo']:.3f} to {default['rescue_hi']:.3f})",
     display=False)
glue("control_rescue", f"{control['rescue']:.3f} ({control['rescue_lo']:.3f} to {control['rescue_hi']:.3f})",
     display=False)
glue("selection_verdict", table.selection_verdict or "This table has no selected set to rank.", display=False)
glue("n_sets", len(sets), display=False)
glue("n_seeds", seeds_clause(table.info), display=False)
glue("n_drafters", len({r["drafter"] for r in table.rows}), display=False)
glue("train_tokens", f"{train.train_tokens:,}", display=False)
glue("train_store_tokens", f"{table.info['train_store_tokens']:,}", display=False)
glue("ttt_steps", train.ttt_steps, display=False)
glue("draft_vocab", f"{train.draft_vocab_size:,}", display=False)
glue("train_seconds", sum(float(r["train_seconds"]) for r in table.rows) / max(1, len(table.rows)), display=False)
glue("draft_len", table.info["draft_len"], display=False)
glue("heldout_sequences", table.info["heldout_sequences"], display=False)
glue("heldout_positions", f"{table.info['heldout_positions']:,}", display=False)
glue("default_tau", float(default["tau"]), display=False)
glue("default_tau_ci", f"{default['tau_lo']:.3f} to {default['tau_hi']:.3f}", display=False)
glue("best_set", best["layer_set"], display=False)
glue("best_ids", best["layer_ids"], display=False)
glue("best_tau", float(best["tau"]), display=False)
glue("best_diff_ci", f"{best['diff']:+.3f} ({best['diff_lo']:+.3f} to {best['diff_hi']:+.3f})", display=False)
glue("floor_tau", float(floor["tau"]), display=False)
glue("lookup_tau", float(lookup["tau"]), display=False)
glue("lookup_ci", f"{lookup['tau_lo']:.3f} to {lookup['tau_hi']:.3f}", display=False)
glue("lookup_ngram", table.info["lookup_ngram"], display=False)
glue("default_lookup_tau", float(default.get("lookup_tau", "nan") or "nan"), display=False)
glue("default_lookup_ci", f"{default.get('lookup_tau_lo', float('nan')):.3f} to "
                          f"{default.get('lookup_tau_hi', float('nan')):.3f}", display=False)
glue("lookup_verdict", table.lookup_verdict, display=False)
glue("default_speedup", min(float(r["speedup"]) for r in timed_default), display=False)
glue("default_speedup_max", max(float(r["speedup"]) for r in timed_default), display=False)
glue("default_speedup_ci", "; ".join(
    f"{r['dataset']} {float(r['speedup']):.2f}x" + (f" (95% CI {float(r['speedup_lo']):.2f}–{float(r['speedup_hi']):.2f})"
                                                  if r["speedup_lo"] != "" else "") for r in timed_default), display=False)
glue("bench_prompts", settings.bench.n_prompts, display=False)
glue("bench_tokens", settings.bench.max_new_tokens, display=False)
glue("timed_setting", table.timed_setting, display=False)
glue("timed_drafts", f"drafts from n-gram lookup first (suffixes up to {settings.bench.lookup_ngram} tokens), the head "
                     "after it" if settings.bench.lookup_ngram else "drafts from the head alone", display=False)
glue("n_lossless", sum(int(r["lossless_prompts"] or 0) for r in table.timed), display=False)
glue("n_runs", sum(int(r["prompts"] or 0) for r in table.timed), display=False)


# the limits of this run, in its own numbers (quoted by book/templates/limitations.md.tpl)
level = round(100 * table.info.get("level", 0.95))
cleared = {name: rank[name]["margin_lo"] > 0 for name in ("bigram", "embedding-only")}


def _margin(name: str) -> str:
    m = rank[name]
    return f"{m['margin']:+.3f} τ ({level}% CI {m['margin_lo']:+.3f} to {m['margin_hi']:+.3f})"


floors = (f"The default set's heads differ from the bigram floor by {_margin('bigram')} and from the same head "
          f"reading no layer by {_margin('embedding-only')}"
          + ("; both intervals lie above zero." if all(cleared.values()) else
             "; not both intervals lie above zero, so at this budget the table cannot rank layer sets."))
passes = train.train_tokens / max(1, table.info["train_store_tokens"])
seeds_text = (f"Intervals resample training seeds ({seeds_clause(table.info)}) and {table.info['heldout_sequences']} held-out "
              f"conversations ({table.info['heldout_positions']:,} answer tokens); with this few of each, the "
              "intervals are themselves rough." if max(len(settings.seeds), len(settings.primary_seeds)) >= 2 else
              f"With one training seed the intervals resample only the {table.info['heldout_sequences']} held-out "
              f"conversations ({table.info['heldout_positions']:,} answer tokens) and leave seed variance out.")
glue("limitations", " ".join([
    f"Each head saw {train.train_tokens:,} training tokens ({passes:.1f} passes over {table.info['train_store_tokens']:,} "
    "tokens of the target's own answers), a CPU budget; the τ-against-tokens figure shows whether τ was still rising.",
    floors, seeds_text,
    f"Timed speedups rest on {settings.bench.n_prompts} prompt{'s' if settings.bench.n_prompts != 1 else ''} per benchmark of up to {settings.bench.max_new_tokens} "
    f"new tokens, {'with n-gram lookup drafting first' if settings.bench.lookup_ngram else 'the head drafting alone'}, "
    "on this machine's CPU, whose kernels move them as much as the head does."]), display=False)

# %% [markdown]
# **Verdict.** {glue:text}`verdict`
#
# **Do the heads use their layers?** The default set's heads beat the bigram floor by
# {glue:text}`floor_margin` τ and the same head trained reading no layer (the embedding-only
# control, τ = {glue:text}`control_tau:.3f`) by {glue:text}`control_margin` τ (paired, 95%
# intervals over held-out sequences and seeds). Where the bigram floor drafts the first token wrong,
# the default set's heads draft it right at a rate of {glue:text}`default_rescue`, the
# embedding-only control at {glue:text}`control_rescue` (the "acc. where bigram misses" column;
# seeds pooled, interval over held-out sequences). The second
# table shows which layer each head listens to: each stream's share of the fused input `fc(x)`
# (first seed's head; raw residual streams grow with depth, so without a per-stream norm the deep
# streams dominate), and for the default set the τ lost when one stream is removed from the
# trained head. Unless the heads clear both floors beyond their intervals, the verdict says the
# table cannot rank layer sets.
#
# **Selection or region?** A set can beat the default by reading a better region of layers, which
# random sets from that region do too; so each selected set is ranked among random layer sets of the
# same size (drawn once, with the notebook's seed), and only a rank high in that null credits the
# selection criterion. (Pairing the best selected set with the best control would compare two maxima
# picked on the same data.) {glue:text}`selection_verdict`
#
# ```{glue:figure} fig_speed
# Offline acceptance length τ at draft length {glue:text}`draft_len` per layer set (left; mean over
# its training seeds: {glue:text}`n_seeds`; 95% interval resampling held-out sequences and seeds) and its
# paired difference to the default set (right; simultaneous 95% intervals over the layer sets).
# **What to see:** a set beats the default only if its
# right-hand interval lies entirely right of the dashed zero line (green); grey intervals cross it.
# The bigram floor needs no target features at all.
# ```
#
# ```{glue:figure} fig_speed_lookup
# The same heads drafting after n-gram lookup (what the timed runs decode with): τ per layer set
# (left) and its paired difference to the default set's heads drafting the same way (right); the
# last row is lookup alone. **What to see:** how far copying alone goes on a small model's
# repetitive answers, what the head adds to it, and whether the layer set still matters there.
# ```
#
# {glue:text}`n_drafters` drafters ({glue:text}`n_sets` layer sets; {glue:text}`n_seeds`), each
# trained on {glue:text}`train_tokens` tokens (passes over a store of {glue:text}`train_store_tokens`
# tokens of the target's own answers) with {glue:text}`ttt_steps` unrolled steps and a
# {glue:text}`draft_vocab`-token draft vocabulary ({glue:text}`train_seconds:.0f` s of training per
# drafter on average), scored on {glue:text}`heldout_sequences` held-out conversations
# ({glue:text}`heldout_positions` answer tokens). The default set reaches τ =
# {glue:text}`default_tau:.3f` ({glue:text}`default_tau_ci`); the best other set is
# {glue:text}`best_set` ({glue:text}`best_ids`) with τ = {glue:text}`best_tau:.3f`, a paired difference
# of {glue:text}`best_diff_ci`; the bigram floor reaches τ = {glue:text}`floor_tau:.3f` and n-gram
# lookup alone (scored on the same positions) τ = {glue:text}`lookup_tau:.3f`
# ({glue:text}`lookup_ci`). Drafting with lookup first (suffixes of up to {glue:text}`lookup_ngram`
# tokens) and the head after it, the default set reaches τ = {glue:text}`default_lookup_tau:.3f`
# ({glue:text}`default_lookup_ci`). {glue:text}`lookup_verdict`
#
# In timed decoding ({glue:text}`bench_prompts` prompts per benchmark, up to {glue:text}`bench_tokens`
# new tokens; {glue:text}`timed_drafts`) the default set runs at {glue:text}`default_speedup:.2f`–{glue:text}`default_speedup_max:.2f`x
# the speed of HF greedy `generate` on this machine ({glue:text}`default_speedup_ci`; intervals
# resample prompts, paired with HF greedy on the same prompt); speculative output was token-identical to HF
# greedy decoding in {glue:text}`n_lossless` of {glue:text}`n_runs` prompt runs. {glue:text}`timed_setting`
#
# ```{glue:figure} fig_curve
# Offline τ of the default set and of the best set against the number of training tokens (same
# settings otherwise; bands: 95% bootstrap intervals). **What to see:** where this profile's budget
# sits on the learning curve; a curve still rising at the right edge means longer training would
# raise every set, and possibly change their order.
# ```

# %% tags=["hide-input"]
# Which criterion predicts a good drafter? Every criterion on the statistics selection reads, for
# every trained layer set, against the heads' tau (rank correlation; sets, sequences and seeds resampled)
import numpy as np

from wavesurf.criteria import criteria_sentence

selection_variant = variants.selection_variant_names(P)[1]  # the profile's analysis.selection_positions
stats = variants.profile_stats(target, P, [selection_variant], progress=False)[selection_variant]
trained = [s for s in sets if s.name in table.runs]
# the predictive probe of every k-set (sampled past 10,000) on the statistics corpus, the trained sets included
k = len(target.default_layer_ids())  # the default set's size; sets of other sizes (last-1) get no probe score
probe = paper.profile_probe(target, P, [s.layer_ids for s in trained if len(s.layer_ids) == k], k=k, progress=False)
criteria, criteria_rows = paper.criteria_against_heads(stats, trained, table, settings, seed, probe=probe)
paper.write_csv(criteria_rows, "tables/06_criteria.csv")
paper.write_csv([{"layer_set": s.name, "layer_ids": " ".join(map(str, s.layer_ids)), "tau": table.row(s.name)["tau"],
                  **{k: round(v, 5) for k, v in c.items()}} for s, c in zip(trained, criteria)],
                "tables/06_criteria_by_set.csv")
criteria_text = criteria_sentence(criteria_rows, table.info["level"])
glue("criteria_sentence", not_evidence_note(table.info) + criteria_text, display=False)
glue("question_answer", question_answer(table.info, criteria_text), display=False)  # the introduction's line
glue("criteria_caveat", f"A correlation over {len(trained)} layer sets is rough whatever its sign"
     + ("; the heads clear both floors here (above), so the τ it ranks carries what the layers add."
        if table.info["can_rank"]["ok"] else
        ", and the heads do not clear both floors here (above), so the τ it ranks is mostly noise."), display=False)
fig, ax = plt.subplots(figsize=(6.2, 4.2))
plots.plot_set_landscape(
    np.column_stack([probe.r2, stats.aggregate_entropy2(probe.layer_sets)]),
    [(s.name, c["probe_r2"], c["aggregate_entropy2"], float(table.row(s.name)["tau"]))
     for s, c in zip(trained, criteria) if np.isfinite(c["probe_r2"])],
    ax=ax, xlabel="probe: held-out R² of the set (features → next state)", every_label=f"{probe.over} k-subsets")
glue("n_probed", f"{len(probe.layer_sets):,}", display=False)
glue("probe_over", "every" if probe.over == "all" else "a seeded sample of the", display=False)
fig.tight_layout()
plots.save_figure(fig, "figures/06_criteria.png")
glue("fig_criteria", fig, display=False)
plt.close(fig)

# %% [markdown]
# **Which criterion predicts a good drafter?** The paper's recipe is useful only if a statistic of
# the hidden states ranks layer sets the way trained drafters rank them. Each criterion (mean
# matrix entropy, aggregate entropy, redundancy, mean pairwise CKA on the statistics selection
# reads; the predictive probe's held-out R², a ridge regression from the set's streams at t and the
# embedding of the next token to the target's last state at t+1, {ref}`methods-selection`) is
# evaluated on every layer set this table trained and correlated with those sets' τ
# ({download}`tables/06_criteria.csv`, per set {download}`tables/06_criteria_by_set.csv`).
# {glue:text}`criteria_sentence` {glue:text}`criteria_caveat`
#
# ```{glue:figure} fig_criteria
# {glue:text}`probe_over` {glue:text}`n_probed` layer sets of this size placed by the probe's
# held-out R² (x) and aggregate entropy (y, α = 2, nats); the trained sets on top, coloured by
# their heads' offline τ. **What to see:** whether the sets with the highest τ sit where either
# criterion would look (right, or high), or anywhere.
# ```
