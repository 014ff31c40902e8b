"""Acceptance length and speedup of EAGLE-3 speculative decoding against baselines, batch size 1.

Per prompt the methods run interleaved (the order rotates from prompt to prompt, so slow drift of
the machine cancels): HF ``generate`` greedy (the reference), our plain KV-cached loop, HF
prompt-lookup decoding, and speculative decoding with the drafter. Warm-up runs are excluded.

Definitions (as SGLang and SpecForge benchmarks count ``accept_length``; the book's Methods page): ``tau`` = tokens committed after the prefill /
target forwards after the prefill (the target's bonus token counts; a prompt's first token and
its prefill forward do not). ``speedup`` of a method = mean over prompts of its tokens/s / mean
over prompts of HF greedy's tokens/s. At T=0 every method's output is compared with HF greedy
(``lossless`` column).

MT-bench is multi-turn: turn 2 is asked after the model's own turn-1 answer (HF greedy's, the
same context for every method); a row sums both turns. Prompts use the target's chat template when
it has one, else a plain ``User: ... / Assistant:`` transcript (HumanEval: the raw code prompt).

Results are cached under ``cache_root()/results/bench/<key>/`` (``rows.csv``, ``summary.json``,
manifest); the key covers every parameter, the drafter's weights (sha256), the package version,
the device and the thread count.

Over ~450 lines because the methods it times run interleaved from one loop with shared warm-up, cost
measurement and the paired speedup interval.
"""
from __future__ import annotations

import csv
import json
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .cache import atomic_directory, cache_root, params_key, read_manifest, write_manifest
from .errors import BenchError, DatasetError, is_int
from .settings_cli import setting, split_seed_setting

if TYPE_CHECKING:
    from .models import Target

BENCH_DATASETS = ("mt-bench", "humaneval", "sharegpt")
DECODE_METHODS = ("hf_generate", "plain", "hf_prompt_lookup", "eagle3")
MODES = ("chain", "tree", "auto")
ROW_FIELDS = ("prompt_id", "dataset", "method", "turns", "prompt_tokens", "new_tokens", "target_forwards",
              "tau", "mean_accepted", "tie_rechecks", "paused_tokens", "seconds", "tokens_per_second", "lossless")



@dataclass
class BenchPrompt:
    """One benchmark item: its user turns (MT-bench has two) or a raw text prompt."""

    id: str
    turns: list[str]
    raw: bool = False  # True: the text is fed as is (HumanEval on a model without a chat template)


