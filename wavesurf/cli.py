"""The ``wavesurf`` command: one verb per step of the pipeline, mirroring the Python API.

Over ~450 lines because it has one verb per pipeline step; each verb's options come from its
settings dataclass (:mod:`wavesurf.settings_cli`), so what remains per verb is wiring and messages.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

from ._version import __version__
from .assets import CORPUS_ASSETS, DEFAULT_MODEL, EMBEDDED_MODELS
from .consumers import FORMATS, describe_formats
from .errors import ParameterError
from .settings_cli import SPLIT_SEED_DEFAULT, SPLIT_SEED_HELP, SettingsOptions
from .settings_cli import positive_int as _positive_int

#: The settings dataclasses each verb makes from its options: every field has an option named after
#: it (``--field-name``) with the dataclass's own default, type, choices and help, unless excluded
#: here with the reason; ``aliases`` keep the option names these verbs had before the options were
#: generated. The classes are imported when their verb is parsed (their modules import torch).
ANALYSIS_OPTIONS = SettingsOptions(
    "wavesurf.stats.analysis:AnalysisSettings",
    overrides={"split": {"default": None, "choices": ["train", "stats", "heldout", "none"],
                         "shown": "stats for sharegpt, other corpora whole; 'none' = the whole corpus"}})
FEATURE_OPTIONS = SettingsOptions(
    "wavesurf.drafter.features:FeatureSettings",
    names={"max_tokens": "--max-train-tokens", "batch_tokens": "--store-batch-tokens", "dtype": "--store-dtype"},
    exclude={"split": "follows --dataset: ShareGPT's train split, another corpus whole",
             "layer_ids": "--store-layers: all ids, or the head's --layers (+ N)"},
    overrides={"dataset": {"default": None, "shown": "sharegpt@<model>"},
               "max_tokens": {"default": None, "shown": "the whole corpus, each example cut at --max-len"}})
TRAIN_OPTIONS = SettingsOptions(
    "wavesurf.drafter.train:TrainSettings",
    aliases={"max_steps": ("--steps",), "draft_vocab_size": ("--draft-vocab",), "frozen": ("--freeze",)})
BENCH_OPTIONS = SettingsOptions(
    "wavesurf.bench:BenchSettings",
    exclude={"tree": "a TreeSpec object (Python only): the command line decodes the shape --mode and its options give"})
VERB_SETTINGS = {"analyze": (ANALYSIS_OPTIONS,), "select": (ANALYSIS_OPTIONS,),
                 "train": (FEATURE_OPTIONS, TRAIN_OPTIONS), "bench": (BENCH_OPTIONS,)}


def _layer_list(text: str) -> list[int] | str:
    if text in ("all", "default"):
        return text
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers {text!r}: give comma-separated vLLM layer ids like 2,15,27, or 'all' or 'default'"
        ) from None


def _print_json(obj: Any) -> None:
    """Print a summary (only from the first process when several run under a launcher)."""
    if os.environ.get("RANK", "0") not in ("", "0"):
        return
    print(json.dumps(obj, indent=2))


def _process_device(device: str) -> str:
    """The device of this process: under `accelerate launch` / torchrun each process takes the
    GPU of its LOCAL_RANK."""
    from .models import pick_device

    device = pick_device(device)
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def cmd_models(args: argparse.Namespace) -> int:
    rows = [{"name": m.name, "n_layers": m.n_layers, "hidden_size": m.hidden_size, "vocab_size": m.vocab_size,
             "chat_template": m.chat_template, "default": m.name == DEFAULT_MODEL, "source": m.source,
             "install": m.pip_command} for m in EMBEDDED_MODELS.values()]
    if args.json:
        _print_json(rows)
    else:
        print(f"{'name':<14} {'N':>3} {'d':>5} {'vocab':>7}  chat  source")
        for r in rows:
            star = " (default)" if r["default"] else ""
            print(f"{r['name']:<14} {r['n_layers']:>3} {r['hidden_size']:>5} {r['vocab_size']:>7}  "
                  f"{'yes' if r['chat_template'] else 'no ':<4}  {r['source']}{star}")
        print("\nAny Hugging Face id already in your local cache, or a local checkpoint directory, works too.")
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from .data import load_corpus, split_sizes

    rows = []
    for name, asset in CORPUS_ASSETS.items():
        corpus = load_corpus(name)
        row: dict[str, Any] = {"name": name, "examples": len(corpus), "description": asset.description,
                               "package": asset.package}
        if name == "sharegpt":
            row["splits"] = split_sizes(corpus, args.split_seed)
            row["items_read"] = corpus.info["items_read"]
        rows.append(row)
    if args.json:
        _print_json(rows)
    else:
        for r in rows:
            extra = ""
            if "splits" in r:
                extra = f"  (read {r['items_read']:,} complete items; splits " + ", ".join(
                    f"{k} {v:,}" for k, v in r["splits"].items()) + f", seed {args.split_seed})"
            print(f"{r['name']:<10} {r['examples']:>6,} examples  {r['description']}{extra}")
        print("\nA .jsonl file of {\"messages\": [...]} or {\"text\": ...} lines works too (--dataset PATH).")
    return 0


def cmd_capture(args: argparse.Namespace) -> int:
    from .capture import run_capture

    layers = args.layers
    model = _load_target(args)
    if layers == "all":
        layers = model.layer_ids
    else:
        layers = None if layers in (None, "default") else layers
    summary = run_capture(
        model, args.dataset, args.max_tokens, split=args.split, split_seed=args.split_seed, layer_ids=layers,
        out_dir=args.out, max_len=args.max_len, batch_tokens=args.batch_tokens, roles=args.roles,
        dtype=args.dtype, overwrite=args.overwrite, device=args.device, progress=not args.quiet,
    )
    _print_json(summary)
    return 0


def _analysis_settings(args: argparse.Namespace):
    return ANALYSIS_OPTIONS.build(args, split=_default_split(args))


def _default_split(args: argparse.Namespace) -> str | None:
    if args.split is None:  # ShareGPT's statistics split; other corpora are used whole
        from .data import base_corpus

        return "stats" if base_corpus(args.dataset) == "sharegpt" else None
    return None if args.split == "none" else args.split


def _run_analysis(args: argparse.Namespace, k: int | None = None):
    from .select import check_k
    from .stats.analysis import analyze

    settings = _analysis_settings(args)
    settings.check()  # bad options fail before the model loads
    from .distributed import init_from_env

    target = _load_target(args, device=_process_device(args.device))
    if k is not None:  # and before the (slow) analysis
        check_k(k, target.n_layers)
    # under `accelerate launch` / torchrun: each process runs its share of the batches, rank 0 writes
    shard = init_from_env(target.device)
    return target, analyze(target, settings, use_cache=not args.no_cache, progress=not args.quiet and shard.is_main,
                           shard=shard)


def cmd_analyze(args: argparse.Namespace) -> int:
    """One pass over a corpus: matrix entropy (nats) of every layer id 0..N, the (N+1)x(N+1) linear
    CKA matrix and depth compartments, on statistics positions (no padding, no position 0),
    optionally token-entropy filtered with a random control of the same size. Results are cached by
    every parameter; prints a summary."""
    target, stats = _run_analysis(args)
    main = stats.main
    summary = {
        "model": target.name, "n_layers": target.n_layers, "hidden_size": target.hidden_size,
        "key": stats.key, "results": str(stats.path) if stats.path else None,
        "layer_convention": "vllm", "estimator": stats.meta["estimator_used"], "filter": stats.meta["filter"],
        "tokens": stats.meta["tokens"],
        "entropy_nats": {int(i): round(float(e), 4) for i, e in zip(main.layer_ids, main.entropy)},
        "compartments": [list(c) for c in main.compartments],
        "seconds": stats.meta["seconds"],
    }
    if stats.has_intervals:
        jk = stats.interval("entropy")
        summary["entropy_95ci_nats"] = {int(i): [round(float(lo), 4), round(float(hi), 4)]
                                        for i, lo, hi in zip(main.layer_ids, jk.low, jk.high)}
    else:
        summary["intervals"] = main.interval_note
    if stats.control is not None:
        summary["random_control_entropy_nats"] = {int(i): round(float(e), 4)
                                                  for i, e in zip(stats.control.layer_ids, stats.control.entropy)}
    _print_json(summary)
    return 0


def cmd_select(args: argparse.Namespace) -> int:
    """Pick k target layers for an EAGLE-3 drafter from the (cached) statistics. Prints JSON
    {"layer_ids": [...], "convention": "vllm", "sglang_layer_ids": [...], "method", "scores", "reason"}."""
    from .select import check_method, select_layers, selection_recurrence

    check_method(args.method)  # before the (slow) analysis
    if args.method == "probe":
        from .stats.probe import check_ridge

        check_ridge(args.ridge)
    target, stats = _run_analysis(args, k=args.k)
    candidates = range(0, target.n_layers + 1) if args.allow_embedding else None
    options: dict = {}
    if args.method == "combined":
        options["trade_off"] = args.trade_off
    if args.method == "entropy-spaced" and args.min_spacing is not None:
        options["min_spacing"] = args.min_spacing
    if args.method == "probe":  # a ridge probe on a capture of the same corpus (cached like the statistics)
        from .stats.probe import ProbeSettings, probe_layer_sets

        settings = _analysis_settings(args)
        probe = ProbeSettings(dataset=settings.dataset, split=settings.split, split_seed=settings.split_seed,
                              max_tokens=settings.max_tokens, max_len=settings.max_len,
                              batch_tokens=settings.batch_tokens, roles=settings.roles)
        options["probe"] = probe_layer_sets(target, k=args.k, settings=probe, ridge=args.ridge,
                                            use_cache=not args.no_cache, progress=not args.quiet)
    selection = select_layers(stats, k=args.k, method=args.method, candidates=candidates, **options)
    from .consumers import architecture_of, servable_formats

    out = selection.to_dict()
    # which export formats can serve these ids on this target: known before a drafter is trained on them
    architecture = architecture_of(target)
    out["export_formats"] = servable_formats(selection.layer_ids, target.n_layers, architecture)
    recurrence = selection_recurrence(stats, args.k, args.method, **options) if candidates is None else None
    if recurrence is not None:  # how often the set recurs, one group of conversations left out
        out["jackknife_agreement"] = round(recurrence, 4)
    if args.eagle_config:
        out = selection.eagle_config(args.eagle_config, architecture)
    _print_json(out)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .drafter.export import (check_dtype, check_export, check_format, export_drafter, plan_export,
                                 resolve_architecture)
    from .drafter.head import load_head

    if args.check is not None:
        n_layers = architecture = None
        if args.model is not None:
            from .consumers import architecture_of
            from .models import load_target

            target = load_target(args.model, device="cpu")
            n_layers, architecture = target.n_layers, architecture_of(target)
        report = check_export(args.check, n_layers=n_layers, architecture=args.target_architecture or architecture)
        _print_json(report)
        return 1 if report["ok"] is False else 0
    missing = [flag for flag, value in (("--drafter", args.drafter), ("--format", args.format), ("--out", args.out))
               if value is None]
    if missing:
        raise ParameterError(f"export needs {', '.join(missing)} (or --check DIR to inspect an export)")
    check_format(args.format)
    check_dtype(args.dtype)
    head, info = load_head(args.drafter)
    c = head.config
    architecture = resolve_architecture(c, args.target_architecture)
    # refuse before loading the target
    cons, _, ids_written = plan_export(c, args.format, consumer_version=args.consumer_version, architecture=architecture)
    target = None
    if args.with_embedding:
        from .models import load_target

        target = load_target(c.extra.get("target_path") or c.target_name, device="cpu")
    out = export_drafter(head, args.format, args.out, include_embedding=target, verifier=args.verifier,
                         target_architecture=architecture, consumer_version=cons.version, dtype=args.dtype,
                         speculative_tokens=args.speculative_tokens, overwrite=args.overwrite)
    _print_json({"out": str(out), "format": args.format, "consumer": cons.label, "target": c.target_name,
                 "target_architecture": architecture, "layer_ids": c.layer_ids, "ids_written": ids_written,
                 "input_norm": c.input_norm, "dtype": args.dtype, "draft_vocab_size": c.draft_vocab_size})
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train an EAGLE-3 draft head that reads --layers (vLLM ids) of the target. The target runs
    once over --max-train-tokens tokens of the training split into a feature store (cached; by
    default every layer, so other layer sets reuse it), then the head trains with training-time test
    (--ttt-steps unrolled steps, loss weight 0.8^j) over a --draft-vocab most-frequent-token
    vocabulary. Checkpoints let an interrupted run resume. Data parallel: `accelerate launch
    --num_processes P -m wavesurf.cli train ...`. Prints a JSON summary."""
    from .data import base_corpus
    from .drafter.train import train_from_features

    settings = TRAIN_OPTIONS.build(args)
    settings.check()  # bad options fail before the model loads
    device = _process_device(args.device)
    target = _load_target(args, device=device)
    layers = target.default_layer_ids() if args.layers == "default" else args.layers
    if layers == "all":
        raise ParameterError("--layers all: a drafter reads a few layers; give ids like 2,15,27 or 'default'")
    from .drafter.head import check_draft_layer_ids

    layers = check_draft_layer_ids(layers, target.n_layers)
    from .drafter.vocab import check_draft_vocab_size

    check_draft_vocab_size(settings.draft_vocab_size, target.vocab_size)  # before the (slow) feature store
    dataset = args.dataset or f"sharegpt@{target.name}"  # the target's own answers (`wavesurf distill`)
    features = FEATURE_OPTIONS.build(args, dataset=dataset, split="train" if base_corpus(dataset) == "sharegpt" else None,
                                     layer_ids=None if args.store_layers == "all" else layers)
    result, store, state = train_from_features(target, features, layers, settings, args.out,
                                               resume=not args.no_resume, progress=not args.quiet)
    if state.is_main_process:
        _print_json({**result.to_dict(), "model": target.name, "layer_convention": "vllm",
                     "feature_store": store.describe(), "num_processes": state.num_processes})
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from .data import SPLITS
    from .distill import check_settings, distill_corpus, summary

    check_settings(args.max_tokens, args.max_len, args.max_new_tokens, args.temperature, args.seed,
                   args.batch_size, args.chunk_examples)  # bad options fail before the model loads
    split = args.split
    if split is None:
        split = "train" if args.dataset == "sharegpt" else None
    elif split == "none":
        split = None
    elif split not in SPLITS:
        raise ParameterError(f"--split {split!r} is not one of {', '.join(SPLITS)} or none")
    target = _load_target(args)
    corpus = distill_corpus(target, args.dataset, split, max_tokens=args.max_tokens, max_len=args.max_len,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                            batch_size=args.batch_size, split_seed=args.split_seed,
                            chunk_examples=args.chunk_examples, progress=not args.quiet)
    out = summary(corpus)
    out["use_as"] = corpus.name if out["default_settings"] else f"{corpus.name}#{out['key']}"
    _print_json(out)
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from .book.reproduce import reproduce

    summary = reproduce(args.model, args.profile, args.only, dataset=args.dataset, max_tokens=args.max_tokens,
                        seed=args.seed, device=args.device, root=args.root, build=not args.no_build,
                        progress=not args.quiet)
    _print_json(summary)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Speculative decoding with a drafter vs HF generate (greedy reference), our plain KV-cached
    loop and HF prompt-lookup decoding, batch size 1, methods interleaved per prompt, warm-up
    excluded. tau = tokens / target forwards after the prefill (bonus token counted); speedup = mean
    tokens/s / mean tokens/s of HF greedy; at T=0 each output is checked against HF greedy
    (lossless). Writes rows.csv + summary.json to the results cache and prints the summary."""
    from .bench import run_bench, untrained_head

    settings = BENCH_OPTIONS.build(args)  # bad options fail here, before the model loads
    target = _load_target(args)
    drafter_id = None
    if args.drafter == "untrained":
        head = untrained_head(target)
    else:
        from .cache import file_sha256
        from .drafter.head import HEAD_WEIGHTS, load_head

        head, _ = load_head(args.drafter, target, device=target.device)
        drafter_id = file_sha256(Path(args.drafter) / HEAD_WEIGHTS)[:16]
    result = run_bench(target, head, args.dataset, settings, use_cache=not args.no_cache, progress=not args.quiet,
                       drafter_id=drafter_id)
    _print_json({**result.summary, "key": result.key, "results": str(result.path) if result.path else None})
    return 0


def _add_model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"embedded name ({', '.join(EMBEDDED_MODELS)}), local directory or HF id (default {DEFAULT_MODEL})")


def _add_split_seed_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--split-seed", type=int, default=SPLIT_SEED_DEFAULT,
                   help=f"{SPLIT_SEED_HELP} (default {SPLIT_SEED_DEFAULT})")


def _add_device_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")


def _add_analysis_options(p: argparse.ArgumentParser) -> None:
    _add_model_option(p)
    ANALYSIS_OPTIONS.add_to(p)
    p.add_argument("--no-cache", action="store_true", help="recompute and do not store the result")
    _add_runtime_options(p)


def _add_select_options(p: argparse.ArgumentParser) -> None:
    from .stats.probe import DEFAULT_RIDGE  # deferred: the light verbs do not import the statistics

    p.add_argument("--ridge", type=float, default=DEFAULT_RIDGE,
                   help=f"probe: ridge penalty lambda > 0 on whitened features (default {DEFAULT_RIDGE})")
    _add_analysis_options(p)


def _load_target(args: argparse.Namespace, device: str | None = None):
    """The target named by --model, on --device, in --model-dtype, downloading only with --allow-download."""
    from .models import load_target

    return load_target(args.model, device=device or args.device, dtype=args.model_dtype,
                       allow_download=args.allow_download)


def _add_runtime_options(p: argparse.ArgumentParser) -> None:
    """--device, --model-dtype, --allow-download and --quiet, shared by every verb that loads a model."""
    _add_device_option(p)
    p.add_argument("--model-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights of the target (default float32; bfloat16/float16 on GPU only, e.g. for an 8B target)")
    p.add_argument("--allow-download", action="store_true",
                   help="let transformers download a Hugging Face model (off by default)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_train_options(p: argparse.ArgumentParser) -> None:
    _add_model_option(p)
    p.add_argument("--layers", type=_layer_list, required=True,
                   help="vLLM layer ids the drafter reads, e.g. 2,15,27 (from `wavesurf select`), or 'default' = [2, N//2, N-3]")
    FEATURE_OPTIONS.add_to(p)
    p.add_argument("--store-layers", choices=["all", "train"], default="all",
                   help="layers kept in the feature store: all ids 0..N (reusable, 2*d bytes per token and layer) "
                        "or only --layers (+ N) (default all)")
    TRAIN_OPTIONS.add_to(p)
    p.add_argument("--out", default=None, help="output directory (default: a keyed directory in the wavesurf cache)")
    p.add_argument("--no-resume", action="store_true", help="refuse to continue a run found in --out instead of resuming it")
    _add_runtime_options(p)


def _add_bench_options(p: argparse.ArgumentParser) -> None:
    from .bench import BENCH_DATASETS

    _add_model_option(p)
    p.add_argument("--drafter", required=True,
                   help="drafter directory (from `wavesurf train`), or 'untrained' for a smoke run (tau ~ 1)")
    p.add_argument("--dataset", choices=BENCH_DATASETS, default=BENCH_DATASETS[0],
                   help="mt-bench (two turns), humaneval, or sharegpt (its held-out split) (default %(default)s)")
    BENCH_OPTIONS.add_to(p)
    p.add_argument("--no-cache", action="store_true", help="rerun and do not store the result")
    _add_runtime_options(p)


class _Verbs(argparse._SubParsersAction):
    """The verbs; a verb's remaining options (:func:`_settings_verb`) are added when that verb is parsed,
    so ``wavesurf --help`` and the light verbs never import the settings modules (and torch)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        if values and values[0] in self.choices:
            complete_verb(self.choices[values[0]])
        super().__call__(parser, namespace, values, option_string)


