"""The ``wavesurf`` command: one verb per step of the pipeline, mirroring the Python API."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .assets import CORPUS_ASSETS, DEFAULT_MODEL, EMBEDDED_MODELS


def _layer_list(text: str) -> list[int] | str:
    if text in ("all", "default"):
        return text
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers {text!r}: give comma-separated vLLM layer ids like 2,15,27, or 'all' or 'default'"
        ) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


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
    if layers == "all":
        from .models import load_target

        target = load_target(args.model, device=args.device)
        layers, model = target.layer_ids, target
    else:
        model = args.model
        layers = None if layers in (None, "default") else layers
    summary = run_capture(
        model, args.dataset, args.max_tokens, split=args.split, split_seed=args.split_seed, layer_ids=layers,
        out_dir=args.out, max_len=args.max_len, batch_tokens=args.batch_tokens, roles=args.roles,
        dtype=args.dtype, overwrite=args.overwrite, device=args.device, progress=not args.quiet,
    )
    _print_json(summary)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wavesurf",
        description="Which target layers should an EAGLE-3 drafter read? Capture hidden states of a real "
                    "model, score layers by matrix entropy and CKA, select and benchmark layer sets. "
                    "Layer ids use the vLLM convention: 0 = embeddings, N = last block before the final norm.",
    )
    parser.add_argument("--version", action="version", version=f"wavesurf {_version()}")
    sub = parser.add_subparsers(dest="verb", metavar="<verb>", required=True)

    p = sub.add_parser("models", help="list the embedded target models", description="List the embedded target models (N blocks, width d, vocabulary, source).")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("datasets", help="list the packaged corpora and their sizes", description="List the packaged corpora with their sizes and the ShareGPT split sizes.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT train/stats/heldout split (default 0)")
    p.set_defaults(func=cmd_datasets)

    p = sub.add_parser("capture", help="run the target over a corpus and capture hidden states",
                       description="Run the target once over --max-tokens tokens of a corpus, compute every "
                                   "position's next-token entropy, optionally write layers to --out as safetensors "
                                   "shards with a manifest, and print a JSON summary.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"embedded name ({', '.join(EMBEDDED_MODELS)}), local directory or HF id (default {DEFAULT_MODEL})")
    p.add_argument("--dataset", default="sharegpt", help=f"{', '.join(CORPUS_ASSETS)} or a .jsonl path (default sharegpt)")
    p.add_argument("--split", choices=["train", "stats", "heldout"], default=None, help="ShareGPT split (default: whole corpus)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT split (default 0)")
    p.add_argument("--max-tokens", type=_positive_int, required=True, help="number of real tokens to feed the model")
    p.add_argument("--max-len", type=_positive_int, default=512, help="truncate each example to this many tokens (default 512)")
    p.add_argument("--batch-tokens", type=_positive_int, default=4096, help="padded tokens per forward pass (default 4096)")
    p.add_argument("--layers", type=_layer_list, default=None, help="vLLM layer ids to write, e.g. 2,15,27; 'all'; default: the EAGLE-3 rule [2, N//2, N-3]")
    p.add_argument("--out", default=None, help="directory for safetensors shards + manifest (appears only when complete)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="dtype of the written states (default float32)")
    p.add_argument("--roles", choices=["all", "assistant"], default="all", help="which tokens count as kept in the summary (default all)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    p.add_argument("--allow-download", action="store_true", help="let transformers download a Hugging Face model (off by default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_capture)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not getattr(args, "allow_download", False):
        os.environ["HF_HUB_OFFLINE"] = "1"  # packaged models and local caches only
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .errors import WavesurfError
    from .models import configure_torch

    configure_torch()
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