@dataclass
class BenchResult:
    rows: list[dict]  # one per prompt x method, fields ROW_FIELDS
    summary: dict
    key: str
    path: Path | None = None
    settings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BenchSettings:
    """How :func:`run_bench` decodes and what it measures; checked when made, so a bad value fails
    before any model work. Every field enters the cache key (as the run's ``settings``).

    ``mode``: ``"chain"`` (``draft_len`` tokens), ``"tree"`` (``depth``/``top_k``/``total_tokens``,
    EAGLE-2 dynamic tree) or ``"auto"`` (the chain length up to ``draft_len``, 0 = plain decoding,
    and a confidence threshold chosen by :func:`wavesurf.drafter.adaptive.tune` on ``n_calibration``
    further prompts); ``tree``: a :class:`~wavesurf.drafter.tree.TreeSpec` to decode with instead of
    ``mode`` and the shape fields. ``methods``: a subset of :data:`DECODE_METHODS` (``hf_generate``, the
    reference of speedup and losslessness, always runs). ``split_seed``: the ShareGPT split.
    ``lookup_ngram``: n > 0 drafts each chain's first tokens by n-gram lookup over the context
    (suffixes of up to n tokens; :mod:`wavesurf.drafter.lookup`) and lets the head continue after
    them; 0 = the head alone. Chains only (modes 'chain' and 'auto'). ``guard`` (mode 'auto'):
    pause the head while the cycles it drafted lately cost more per token than plain decoding,
    priced by the measured costs (:mod:`wavesurf.drafter.guard`).
    """

    # setting(...) adds the command-line help (wavesurf.settings_cli); the defaults are the fields' own
    n_prompts: int = setting(10, positive=True, help="prompts")
    max_new_tokens: int = setting(128, positive=True, help="new tokens per turn")
    mode: str = setting("chain", choices=MODES, help="chain of draft_len tokens, a dynamic tree, or auto: chain "
                        "length (up to draft_len, 0 = plain decoding) and confidence threshold chosen from costs "
                        "measured here and n_calibration further prompts")
    draft_len: int = setting(4, positive=True, help="chain: draft tokens per cycle; auto: the most")
    depth: int = setting(5, positive=True, help="tree: most draft tokens on one path")
    top_k: int = setting(4, positive=True, help="tree: children per expanded node and nodes expanded per level")
    total_tokens: int = setting(16, positive=True, help="tree: draft tokens verified per cycle")
    tree: Any = None  # TreeSpec | None (drafter.tree imports torch, this module does not)
    temperature: float = setting(0.0, help="0 = greedy; > 0 samples (lossless in law)")
    seed: int = setting(0, help="sampling seed")
    methods: tuple[str, ...] = setting(DECODE_METHODS, help=f"subset of {','.join(DECODE_METHODS)} (hf_generate always runs)")
    prompt_lookup_tokens: int = setting(10, positive=True, help="HF prompt_lookup_num_tokens")
    max_prompt_tokens: int = setting(512, positive=True, help="skip longer prompts")
    split_seed: int = split_seed_setting()
    warmup: int = setting(1, help="warm-up runs per method, not timed")
    n_calibration: int = setting(2, positive=True, help="auto: prompts tuned on, not benchmarked")
    lookup_ngram: int = setting(0, help="chain/auto: draft each chain's first tokens by n-gram lookup over the "
                                "context (suffixes of up to N tokens, latest match) and let the head continue after "
                                "them; 0 = the head alone (3 is prompt lookup's usual setting)")
    guard: bool = setting(True, help="auto: pause the head while the cycles it drafted lately cost more per token "
                          "than plain decoding, and probe again later")

    def __post_init__(self) -> None:
        object.__setattr__(self, "methods", tuple(self.methods))
        self.check()

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> BenchSettings:
        """From a profile's ``bench`` dict; unknown keys are refused by name."""
        known = {f for f in cls.__dataclass_fields__}
        bad = sorted(set(spec) - known)
        if bad:
            raise BenchError(f"unknown bench settings {bad}; allowed: {', '.join(sorted(known))}")
        return cls(**spec)

    @property
    def auto(self) -> bool:
        return self.mode == "auto"

    def check(self) -> None:
        """Refuse a bad value, naming it and what is allowed."""
        from .drafter.generation import check_decode_settings

        bad = [m for m in self.methods if m not in DECODE_METHODS]
        if bad or not self.methods:
            raise BenchError(f"methods {bad or list(self.methods)} not allowed; choose from {', '.join(DECODE_METHODS)}")
        check_decode_settings(self.max_new_tokens, self.temperature)
        for name in ("n_prompts", "max_prompt_tokens", "prompt_lookup_tokens"):
            if not is_int(getattr(self, name), 1):
                raise BenchError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if not is_int(self.warmup, 0):
            raise BenchError(f"warmup={self.warmup!r} must be an integer >= 0 (warm-up runs per method)")
        if self.mode not in MODES:
            raise BenchError(f"mode={self.mode!r} is not one of {', '.join(map(repr, MODES))}")
        if not isinstance(self.guard, bool):
            raise BenchError(f"guard={self.guard!r} must be True or False (mode 'auto' only)")
        if self.auto and not is_int(self.n_calibration, 1):
            raise BenchError(f"n_calibration={self.n_calibration!r} must be a positive integer (prompts tuned on in mode 'auto')")
        if self.tree is not None:
            from .drafter.tree import TreeSpec

            if not isinstance(self.tree, TreeSpec):
                raise BenchError(f"tree={self.tree!r} must be a TreeSpec (TreeSpec.chain(4), make_tree('tree', ...)) or None")
            if self.auto:
                raise BenchError("tree=... and mode='auto' exclude each other: 'auto' chooses a chain length up to draft_len")
        from .drafter.lookup import check_lookup_ngram

        check_lookup_ngram(self.lookup_ngram, tree=self.shape(), error=BenchError)  # a tree that cannot be built fails here

    def shape(self) -> Any:
        """The :class:`~wavesurf.drafter.tree.TreeSpec` decoded with (mode 'auto': the longest chain tried)."""
        from .drafter.tree import make_tree

        if self.tree is not None:
            return self.tree
        return make_tree("chain" if self.auto else self.mode, draft_len=self.draft_len, depth=self.depth,
                         top_k=self.top_k, total_tokens=self.total_tokens)

    def run_methods(self) -> list[str]:
        """The methods run, ``hf_generate`` first when it was not asked for."""
        methods = list(self.methods)
        if "hf_generate" not in methods:
            methods.insert(0, "hf_generate")
        return methods


