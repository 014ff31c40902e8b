# The introduction's per-model answer (book/generated/answer.md), filled by `wavesurf reproduce`
# from each model's executed pages. A line "<notebook stem>: <text>" is used when that notebook ran
# for the model; [[key]] or [[key:format]] glues that notebook's value `key`. "figure:" is the
# caption of the one key figure (the first model with notebook 01); {model} is its display name.
# Lines starting with "#" are comments.
01_entropy_compartments: - **Compartments.** CKA splits the depth into [[n_compartments:d]] compartments ([[compartments]]); the most informative layer is id [[s1_max_layer:d]] (S₁ = [[s1_max]] nats) on [[n_tokens]] positions.
03_aggregate_entropy: - **The default rule** [[default_ids]] ranks [[default_rank:d]] of [[n_sets]] three-layer sets by aggregate entropy (S₂ = [[default_s2:.3f]] nats; best [[best_ids]], [[best_s2:.3f]] nats).
04_token_filtering: - **Token-entropy filtering** ([[filter]]) keeps [[kept_percent:.1f]] % of positions; the combined selection picks [[sel_filtered]] on them and [[sel_random]] on a random subset of the same size.
05_layer_selection: - **Selection.** [[n_differ:d]] of [[n_methods:d]] methods move away from the default; aggregate entropy picks [[ids_aggregate]], the combined score [[ids_combined]] (largest S₂ gain over the default [[best_gain]] nats, [[best_method]]).
06_speed_table: - **Drafters.** [[verdict]] Default set τ = [[default_tau:.3f]] ([[default_tau_ci]]) against a bigram floor of [[floor_tau:.3f]], the same head reading no layer (embedding-only control) at [[control_tau:.3f]], and n-gram lookup's [[lookup_tau:.3f]]; drafting with lookup first and the head after it, [[default_lookup_tau:.3f]] ([[default_lookup_ci]]); [[n_drafters:d]] EAGLE-3 heads, each trained on [[train_tokens]] tokens of the target's own answers. Timed, with [[timed_drafts]], the default set runs at [[default_speedup:.2f]]–[[default_speedup_max:.2f]]x HF greedy `generate`; lossless in [[n_lossless:d]] of [[n_runs:d]] runs.
06_speed_table: - **The paper's question: do the selected sets draft better?** [[question_answer]]
figure: Matrix entropy across depth of {model} (α = 1 top, α = 2 bottom; nats left, normalised right), CKA compartments shaded, default EAGLE-3 layers dotted. Details in the results chapter.