def _settings_verb(sub: Any, verb: str, func: Any, add_options: Any, help: str) -> argparse.ArgumentParser:
    """One verb whose options come from a settings type: ``add_options(p)`` runs only when the verb
    is used (:func:`complete_verb`), so ``wavesurf <other verb>`` does not import what it reads. The
    verb's description is its command function's docstring (one home for what the verb does)."""
    p = sub.add_parser(verb, help=help, description=inspect.cleandoc(func.__doc__ or help))
    p.set_defaults(func=func, _add_options=add_options)
    return p


def complete_verb(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``p`` with the options :func:`_settings_verb` deferred (idempotent)."""
    add = p.get_default("_add_options")
    if add is not None:
        p.set_defaults(_add_options=None)
        add(p)
    return p


def verb_parser(verb: str) -> argparse.ArgumentParser:
    """The complete parser of one verb (every option added)."""
    return complete_verb(build_parser()._subparsers._group_actions[0].choices[verb])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wavesurf",
        description="Which target layers should an EAGLE-3 drafter read? Capture hidden states of a real "
                    "model, score layers by matrix entropy and CKA, select and benchmark layer sets. "
                    "Layer ids use the vLLM convention: 0 = embeddings, N = last block before the final norm.",
    )
    parser.add_argument("--version", action="version", version=f"wavesurf {_version()}")
    sub = parser.add_subparsers(dest="verb", metavar="<verb>", required=True, action=_Verbs)

    p = sub.add_parser("models", help="list the embedded target models", description="List the embedded target models (N blocks, width d, vocabulary, source).")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("datasets", help="list the packaged corpora and their sizes", description="List the packaged corpora with their sizes and the ShareGPT split sizes.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_split_seed_option(p)
    p.set_defaults(func=cmd_datasets)

    p = sub.add_parser("capture", help="run the target over a corpus and capture hidden states",
                       description="Run the target once over --max-tokens tokens of a corpus, compute every "
                                   "position's next-token entropy, optionally write layers to --out as safetensors "
                                   "shards with a manifest, and print a JSON summary.")
    _add_model_option(p)
    p.add_argument("--dataset", default="sharegpt", help=f"{', '.join(CORPUS_ASSETS)} or a .jsonl path (default sharegpt)")
    p.add_argument("--split", choices=["train", "stats", "heldout"], default=None, help="ShareGPT split (default: whole corpus)")
    _add_split_seed_option(p)
    p.add_argument("--max-tokens", type=_positive_int, required=True, help="number of real tokens to feed the model")
    p.add_argument("--max-len", type=_positive_int, default=512, help="truncate each example to this many tokens (default 512)")
    p.add_argument("--batch-tokens", type=_positive_int, default=4096, help="padded tokens per forward pass (default 4096)")
    p.add_argument("--layers", type=_layer_list, default=None, help="vLLM layer ids to write, e.g. 2,15,27; 'all'; default: the EAGLE-3 rule [2, N//2, N-3]")
    p.add_argument("--out", default=None, help="directory for safetensors shards + manifest (appears only when complete)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="dtype of the written states (default float32)")
    p.add_argument("--roles", choices=["all", "assistant"], default="all", help="which tokens count as kept in the summary (default all)")
    _add_runtime_options(p)
    p.set_defaults(func=cmd_capture)

    _settings_verb(sub, "analyze", cmd_analyze, _add_analysis_options,
                   help="matrix entropy, CKA and compartments of every layer")

    p = _settings_verb(sub, "select", cmd_select, _add_select_options,
                       help="which k layers an EAGLE-3 drafter should read")
    p.add_argument("--k", type=int, default=3, help="number of layers (1..N+1, default 3)")
    p.add_argument("--method", default="combined",
                   help="default ([2, N//2, N-3]), entropy (top-k S1), entropy-spaced (heuristic), aggregate, "
                        "greedy-aggregate, mrmr, cka (from the compartments found), combined (standardised "
                        "entropy + diversity), probe (ridge probe of the next last-layer state on a capture of "
                        "the same corpus; slower) (default combined)")
    p.add_argument("--allow-embedding", action="store_true", help="let id 0 (embedding output) be chosen")
    p.add_argument("--trade-off", type=float, default=0.5,
                   help="combined: weight t of diversity (1 - mean CKA) against normalised entropy (default 0.5)")
    p.add_argument("--min-spacing", type=int, default=None, help="entropy-spaced: minimum distance between picked ids (default N // 2k)")
    p.add_argument("--eagle-config", choices=list(FORMATS), default=None,
                   help="print the drafter-config snippet for that consumer instead, its ids written by its own "
                        "rule (see `wavesurf export --help`)")

    from .distill import (DEFAULT_BATCH_SIZE, DEFAULT_CHUNK_EXAMPLES, DEFAULT_MAX_LEN, DEFAULT_MAX_NEW_TOKENS,
                          DEFAULT_MAX_TOKENS)

    p = sub.add_parser("distill", help="the target's own answers to a corpus's prompts, as a new corpus",
                       description="Answer every user turn of a corpus split with the target itself (greedy by default, "
                                   "batched with a KV cache; greedy answers equal batch-1 HF generate), replacing the "
                                   "original answers, until --max-tokens answer tokens are collected (whole "
                                   "conversations, corpus order). Cached and resumable; afterwards the dataset name "
                                   "<corpus>@<model> (e.g. sharegpt@smollm2-135m) works wherever a dataset is "
                                   "accepted, for that model only. Prints a JSON summary.")
    _add_model_option(p)
    p.add_argument("--dataset", default="sharegpt", help=f"prompts: {', '.join(CORPUS_ASSETS)} or a .jsonl path (default sharegpt)")
    p.add_argument("--split", default=None, help="ShareGPT split: train, stats, heldout (default: train for sharegpt; "
                                                 "'none' or omitted for other corpora)")
    _add_split_seed_option(p)
    p.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS,
                   help=f"answer tokens to generate, EOS included (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--max-len", type=_positive_int, default=DEFAULT_MAX_LEN,
                   help=f"a conversation ends before it would pass this many tokens (default {DEFAULT_MAX_LEN})")
    p.add_argument("--max-new-tokens", type=_positive_int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"most tokens per answer (default {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples, seeded per answer")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                   help=f"prompts generated together; changes speed, not the answers (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--chunk-examples", type=_positive_int, default=DEFAULT_CHUNK_EXAMPLES,
                   help=f"conversations per cache chunk (an interrupted run resumes after the last one) "
                        f"(default {DEFAULT_CHUNK_EXAMPLES})")
    _add_runtime_options(p)
    p.set_defaults(func=cmd_distill)

    from .book.profiles import PROFILES

    p = sub.add_parser("reproduce", help="run the notebooks for a model and build the book",
                       description="Convert notebooks/ with jupytext, run them with papermill for --model and "
                                   "--profile into book/results/<model>/ (swapped in only when every notebook "
                                   "succeeded), then build the book with jupyter-book (warnings are errors). "
                                   "Statistics come from the results cache when present.")
    _add_model_option(p)
    p.add_argument("--profile", default="default",
                   help="; ".join(f"{k}: {v['description']}" for k, v in PROFILES.items()) + " (default: default)")
    p.add_argument("--only", default=None, help="comma-separated notebook numbers or names, e.g. 01,03 (default: all)")
    p.add_argument("--dataset", default="sharegpt", help=f"{', '.join(CORPUS_ASSETS)} or a .jsonl path (default sharegpt)")
    p.add_argument("--max-tokens", type=_positive_int, default=None, help="override the profile's analysis token budget")
    p.add_argument("--seed", type=int, default=0, help="seed of random controls and shuffling (default 0)")
    _add_device_option(p)
    p.add_argument("--no-build", action="store_true", help="run the notebooks but do not build the book")
    p.add_argument("--quiet", action="store_true", help="no per-cell progress bars")
    p.add_argument("--root", type=Path, default=None,
                   help="the wavesurf checkout whose notebooks/ run and whose book/ receives the pages (default: "
                        "the checkout this package is installed from, whatever the current directory)")
    p.set_defaults(func=cmd_reproduce)

    p = sub.add_parser("export", help="write a trained drafter for vLLM, SGLang, SpecForge or speculators",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Export a drafter directory (written by `wavesurf train`) for the consumer that "
                                   "will read it, in the place, layer-id convention and fc width that consumer "
                                   "reads (rules read from the released packages, per target architecture where "
                                   "they differ). A head a consumer cannot read is refused, naming the reason and "
                                   "the formats that can. `--check DIR` says which layers each consumer version "
                                   "reads for an existing export.\n\nFormats (consumer, versions read, what it "
                                   "refuses):\n" + describe_formats())
    p.add_argument("--drafter", default=None, help="drafter directory (wavesurf-drafter.json + drafter.safetensors)")
    p.add_argument("--format", default=None, help=", ".join(FORMATS))
    p.add_argument("--out", default=None, help="output directory (must not exist unless --overwrite)")
    p.add_argument("--consumer-version", default=None,
                   help="the consumer's version whose rule to write for (default: the newest read; see above)")
    p.add_argument("--target-architecture", "--verifier-architecture", dest="target_architecture", default=None,
                   help="the target's HF architecture, e.g. LlamaForCausalLM (default: the embedded model's, or "
                        "the config of the directory or HF cache entry the head was trained on); SGLang's id "
                        "rule depends on it")
    p.add_argument("--dtype", default="bfloat16", help="weight dtype: bfloat16 (default), float16 or float32")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--with-embedding", action="store_true",
                   help="also store the target's input embedding as embed_tokens.weight (servers use the target's anyway)")
    p.add_argument("--verifier", default=None,
                   help="speculators: the target's HF id or path (default: the embedded model's HF id, e.g. "
                        "HuggingFaceTB/SmolLM2-135M-Instruct, or the local directory the head was trained on)")
    p.add_argument("--speculative-tokens", type=_positive_int, default=3,
                   help="speculators: default number of speculative tokens (default 3)")
    p.add_argument("--check", default=None, metavar="DIR",
                   help="instead of exporting: read the exported config in DIR and print, per consumer version, "
                        "the vLLM layer ids it will read, its fc width and fc_norm, against the head's (exit 1 "
                        "when the consumer it was written for reads other layers)")
    p.add_argument("--model", default=None,
                   help="--check of an export without wavesurf metadata: the target (name or path) it is for")
    p.set_defaults(func=cmd_export)

    _settings_verb(sub, "train", cmd_train, _add_train_options,
                   help="train an EAGLE-3 drafter on chosen target layers")

    _settings_verb(sub, "bench", cmd_bench, _add_bench_options,
                   help="acceptance length and speedup of a drafter against baselines")
    return parser


def _version() -> str:

    return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not getattr(args, "allow_download", False):
        os.environ["HF_HUB_OFFLINE"] = "1"  # packaged models and local caches only
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .distributed import local_threads
    from .errors import WavesurfError
    from .models import configure_torch

    configure_torch(local_threads())  # several processes on one machine share its cores
    try:
        return args.func(args)
    except (WavesurfError, FileExistsError, ValueError) as exc:
        print(f"wavesurf {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"wavesurf {args.verb}: interrupted; nothing partial was left behind", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