# ---------------------------------------------------------------------------------------------
# prompts
def bench_prompts(dataset: str, n_prompts: int, target: Target, max_prompt_tokens: int = 512,
                  split_seed: int = 0) -> list[BenchPrompt]:
    """The first ``n_prompts`` items of ``dataset`` whose first turn fits ``max_prompt_tokens``:
    MT-bench (both turns), HumanEval, ShareGPT's held-out split (first user message)."""
    from .data import load_corpus

    if dataset not in BENCH_DATASETS:
        raise BenchError(f"dataset={dataset!r} is not one of {', '.join(BENCH_DATASETS)}")
    if not isinstance(n_prompts, int) or n_prompts < 1:
        raise BenchError(f"n_prompts={n_prompts!r} must be a positive integer")
    corpus = load_corpus(dataset, split="heldout" if dataset == "sharegpt" else None, seed=split_seed)
    out: list[BenchPrompt] = []
    for ex in corpus.examples:
        if dataset == "mt-bench":
            p = BenchPrompt(ex.id, list(ex.meta["turns"]))
        elif dataset == "humaneval":
            p = BenchPrompt(ex.id, [ex.meta["prompt"]], raw=not target.has_chat_template)
        else:
            users = [m["content"] for m in ex.messages or [] if m["role"] == "user"]
            if not users or not users[0].strip():
                continue
            p = BenchPrompt(ex.id, [users[0]])
        if len(prompt_ids(target, p, [])) > max_prompt_tokens:
            continue
        out.append(p)
        if len(out) == n_prompts:
            return out
    raise DatasetError(f"{dataset} has only {len(out)} prompts of at most {max_prompt_tokens} tokens; "
                       f"ask for n_prompts <= {len(out)} or raise max_prompt_tokens")


def prompt_ids(target: Target, prompt: BenchPrompt, answers: Sequence[str]) -> list[int]:
    """Token ids asking turn ``len(answers)`` of ``prompt`` after the earlier ``answers``."""
    from .data import generation_prompt_ids

    if prompt.raw:
        return target.tokenizer(prompt.turns[0], add_special_tokens=True)["input_ids"]
    messages = []
    for i in range(len(answers) + 1):
        messages.append({"role": "user", "content": prompt.turns[i]})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return generation_prompt_ids(target, messages)


# ---------------------------------------------------------------------------------------------
def untrained_head(target: Target, layer_ids: Sequence[int] | None = None, draft_vocab_size: int = 8192, seed: int = 0):
    """A deterministic untrained head (vocabulary: the first ``draft_vocab_size`` ids) for smoke
    runs and losslessness checks; it accepts almost nothing, so tau ~ 1."""
    import torch

    from .drafter.head import DraftConfig, DraftHead, init_head

    v = min(draft_vocab_size, target.vocab_size)
    head = init_head(DraftHead(DraftConfig.for_target(target, list(layer_ids or target.default_layer_ids()), v)), seed=seed)
    head.set_vocab(torch.arange(v))
    return head.eval()


