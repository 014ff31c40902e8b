"""The target's own answers as a training corpus (EAGLE-3 trains its head on what the target says,
which is what the head sees when it drafts; ShareGPT's answers are GPT-3.5's).

For each conversation of a corpus split, every user turn is answered in turn by the target; its
answer replaces the original assistant turn (later user turns are kept, their original answers
dropped). An answer ends at the target's end-of-turn / EOS token, which stays in its token stream
(``meta["answer_eos"]`` tells :func:`wavesurf.data.encode` to give that token ROLE_ASSISTANT), or
at ``max_new_tokens``, or where the rendered conversation would pass ``max_len`` tokens (the
conversation ends there). Generation stops once ``max_tokens`` answer tokens are collected,
counting whole conversations in corpus order.

Batching and exactness. Prompts of similar length are batched (left padding, attention mask, KV
cache: HF ``generate``). A padded batch runs other float32 kernels than batch 1, so logits differ
in the last bits and a greedy argmax can flip where the top-2 gap is tiny. Every greedy step's
top-2 gap is recorded; an answer with a gap below ``TIE_EPS`` anywhere is decoded again at batch 1
(what ``model.generate(do_sample=False)`` gives for that prompt alone). Sampling (``temperature >
0``) draws each answer from its own seeded generator (seed, example id, turn), so the result does
not depend on batch composition either.

Cache: ``cache_root()/corpora/<model>-<key>/`` (key: model name and source, corpus, split, split
seed, budget, max_len, max_new_tokens, temperature, seed, format, wavesurf version). Finished
conversations are written in atomically renamed chunk files of ``chunk_examples`` conversations;
an interrupted run continues after its last chunk and gives the same corpus. A new budget starts
from the chunks of an entry with the same other settings (chunks do not depend on the budget). The manifest is
written last; readers (:func:`wavesurf.data.load_corpus` with ``<corpus>@<model>``) need it.

Over ~450 lines because generation in batches, the resumable chunked cache and the corpus it writes
share one key and one resume check.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .cache import (BUILD_FILE, describe_differences, entry_dir, params_key, read_manifest, resume_build,
                    write_manifest, write_text_atomic)
from .data import (
    GENERATED_KIND, SPLITS, Corpus, DatasetError, Example, generated_root, load_corpus, parse_generated_name,
    read_generated,
)
from .errors import BudgetError, DistillError, is_int

if TYPE_CHECKING:
    from .models import Target

DISTILL_FORMAT = 1
DEFAULT_MAX_TOKENS = 100_000
DEFAULT_MAX_LEN = 512
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BATCH_SIZE = 16
DEFAULT_CHUNK_EXAMPLES = 32
#: top-2 logit gap below which a batched greedy answer is re-decoded at batch 1 (the largest
#: batched-vs-batch-1 logit difference measured on SmolLM2 is far below this, see the README of commit 111d6ab and benchmarks/distill_throughput.py)
TIE_EPS = 1e-3
#: the row count packed weights are chosen and reordered for (a full batch at the default size)
PACKED_ROWS = DEFAULT_BATCH_SIZE



def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    if not is_int(value, minimum):
        raise DistillError(f"{name}={value!r} must be an integer >= {minimum}")


def check_settings(max_tokens: Any, max_len: Any, max_new_tokens: Any, temperature: Any, seed: Any,
                   batch_size: Any, chunk_examples: Any, max_turns: Any = None) -> None:
    """Every setting checked before any corpus or model work."""
    if not is_int(max_tokens, 1):
        raise BudgetError(f"max_tokens={max_tokens!r} must be a positive integer (answer tokens wanted)")
    _check_int("max_new_tokens", max_new_tokens)
    _check_int("max_len", max_len, 2)
    _check_int("batch_size", batch_size)
    _check_int("chunk_examples", chunk_examples)
    _check_int("seed", seed, 0)
    if max_turns is not None and not is_int(max_turns, 1):
        raise DistillError(f"max_turns={max_turns!r} must be a positive integer (user turns answered per "
                           "conversation) or None for every turn")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature >= 0 \
            or temperature == float("inf"):
        raise DistillError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy, > 0 samples)")


# ---------------------------------------------------------------------------------------------
# prompts
def prompt_ids(target: Target, messages: list[dict[str, str]]) -> list[int]:
    """Token ids asking the target for the next assistant message (:func:`wavesurf.data.generation_prompt_ids`)."""
    from .data import generation_prompt_ids

    return generation_prompt_ids(target, messages)


def answer_text(target: Target, ids: list[int], ended_at_eos: bool) -> str:
    """The stored content of an answer: its tokens without the closing EOS (the template adds it
    back), decoded verbatim; plain format drops the one space after ``Assistant:``."""
    text = target.tokenizer.decode(ids[:-1] if ended_at_eos else ids, skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    if not target.has_chat_template and text.startswith(" "):
        text = text[1:]
    return text


def _row_seed(seed: int, example_id: str, turn: int) -> int:
    return int(hashlib.sha256(f"{seed}:{example_id}:{turn}".encode()).hexdigest()[:15], 16)


# ---------------------------------------------------------------------------------------------
# batched generation
@dataclass
class Answer:
    ids: list[int]  # generated tokens, the closing EOS included when there is one
    eos: bool  # ended at EOS (else at its token budget)
    min_gap: float  # smallest top-2 logit gap over its greedy steps (inf when sampling)
    redecoded: bool = False  # decoded again at batch 1 because of a near tie


def _processor(temperature: float, generators: list[Any] | None):
    """A logits processor that records each step's top-2 gap (greedy) or draws each row's token
    from its own generator and returns scores that make greedy selection pick it (sampling)."""
    import torch
    from transformers import LogitsProcessor

    class Recorder(LogitsProcessor):
        def __init__(self) -> None:
            self.gaps: list[Any] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if generators is None:
                top = scores.float().topk(2, dim=-1).values
                self.gaps.append((top[:, 0] - top[:, 1]).cpu())
                return scores
            probs = torch.softmax(scores.float().cpu() / temperature, dim=-1)
            picks = [int(torch.multinomial(probs[r], 1, generator=g)) for r, g in enumerate(generators)]
            out = torch.full_like(scores, float("-inf"))
            out[torch.arange(len(picks)), torch.tensor(picks, device=scores.device)] = 0.0
            return out

    return Recorder()


def distill_tie_eps(target: Target) -> float:
    """:data:`TIE_EPS` in float32; 0 in bfloat16/float16, whose logits tie exactly so often that
    nearly every batched answer would be re-decoded alone, and whose batch-1 answers depend on
    the GPU's kernels anyway (the same rule as ``wavesurf.drafter.decode.default_tie_eps``)."""
    from .drafter.decode import default_tie_eps

    return default_tie_eps(target, TIE_EPS)