def _run_method(method: str, target: Target, decoder: Any, ids: list[int], max_new_tokens: int, temperature: float,
                seed: int, prompt_lookup: int):
    from .drafter.decode import greedy_generate, hf_generate

    if method == "hf_generate":
        return hf_generate(target, ids, max_new_tokens, temperature, seed)
    if method == "plain":
        return greedy_generate(target, ids, max_new_tokens, temperature, seed)
    if method == "hf_prompt_lookup":
        return hf_generate(target, ids, max_new_tokens, temperature, seed, prompt_lookup_num_tokens=prompt_lookup)
    return decoder.generate(ids, max_new_tokens, temperature, seed)


def run_bench(
    target: Target,
    head: Any,
    dataset: str = "mt-bench",
    settings: BenchSettings | None = None,
    *,
    use_cache: bool = True,
    progress: bool = True,
    drafter_id: str | None = None,
) -> BenchResult:
    """Benchmark ``head`` on ``target`` over ``settings.n_prompts`` prompts of ``dataset`` with the
    decoding of ``settings`` (:class:`BenchSettings`; its defaults when None); see the module
    docstring for the definitions. Returns tidy rows (one per prompt x method) and a summary; in
    mode 'auto' the choice, its predicted speedup and the cost model go into the summary.
    ``drafter_id`` names the head in the cache key (default:
    :func:`wavesurf.drafter.head.head_fingerprint`)."""
    import torch

    from .drafter.decode import SpeculativeDecoder, default_tie_eps
    from .drafter.head import head_fingerprint
    from .progress import progress_bar

    b = settings if settings is not None else BenchSettings()
    if not isinstance(b, BenchSettings):
        raise BenchError(f"settings={b!r} must be a BenchSettings (or None for its defaults)")
    if dataset not in BENCH_DATASETS:
        raise BenchError(f"dataset={dataset!r} is not one of {', '.join(BENCH_DATASETS)}")
    methods, tree, auto = b.run_methods(), b.shape(), b.auto
    n_prompts, max_new_tokens, temperature, seed = b.n_prompts, b.max_new_tokens, b.temperature, b.seed
    n_calibration, prompt_lookup_tokens = b.n_calibration, b.prompt_lookup_tokens
    settings = {  # the cache key: these names and values, as they have always been written
        "model": target.name, "drafter": drafter_id or head_fingerprint(head), "dataset": dataset,
        "split": "heldout" if dataset == "sharegpt" else None, "split_seed": b.split_seed, "n_prompts": n_prompts,
        "max_new_tokens": max_new_tokens, **tree.describe(), "temperature": float(temperature), "seed": seed,
        "methods": methods, "prompt_lookup_tokens": prompt_lookup_tokens, "max_prompt_tokens": b.max_prompt_tokens,
        "warmup": b.warmup, "tie_eps": default_tie_eps(target), "device": target.device, "threads": torch.get_num_threads(),
        "wavesurf": __version__, "layer_ids": list(head.config.layer_ids),
        "draft_vocab_size": head.config.draft_vocab_size,
    }
    if b.lookup_ngram:  # only when set: runs of the head alone keep their cache keys
        settings["lookup_ngram"] = b.lookup_ngram
    if auto:
        settings.update(mode="auto", max_draft_len=settings.pop("depth"), n_calibration=n_calibration)
        if b.guard:  # only when set: earlier auto runs (no guard) keep their cache keys
            settings["guard"] = True
        for k in ("top_k", "total_tokens"):
            settings.pop(k)
    key = params_key(settings)
    path = cache_root() / "results" / "bench" / key
    if use_cache and read_manifest(path) is not None:
        return load_bench(path)

    prompts = bench_prompts(dataset, n_prompts + (n_calibration if auto else 0), target, b.max_prompt_tokens,
                            b.split_seed)
    adaptive: dict = {}
    decoder = None
    if "eagle3" in methods and auto:
        from .drafter.adaptive import adaptive_decoder, tune

        calibration, prompts = prompts[n_prompts:], prompts[:n_prompts]
        if not calibration:
            raise BenchError(f"{dataset} has no prompts left for calibration after the {n_prompts} benchmarked ones; "
                             "use fewer --n-prompts")
        choice, costs = tune(target, head, [prompt_ids(target, p, []) for p in calibration],
                             max_draft_len=b.draft_len, max_new_tokens=max_new_tokens, lookup_ngram=b.lookup_ngram)
        decoder = adaptive_decoder(target, head, choice, b.lookup_ngram, costs=costs if b.guard else None)
        adaptive = {"choice": choice.describe(), "costs": costs.describe(), "guard": b.guard}
    elif "eagle3" in methods:
        decoder = SpeculativeDecoder(target, head, tree, lookup_ngram=b.lookup_ngram)
    for _ in range(b.warmup):  # warm-up (excluded): every method once on a short run
        ids = prompt_ids(target, prompts[0], [])
        for m in methods:
            _run_method(m, target, decoder, ids, 8, temperature, seed, prompt_lookup_tokens)
    rows: list[dict] = []
    t_start = time.perf_counter()
    bar = progress_bar(total=len(prompts) * len(methods), disable=not progress, desc=f"bench {target.name} {dataset}", unit="run")
    for pi, prompt in enumerate(prompts):
        order = methods[pi % len(methods):] + methods[: pi % len(methods)]
        acc: dict[str, dict] = {m: {"new_tokens": 0, "target_forwards": 0, "seconds": 0.0, "cycle_tokens": [],
                                    "accepted": [], "tie_rechecks": 0, "paused_tokens": 0, "prompt_tokens": 0, "same": True}
                                for m in methods}
        answers: list[str] = []
        for turn in range(len(prompt.turns)):
            ids = prompt_ids(target, prompt, answers)
            results = {m: _run_method(m, target, decoder, ids, max_new_tokens, temperature, seed + pi,
                                      prompt_lookup_tokens) for m in order}
            ref = results["hf_generate"].tokens
            for m, r in results.items():
                a = acc[m]
                a["new_tokens"] += r.new_tokens
                a["target_forwards"] += r.n_target_forwards
                a["seconds"] += r.seconds
                a["cycle_tokens"] += r.cycle_tokens
                a["accepted"] += r.accepted
                a["tie_rechecks"] += r.tie_rechecks
                a["paused_tokens"] += r.paused_tokens
                a["prompt_tokens"] += len(ids)
                a["same"] &= r.tokens == ref
            text = target.tokenizer.decode(ref, skip_special_tokens=True).strip()
            answers.append(text)
        for m in methods:
            a = acc[m]
            n_cyc = len(a["cycle_tokens"])
            tau = sum(a["cycle_tokens"]) / n_cyc if n_cyc else float("nan")
            rows.append({
                "prompt_id": prompt.id, "dataset": dataset, "method": m, "turns": len(prompt.turns),
                "prompt_tokens": a["prompt_tokens"], "new_tokens": a["new_tokens"],
                "target_forwards": a["target_forwards"], "tau": round(tau, 4),
                "mean_accepted": round(sum(a["accepted"]) / len(a["accepted"]), 4) if a["accepted"] else "",
                "tie_rechecks": a["tie_rechecks"], "paused_tokens": a["paused_tokens"], "seconds": round(a["seconds"], 4),
                "tokens_per_second": round(a["new_tokens"] / a["seconds"], 4) if a["seconds"] > 0 else "",
                "lossless": (a["same"] if temperature == 0 else ""),
            })
        bar.update(len(methods))
    bar.close()
    summary = summarize(rows, settings)
    if adaptive:
        summary["adaptive"] = adaptive
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 2)
    summary["machine"] = platform.machine()
    from .models import processor_name

    summary["processor"] = processor_name()
    result = BenchResult(rows, summary, key, None, settings)
    if use_cache:
        save_bench(result, path)
        result.path = path
    return result


def speedup_interval(rows: list[dict], method: str, *, level: float = 0.95, n_boot: int = 2000,
                     seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of ``method``'s speedup (mean tokens/s over mean tokens/s of
    ``hf_generate``), resampling prompts with both methods' timings of a prompt kept together, so
    prompt-to-prompt differences in length and content do not widen it. None below 2 prompts."""
    import numpy as np

    ref = {r["prompt_id"]: float(r["tokens_per_second"]) for r in rows if r["method"] == "hf_generate"}
    pairs = [(float(r["tokens_per_second"]), ref[r["prompt_id"]]) for r in rows
             if r["method"] == method and r["prompt_id"] in ref]
    if len(pairs) < 2:
        return None
    a = np.array(pairs)
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n_boot, len(a)))
    ratios = a[idx, 0].mean(axis=1) / a[idx, 1].mean(axis=1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))


def summarize(rows: list[dict], settings: dict) -> dict:
    """Per method: mean tokens/s, speedup against HF greedy, pooled tau, lossless count."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    ref = by.get("hf_generate", [])
    ref_tps = sum(float(r["tokens_per_second"]) for r in ref) / len(ref) if ref else float("nan")
    methods = {}
    for m, rs in by.items():
        tps = sum(float(r["tokens_per_second"]) for r in rs) / len(rs)
        after = sum(r["new_tokens"] - r["turns"] for r in rs)
        fwd = sum(r["target_forwards"] - r["turns"] for r in rs)
        entry = {
            "prompts": len(rs), "new_tokens": sum(r["new_tokens"] for r in rs),
            "seconds": round(sum(r["seconds"] for r in rs), 3), "mean_tokens_per_second": round(tps, 3),
            "speedup": round(tps / ref_tps, 4) if ref_tps == ref_tps and ref_tps > 0 else None,
            "tau": round(after / fwd, 4) if fwd > 0 else None,
            "mean_tau_per_prompt": round(sum(float(r["tau"]) for r in rs) / len(rs), 4),
        }
        if m != "hf_generate" and ref:
            ci = speedup_interval(rows, m)
            entry["speedup_ci95"] = [round(ci[0], 4), round(ci[1], 4)] if ci else None
        if settings.get("temperature", 0) == 0:
            entry["lossless"] = f"{sum(1 for r in rs if r['lossless'] is True)}/{len(rs)}"
        if m == "eagle3":
            entry["tie_rechecks"] = sum(int(r["tie_rechecks"]) for r in rs)
            entry["paused_tokens"] = sum(int(r.get("paused_tokens") or 0) for r in rs)
        methods[m] = entry
    return {"settings": settings, "methods": methods,
            "definitions": {"tau": "tokens after each prompt's first / target forwards after the prefill (pooled)",
                            "speedup": "mean tokens/s of the method / mean tokens/s of hf_generate",
                            "speedup_ci95": "95% percentile bootstrap over prompts, paired with hf_generate",
                            "lossless": "output token-identical to hf_generate (T=0 only)"}}