def generate_batch(target: Target, prompts: list[list[int]], budgets: list[int], *, eos: set[int],
                   temperature: float = 0.0, row_seeds: list[int] | None = None,
                   tie_eps: float | None = None, packed: bool | None = None) -> list[Answer]:
    """Answers to ``prompts`` (token ids) in one left-padded HF ``generate`` call, each cut at its
    first EOS (kept) or its own token budget. Greedy answers of a batch of more than one whose
    top-2 gap fell below ``tie_eps`` are decoded again alone (``tie_eps=0``: never; ``None``:
    :func:`distill_tie_eps`, no re-decode in half precision). A batch of
    more than one runs on oneDNN-packed weights (:mod:`wavesurf.packed`) where the model allows it
    (``packed=None``) or ``packed=True`` asks: the same sums in another order, which the re-decode
    covers like the padding's; a batch of one keeps HF's kernels."""
    from contextlib import nullcontext

    import torch

    from .packed import packed_for, use_packing

    model, dev = target.model, target.device
    packed = use_packing(packed, model, DistillError)
    kernels = packed_for(model, PACKED_ROWS).active() if packed and len(prompts) > 1 else nullcontext()
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else min(eos) if eos else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    generators = None
    if temperature > 0:
        generators = [torch.Generator().manual_seed(s) for s in (row_seeds or [0] * len(prompts))]
    proc = _processor(temperature, generators)
    with torch.no_grad(), kernels:
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max(budgets),
                             do_sample=False, num_beams=1, eos_token_id=sorted(eos) or None, pad_token_id=pad,
                             logits_processor=[proc], top_k=None, top_p=None, temperature=None)
    new = out[:, width:].cpu()
    gaps = torch.stack(proc.gaps, 1) if proc.gaps else None
    answers = []
    for r, budget in enumerate(budgets):
        row = new[r, :budget].tolist()
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), None)
        row = row[:cut] if cut else row
        gap = float(gaps[r, : len(row)].min()) if gaps is not None and row else float("inf")
        answers.append(Answer(row, cut is not None, gap))
    if tie_eps is None:
        tie_eps = distill_tie_eps(target)
    if temperature == 0 and len(prompts) > 1 and tie_eps > 0:
        for r, a in enumerate(answers):
            if a.min_gap < tie_eps:
                (alone,) = generate_batch(target, [prompts[r]], [budgets[r]], eos=eos, tie_eps=0)
                answers[r] = Answer(alone.ids, alone.eos, alone.min_gap, redecoded=True)
    return answers


# ---------------------------------------------------------------------------------------------
# conversations
@dataclass
class _Conv:
    example: Example
    todo: list[dict[str, str]]  # original messages not yet used
    messages: list[dict[str, str]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    done: bool = False

    def next_prompt(self) -> list[dict[str, str]] | None:
        """Messages up to the next user turn (system messages kept, original answers dropped)."""
        while self.todo and self.todo[0]["role"] != "user":
            m = self.todo.pop(0)
            if m["role"] == "system":
                self.messages.append(m)
        if not self.todo:
            return None
        return [*self.messages, self.todo[0]]


def _distill_chunk(target: Target, examples: list[Example], *, max_len: int, max_new_tokens: int,
                   temperature: float, seed: int, batch_size: int, eos: set[int],
                   on_tokens: Any = None, max_turns: int | None = None) -> list[dict[str, Any]]:
    """Answer every user turn of ``examples`` (the first ``max_turns`` of each, if set), one turn of
    every conversation per round, batching prompts of similar length; the records of the
    conversations that got at least one answer."""
    convs = [_Conv(e, [dict(m) for m in (e.messages or [])]) for e in examples if e.messages]
    stopped = {}  # conversation index -> why it stopped early
    while True:
        asks = []
        for ci, c in enumerate(convs):
            if c.done:
                continue
            if max_turns is not None and len(c.answers) >= max_turns:
                c.done, stopped[ci] = True, "max_turns"
                continue
            msgs = c.next_prompt()
            if msgs is None:
                c.done = True
                continue
            ids = prompt_ids(target, msgs)
            budget = min(max_new_tokens, max_len - len(ids))
            if budget < 1:  # this turn would not fit max_len
                c.done, stopped[ci] = True, "max_len"
                continue
            asks.append((ci, msgs, ids, budget))
        if not asks:
            break
        asks.sort(key=lambda a: (-len(a[2]), a[0]))  # similar lengths together, deterministic
        for b in range(0, len(asks), batch_size):
            group = asks[b : b + batch_size]
            answers = generate_batch(target, [a[2] for a in group], [a[3] for a in group], eos=eos,
                                     temperature=temperature,
                                     row_seeds=[_row_seed(seed, convs[a[0]].example.id, len(convs[a[0]].answers))
                                                for a in group])
            for (ci, msgs, ids, budget), ans in zip(group, answers):
                c = convs[ci]
                c.messages = [*msgs, {"role": "assistant", "content": answer_text(target, ans.ids, ans.eos)}]
                c.todo.pop(0)
                c.answers.append(ans)
                if not ans.eos and budget < max_new_tokens:  # cut by max_len: the conversation ends here
                    c.done, stopped[ci] = True, "max_len"
            if on_tokens is not None:
                on_tokens(sum(len(a.ids) for a in answers))
    records = []
    for ci, c in enumerate(convs):
        if not c.answers:
            continue
        a = c.answers
        records.append({"id": c.example.id, "messages": c.messages, "meta": {
            "original_id": c.example.id, "model": target.name, "turns": len(a),
            "tokens": sum(len(x.ids) for x in a), "answer_tokens": [len(x.ids) for x in a],
            "answer_eos": [x.eos for x in a], "answer_token_ids": [x.ids for x in a],
            "redecoded": [x.redecoded for x in a], "stopped": stopped.get(ci, "end")}})
    return records


# ---------------------------------------------------------------------------------------------
def distill_params(target: Target, dataset: str, split: str | None, split_seed: int, max_tokens: int,
                   max_len: int, max_new_tokens: int, temperature: float, seed: int,
                   max_turns: int | None = None) -> dict[str, Any]:
    params = {"format": DISTILL_FORMAT, "wavesurf": __version__, "model": target.name, "source": target.source,
              "chat_template": target.has_chat_template, "dataset": dataset, "split": split, "split_seed": split_seed,
              "max_tokens": max_tokens, "max_len": max_len, "max_new_tokens": max_new_tokens,
              "temperature": float(temperature), "seed": seed, "tie_eps": distill_tie_eps(target)}
    if max_turns is not None:  # only when set: corpora of every turn keep their keys
        params["max_turns"] = int(max_turns)
    return params


def corpus_dir(model_name: str, key: str) -> Path:
    return entry_dir("corpora", model_name, key)  # = data.generated_root() / ...


def _chunk_name(i: int) -> str:
    return f"chunk_{i:05d}.jsonl"


def _read_chunk(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _reuse_chunks(where: Path, params: dict[str, Any], chunk_examples: int) -> int:
    """Start a new build from the chunks of another entry whose settings differ only in the budget
    (a chunk's content does not depend on it): hard links (or copies) of its leading chunks.
    Returns the chunk size to use (the donor's, so chunk boundaries match)."""
    same = {k: v for k, v in params.items() if k != "max_tokens"}
    best: tuple[int, Path, int] | None = None
    for other in generated_root().glob("*/" + BUILD_FILE):
        if other.parent == where:
            continue
        try:
            old = json.loads(other.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if {k: v for k, v in old.get("params", {}).items() if k != "max_tokens"} != same:
            continue
        n = 0
        while (other.parent / _chunk_name(n)).is_file():
            n += 1
        if n and (best is None or n > best[0]):
            best = (n, other.parent, int(old["chunk_examples"]))
    if best is None:
        return chunk_examples
    n, donor, size = best
    for i in range(n):
        src, dst = donor / _chunk_name(i), where / _chunk_name(i)
        tmp = dst.with_name(f".{dst.name}.tmp")
        try:
            os.link(src, tmp)
        except OSError:
            tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)
    return size


def distill_corpus(
    target: Target,
    dataset: str = "sharegpt",
    split: str | None = "train",
    max_tokens: int = DEFAULT_MAX_TOKENS,
    max_len: int = DEFAULT_MAX_LEN,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    *,
    split_seed: int = 0,
    chunk_examples: int = DEFAULT_CHUNK_EXAMPLES,
    progress: bool = True,
    path: str | Path | None = None,
    on_chunk: Any = None,
    max_turns: int | None = None,
) -> Corpus:
    """Generate (or return the cached) corpus of ``target``'s answers to the prompts of
    ``dataset``/``split``: at least ``max_tokens`` answer tokens, whole conversations in corpus
    order. ``split`` must be None for corpora without splits (everything but ShareGPT).
    ``batch_size`` and ``chunk_examples`` change speed, not the result. ``max_turns`` answers only
    the first user turns of each conversation (1: one answer per conversation, so a token budget
    spreads over more independent conversations, the unit the acceptance intervals resample; and
    every round of generation is a full batch). ``on_chunk(index, tokens so far)`` is called after
    each chunk file is on disk. See the module docstring."""
    from .progress import progress_bar

    from .drafter.decode import eos_ids

    check_settings(max_tokens, max_len, max_new_tokens, temperature, seed, batch_size, chunk_examples, max_turns)
    if not isinstance(dataset, str) or parse_generated_name(dataset) is not None:
        raise DatasetError(f"dataset={dataset!r}: distill reads the prompts of a plain corpus (sharegpt, mt-bench, "
                           "humaneval or a .jsonl path), not of a generated one")
    if dataset == "sharegpt" and split is None:
        raise DatasetError(f"dataset 'sharegpt' needs a split: one of {', '.join(SPLITS)}")
    params = distill_params(target, dataset, split, split_seed, max_tokens, max_len, max_new_tokens,
                            temperature, seed, max_turns)
    key = params_key(params)
    where = Path(path) if path is not None else corpus_dir(target.name, key)
    if read_manifest(where) is not None:
        corpus = read_generated(where)
        if corpus.info["settings"] != params:
            raise DistillError(f"{where} holds a generated corpus with other parameters "
                               f"({describe_differences(corpus.info['settings'], params)}); choose another path")
        return corpus
    source = load_corpus(dataset, split=split, seed=split_seed)
    users = sum(min(max_turns or 10**9, sum(1 for m in (e.messages or []) if m["role"] == "user"))
                for e in source.examples)
    if users * max_new_tokens < max_tokens:
        raise BudgetError(f"max_tokens={max_tokens:,} cannot be met: {source.name!r}"
                          f"{f' split {split!r}' if split else ''} has {users:,} user turns"
                          f"{f' (the first {max_turns} of each conversation)' if max_turns else ''}, so at most "
                          f"{users * max_new_tokens:,} tokens at max_new_tokens={max_new_tokens}; ask for fewer "
                          "or raise max_new_tokens")
    eos = eos_ids(target)
    where.mkdir(parents=True, exist_ok=True)
    resumed = (where / BUILD_FILE).is_file()
    chunk_examples = chunk_examples if resumed else _reuse_chunks(where, params, chunk_examples)
    build = resume_build(where, params, {"key": key, "chunk_examples": chunk_examples}, "generated corpus", DistillError)
    chunk_examples = int(build["chunk_examples"])  # an interrupted run keeps its chunk boundaries
    for stale in where.glob(".chunk_*.tmp"):
        stale.unlink()

    chunks, total, kept = [], 0, 0
    i = 0
    while (where / _chunk_name(i)).is_file():  # finished chunks of an interrupted run
        recs = _read_chunk(where / _chunk_name(i))
        chunks.append({"file": _chunk_name(i), "examples": len(recs)})
        for r in recs:
            if total < max_tokens:
                total += r["meta"]["tokens"]
                kept += 1
        i += 1
    resumed = total
    bar = progress_bar(total=max_tokens, initial=min(total, max_tokens), unit="tok", unit_scale=True, disable=not progress,
               desc=f"distill {target.name} {dataset}{f' {split}' if split else ''}", smoothing=0.1)
    t0 = time.perf_counter()
    generated = 0

    def tick(n: int) -> None:
        nonlocal generated
        generated += n
        bar.update(min(n, max(0, max_tokens - bar.n)))

    try:
        while total < max_tokens:
            start = i * chunk_examples
            if start >= len(source.examples):
                break
            recs = _distill_chunk(target, source.examples[start : start + chunk_examples], max_len=max_len,
                                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                  batch_size=batch_size, eos=eos, on_tokens=tick, max_turns=max_turns)
            write_text_atomic(where / _chunk_name(i), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
            chunks.append({"file": _chunk_name(i), "examples": len(recs)})
            for r in recs:
                if total < max_tokens:
                    total += r["meta"]["tokens"]
                    kept += 1
            if on_chunk is not None:
                on_chunk(i, total)
            i += 1
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    if total < max_tokens:
        raise BudgetError(f"max_tokens={max_tokens:,} is more than the prompts of {source.name!r}"
                          f"{f' split {split!r}' if split else ''} yield: {total:,} answer tokens in "
                          f"{kept:,} conversations at max_len={max_len}, max_new_tokens={max_new_tokens}; "
                          f"ask for at most {total:,} (the answers are cached in {where} for this budget)")
    records = [r for c in chunks for r in _read_chunk(where / c["file"])][:kept]
    answers = sum(r["meta"]["turns"] for r in records)
    eos_answers = sum(sum(r["meta"]["answer_eos"]) for r in records)
    redecoded = sum(sum(r["meta"]["redecoded"]) for r in records)
    defaults = (temperature == 0 and max_len == DEFAULT_MAX_LEN and max_new_tokens == DEFAULT_MAX_NEW_TOKENS)
    info = {"kind": GENERATED_KIND, "params": params, "key": key, "default_settings": defaults,
            "examples": kept, "tokens": total, "answers": answers,
            "eos_fraction": round(eos_answers / answers, 4) if answers else None,
            "redecoded_answers": redecoded, "chunks": chunks, "chunk_examples": chunk_examples,
            "conversations_read": min(len(source.examples), i * chunk_examples),
            "batch_size_last_session": batch_size, "seconds_last_session": round(seconds, 2),
            "tokens_per_second_last_session": round(generated / seconds, 1) if seconds > 0 and generated else None,
            "resumed_from_tokens": resumed}
    write_manifest(where, info, hash_files=False)
    return read_generated(where)


def summary(corpus: Corpus) -> dict[str, Any]:
    """JSON-able facts of a generated corpus (the CLI prints this)."""
    from .cache import read_manifest

    m = read_manifest(Path(corpus.info["path"]))
    return {"dataset": corpus.name, "split": corpus.split, "path": corpus.info["path"], "key": corpus.info["key"],
            "examples": len(corpus), "answers": m["answers"], "tokens": m["tokens"],
            "eos_fraction": m["eos_fraction"], "redecoded_answers": m["redecoded_answers"],
            "tokens_per_second": m["tokens_per_second_last_session"],
            "seconds": m["seconds_last_session"], "default_settings": m["default_settings"],
            "settings": {k: m["params"][k] for k in ("max_tokens", "max_len", "max_new_tokens", "temperature", "seed",
                                                     "split_seed")}}


__all__ = ["DistillError", "distill_corpus", "generate_batch", "prompt_ids", "summary", "DEFAULT_MAX_LEN",
           "DEFAULT_MAX_NEW_TOKENS", "TIE_EPS", "distill_tie_eps"]