def save_bench(result: BenchResult, path: Path) -> None:
    with atomic_directory(path, overwrite=True) as tmp:
        with open(tmp / "rows.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=ROW_FIELDS)
            w.writeheader()
            w.writerows(result.rows)
        (tmp / "summary.json").write_text(json.dumps(result.summary, indent=2))
        write_manifest(tmp, {"kind": "bench", "key": result.key, "settings": result.settings})


def load_bench(path: Path) -> BenchResult:
    """Read a cached benchmark (rows come back as strings except the numbers below)."""
    path = Path(path)
    manifest = read_manifest(path) or {}
    with open(path / "rows.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        for k in ("turns", "prompt_tokens", "new_tokens", "target_forwards", "tie_rechecks"):
            r[k] = int(r[k])
        r["paused_tokens"] = int(r.get("paused_tokens") or 0)  # absent from runs cached before the guard
        for k in ("tau", "seconds", "tokens_per_second"):
            r[k] = float(r[k]) if r[k] not in ("", "nan") else float("nan")
        r["lossless"] = {"True": True, "False": False}.get(r["lossless"], "")
    summary = json.loads((path / "summary.json").read_text())
    return BenchResult(rows, summary, manifest.get("key", path.name), path, manifest.get("settings", {}))


__all__ = ["BENCH_DATASETS", "DECODE_METHODS", "BenchError", "BenchPrompt", "BenchResult", "BenchSettings", "bench_prompts",
           "load_bench", "prompt_ids", "run_bench", "summarize", "untrained_head"]
