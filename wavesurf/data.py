"""Corpora, chat formatting with per-token roles, deterministic splits, token budgets, batching.

Every corpus becomes a list of :class:`Example` (a chat as ``messages`` or plain ``text``).
:func:`encode` renders one with the target's chat template (or a plain-text format for base
models without one) and labels every token with the role whose text it comes from.

Over ~450 lines because corpus loading, chat formatting with per-token roles and budgets are one
contract: every position's role and the token budget must agree between capture, distillation and
training.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .assets import CORPUS_ASSETS
from .errors import BudgetError, DatasetError

if TYPE_CHECKING:
    from .models import Target

# Per-token roles. Template/special tokens (chat markers, BOS, a default system prompt the
# template inserts) are ROLE_TEMPLATE; ROLE_TEXT marks plain-text documents.
ROLE_TEMPLATE, ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TEXT = 0, 1, 2, 3, 4
ROLE_IDS = {"system": ROLE_SYSTEM, "user": ROLE_USER, "assistant": ROLE_ASSISTANT}
ROLE_NAMES = {ROLE_TEMPLATE: "template", ROLE_SYSTEM: "system", ROLE_USER: "user",
              ROLE_ASSISTANT: "assistant", ROLE_TEXT: "text"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}

#: ShareGPT split fractions. Conversations are assigned by a seeded hash of their base id, so
#: parts of one long chat ("abc_0", "abc_1") always land in the same split.
SPLIT_FRACTIONS = {"train": 0.8, "stats": 0.1, "heldout": 0.1}
SPLITS = tuple(SPLIT_FRACTIONS)


@dataclass
class Example:
    id: str
    messages: list[dict[str, str]] | None = None  # [{"role": "user"|"assistant"|"system", "content": ...}]
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Corpus:
    name: str
    split: str | None
    examples: list[Example]
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.examples)


# ---------------------------------------------------------------------------------------------
# readers
def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the items of a top-level JSON array one by one, reading ``chunk_chars`` at a time.

    Stops quietly at a cut-off tail (the packaged ShareGPT file ends mid-item): only whole items
    are yielded. A file that does not start with ``[`` raises :class:`DatasetError`.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as fh:
        buf = fh.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise DatasetError(f"{path}: expected a JSON array (first character '['), got {buf[:20]!r}")
        pos, eof = 1, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated last item
                more = fh.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            if end == len(buf) and not eof:  # a number/literal may continue in the next chunk
                more = fh.read(chunk_chars)
                if more:
                    buf, pos = buf[pos:] + more, 0
                    continue
                eof = True
            yield item
            pos = end


def read_sharegpt(path: Path) -> tuple[list[Example], dict[str, Any]]:
    examples, seen, read, skipped = [], set(), 0, 0
    for item in iter_json_array(path):
        read += 1
        messages = []
        for turn in item.get("conversations") or []:
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            content = turn.get("value")
            if role and isinstance(content, str) and content.strip():
                messages.append({"role": role, "content": content})
        cid = str(item.get("id", read))
        if not messages or cid in seen:
            skipped += 1
            continue
        seen.add(cid)
        examples.append(Example(cid, messages=messages))
    info = {"items_read": read, "conversations": len(examples), "skipped_empty_or_duplicate": skipped,
            "note": "the packaged JSON is cut off; only complete items are read"}
    return examples, info


def read_mt_bench(path: Path) -> list[Example]:
    rows = _read_jsonl_objects(path)
    return [Example(f"mt-bench/{r['question_id']}", messages=[{"role": "user", "content": t} for t in r["turns"]],
                    meta={"category": r.get("category"), "turns": list(r["turns"])}) for _, r in rows]


def read_humaneval(path: Path) -> list[Example]:
    rows = _read_jsonl_objects(path)
    return [Example(r["task_id"], messages=[{"role": "user", "content": r["prompt"]}],
                    meta={"prompt": r["prompt"], "entry_point": r.get("entry_point")}) for _, r in rows]


def _read_jsonl_objects(path: Path) -> list[tuple[int, dict]]:
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    if path.is_dir():
        raise DatasetError(f"dataset path {path} is a directory; give a .jsonl file")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}, line {lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{path}, line {lineno}: expected a JSON object, got {type(obj).__name__}")
            rows.append((lineno, obj))
    if not rows:
        raise DatasetError(f"dataset file {path} is empty: expected one JSON object per line")
    return rows


def read_user_jsonl(path: Path) -> list[Example]:
    """A user corpus: one JSON object per line, ``{"messages": [{"role", "content"}, ...]}`` or
    ``{"text": "..."}``; an optional ``"id"``."""
    examples = []
    for lineno, obj in _read_jsonl_objects(path):
        where = f"{path}, line {lineno}"
        ex_id = str(obj.get("id", f"{Path(path).stem}/{lineno}"))
        if "messages" in obj:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
            for i, m in enumerate(msgs, 1):
                if not isinstance(m, dict) or m.get("role") not in ROLE_IDS:
                    got = m.get("role") if isinstance(m, dict) else m
                    raise DatasetError(f"{where}: message {i} has role {got!r}; allowed roles: {', '.join(ROLE_IDS)}")
                if not isinstance(m.get("content"), str):
                    raise DatasetError(f"{where}: message {i} needs a string 'content'")
            examples.append(Example(ex_id, messages=[{"role": m["role"], "content": m["content"]} for m in msgs]))
        elif "text" in obj:
            if not isinstance(obj["text"], str) or not obj["text"].strip():
                raise DatasetError(f"{where}: 'text' must be a non-empty string")
            examples.append(Example(ex_id, text=obj["text"]))
        else:
            raise DatasetError(f"{where}: expected a 'messages' or a 'text' field, got keys {sorted(obj)}")
    return examples


# ---------------------------------------------------------------------------------------------
# splits and corpora
def split_of(example_id: str, seed: int = 0) -> str:
    """The ShareGPT split of a conversation: a seeded hash of its base id (``abc_3`` -> ``abc``)."""
    base, _, suffix = example_id.rpartition("_")
    key = base if base and suffix.isdigit() else example_id
    u = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:15], 16) / 16**15
    acc = 0.0
    for name, frac in SPLIT_FRACTIONS.items():
        acc += frac
        if u < acc:
            return name
    return SPLITS[-1]


def dataset_names() -> list[str]:
    return list(CORPUS_ASSETS)


def load_corpus(name: str, split: str | None = None, seed: int = 0) -> Corpus:
    """Load ``sharegpt`` (optionally one split: ``train``, ``stats``, ``heldout``), ``mt-bench``,
    ``humaneval``, a path to a user ``.jsonl`` file, or ``<corpus>@<model>``: the answers a target
    generated for that corpus's prompts (``wavesurf distill``; a cache lookup, no model is loaded)."""
    if split is not None and split not in SPLITS:
        raise DatasetError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    if parse_generated_name(name) is not None:
        return read_generated(resolve_generated(name, split, seed))
    if name == "sharegpt":
        examples, info = read_sharegpt(CORPUS_ASSETS["sharegpt"].path())
        if split is not None:
            examples = [e for e in examples if split_of(e.id, seed) == split]
        return Corpus(name, split, examples, {**info, "split_seed": seed})
    if split is not None:
        raise DatasetError(f"only 'sharegpt' has splits; {name!r} is used whole (drop split={split!r})")
    if name == "mt-bench":
        return Corpus(name, None, read_mt_bench(CORPUS_ASSETS["mt-bench"].path()))
    if name == "humaneval":
        return Corpus(name, None, read_humaneval(CORPUS_ASSETS["humaneval"].path()))
    path = Path(name).expanduser()
    if path.suffix in (".jsonl", ".gz") or path.exists() or "/" in name:
        return Corpus(str(path), None, read_user_jsonl(path))
    raise DatasetError(f"unknown dataset {name!r}: use one of {', '.join(CORPUS_ASSETS)}, or a path to a .jsonl file")


# ---------------------------------------------------------------------------------------------
# corpora generated by a target (written by wavesurf.distill; read here without torch)
GENERATED_KIND = "generated-corpus"


def parse_generated_name(name: str) -> tuple[str, str, str | None] | None:
    """``sharegpt@smollm2-135m`` -> ``("sharegpt", "smollm2-135m", None)``; ``...#<key>`` names one
    cache entry. None for a plain corpus name or an existing path."""
    if not isinstance(name, str) or "@" not in name or Path(name).expanduser().exists():
        return None
    base, _, model = name.rpartition("@")
    model, _, key = model.partition("#")
    if not base or not model or "@" in base:
        raise DatasetError(f"dataset {name!r}: a generated corpus is named <corpus>@<model> "
                           "(e.g. sharegpt@smollm2-135m), optionally with #<key> for one cache entry")
    return base, model, key or None


def base_corpus(name: str) -> str:
    """The prompts' corpus of a dataset name: ``sharegpt@smollm2-135m`` -> ``sharegpt``."""
    parsed = parse_generated_name(name)
    return parsed[0] if parsed else name


def generated_root() -> Path:
    from .cache import cache_root

    return cache_root() / "corpora"


def generated_entries() -> list[tuple[Path, dict[str, Any]]]:
    """Every finished generated corpus in the cache (manifest present and files intact)."""
    from .cache import read_manifest, verify_directory

    root, out = generated_root(), []
    if root.is_dir():
        for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            manifest = read_manifest(d)
            if manifest and manifest.get("kind") == GENERATED_KIND and verify_directory(d) is None:
                out.append((d, manifest))
    return out


def distill_command(model: str, base: str, split: str | None, seed: int) -> str:
    split_opt = f" --split {split}" if split else ""
    seed_opt = f" --split-seed {seed}" if seed else ""
    return f"wavesurf distill --model {model} --dataset {base}{split_opt}{seed_opt} --max-tokens N"


def resolve_generated(name: str, split: str | None = None, seed: int = 0) -> Path:
    """The cache entry ``<corpus>@<model>`` names: with ``#<key>`` that entry; otherwise, among the
    finished entries of that model, corpus, split and split seed generated with the default
    settings (greedy, default max_len and max_new_tokens), the one with the most tokens."""
    parsed = parse_generated_name(name)
    if parsed is None:
        raise DatasetError(f"{name!r} is not a generated-corpus name <corpus>@<model>")
    base, model, key = parsed
    if base == "sharegpt" and split is None:
        raise DatasetError(f"{name!r}: give the ShareGPT split the prompts came from ({', '.join(SPLITS)})")
    if base != "sharegpt" and split is not None:
        raise DatasetError(f"only 'sharegpt' has splits; {name!r} is used whole (drop split={split!r})")
    same = [(d, m) for d, m in generated_entries()
            if m["params"]["model"] == model and m["params"]["dataset"] == base
            and m["params"]["split"] == split and m["params"]["split_seed"] == (seed if split else m["params"]["split_seed"])]
    where = f"{base}{f' split {split!r}' if split else ''} (split seed {seed})" if split else base
    if key is not None:
        hit = [d for d, m in same if m["key"] == key]
        if not hit:
            raise DatasetError(f"no finished corpus with key {key!r} generated by {model!r} for {where}; "
                               f"finished keys there: {[m['key'] for _, m in same] or 'none'}")
        return hit[0]
    default = [(d, m) for d, m in same if m.get("default_settings")]
    if not default:
        others = f"; entries with other settings: {', '.join(name + '#' + m['key'] for _, m in same)}" if same else ""
        raise DatasetError(f"no finished corpus generated by {model!r} for {where} with the default settings; "
                           f"create it with `{distill_command(model, base, split, seed)}`{others}")
    return max(default, key=lambda dm: (dm[1]["tokens"], dm[1]["key"]))[0]


def read_generated(path: Path) -> Corpus:
    """A finished generated corpus: the examples of its chunk files in order, ``info`` with the
    generation settings, the model (``generated_by``, ``source``) and the cache ``key``."""
    from .cache import read_manifest, verify_directory

    problem = verify_directory(path)
    manifest = read_manifest(path)
    if problem is not None or manifest is None or manifest.get("kind") != GENERATED_KIND:
        raise DatasetError(f"{path} is not a finished generated corpus ({problem or 'not a generated corpus'}); "
                           "rerun `wavesurf distill` with the same options (it resumes)")
    examples: list[Example] = []
    for chunk in manifest["chunks"]:
        with open(Path(path) / chunk["file"], encoding="utf-8") as fh:
            for line in fh:
                rec = json.loads(line)
                examples.append(Example(rec["id"], messages=rec["messages"], meta=rec["meta"]))
    examples = examples[: manifest["examples"]]
    p = manifest["params"]
    info = {"generated_by": p["model"], "source": p["source"], "key": manifest["key"], "path": str(path),
            "split_seed": p["split_seed"], "settings": p, "default_settings": manifest.get("default_settings"),
            **{k: manifest[k] for k in ("examples", "tokens", "answers", "eos_fraction")}}
    return Corpus(f"{p['dataset']}@{p['model']}", p["split"], examples, info)


def generated_corpus_info(name: str, split: str | None = None, seed: int = 0) -> dict[str, Any] | None:
    """What identifies the generated corpus a dataset name resolves to now (model, source, cache key),
    for the keys of results computed from it; None for a plain corpus."""
    if parse_generated_name(name) is None:
        return None
    from .cache import read_manifest

    manifest = read_manifest(resolve_generated(name, split, seed))
    p = manifest["params"]
    return {"generated_by": p["model"], "source": p["source"], "key": manifest["key"]}


def check_corpus_target(corpus: Corpus, target: Target) -> None:
    """Refuse a corpus generated by one model for another target: its answers are the other model's.
    A local directory is one model however it was spelled: its sources compare by resolved path
    (and checkpoint fingerprint where recorded), so corpora written before paths were resolved are
    still accepted by the directory they name."""
    from .models import parse_local_source, same_source

    by = corpus.info.get("generated_by")
    if by is None:
        return
    source = corpus.info.get("source")
    local = source is not None and parse_local_source(source) is not None
    if not same_source(source, target) or (by != target.name and not local):
        raise DatasetError(
            f"corpus {corpus.name!r} was generated by model {by!r} ({source}), not by the target "
            f"{target.name!r} ({target.source}); generate one with "
            f"`{distill_command(target.name, corpus.name.rpartition('@')[0], corpus.split, corpus.info.get('split_seed', 0))}`")


def split_sizes(corpus: Corpus, seed: int = 0) -> dict[str, int]:
    counts = dict.fromkeys(SPLITS, 0)
    for e in corpus.examples:
        counts[split_of(e.id, seed)] += 1
    return counts


# ---------------------------------------------------------------------------------------------
# formatting
@dataclass
class Encoded:
    """One tokenized example: ``input_ids`` and the role of each token (``ROLE_*``)."""

    example_id: str
    input_ids: np.ndarray  # int64 [T]
    roles: np.ndarray  # int8 [T]

    def __len__(self) -> int:
        return len(self.input_ids)


def plain_transcript(messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    """The format of models without a chat template: ``Role: content`` blocks separated by blank
    lines (``User: ...\n\nAssistant: ...\n\n``), ending in ``Assistant:`` when the model is asked
    for the next answer. The one home of this format: corpora, distillation and benchmarks use it."""
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
    return text + "Assistant:" if generation_prompt else text


def generation_prompt_ids(target: Target, messages: list[dict[str, str]]) -> list[int]:
    """Token ids asking the target for the next assistant message after ``messages``: the chat
    template's generation prompt, or :func:`plain_transcript` for base models."""
    tok = target.tokenizer
    if target.has_chat_template:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(plain_transcript(messages, generation_prompt=True), add_special_tokens=True)["input_ids"]


def render(example: Example, tokenizer: Any, use_chat_template: bool) -> tuple[str, list[tuple[int, int, int]], bool]:
    """Text of an example plus the character spans ``(start, end, role)`` of each message, and
    whether special tokens must be added when tokenizing (plain text only)."""
    if example.text is not None:
        return example.text, [(0, len(example.text), ROLE_TEXT)], True
    messages = example.messages or []
    if use_chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        add_special = False
    else:  # base model: a plain transcript format
        text = plain_transcript(messages)
        add_special = True
    spans, cursor = [], 0
    for m in messages:
        for content in (m["content"], m["content"].strip()):
            start = text.find(content, cursor) if content else -1
            if start >= 0:
                spans.append((start, start + len(content), ROLE_IDS[m["role"]]))
                cursor = start + len(content)
                break
    return text, spans, add_special


def encode(example: Example, tokenizer: Any, use_chat_template: bool, max_len: int,
           assistant_eot: bool | None = None) -> Encoded:
    """Tokens and per-token roles of one example, cut at ``max_len``.

    ``assistant_eot``: whether the special end-of-turn token that closes an assistant message
    (``<|im_end|>`` for ChatML templates) gets ROLE_ASSISTANT, so a drafter learns to predict it.
    None (default) = only where the example says its answer ended there: generated corpora record
    ``meta["answer_eos"]`` per assistant message (False for an answer cut at its token budget,
    whose closing token the template adds, not the model); other corpora keep ROLE_TEMPLATE.
    True / False = every / no assistant message. Plain-text formats have no such token."""
    text, spans, add_special = render(example, tokenizer, use_chat_template)
    enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True, truncation=False)
    ids = np.asarray(enc["input_ids"][:max_len], dtype=np.int64)
    char_roles = np.zeros(len(text) + 1, dtype=np.int8)
    for start, end, role in spans:
        char_roles[start:end] = role
    offsets = np.asarray(enc["offset_mapping"][:max_len], dtype=np.int64).reshape(-1, 2)
    # a token takes the role of its last character: " Two" (leading space from the template) is content
    roles = np.where(offsets[:, 1] > offsets[:, 0], char_roles[np.clip(offsets[:, 1] - 1, 0, len(text))], ROLE_TEMPLATE)
    if use_chat_template and assistant_eot is not False:
        flags = example.meta.get("answer_eos") or [] if assistant_eot is None else None
        special = set(getattr(tokenizer, "all_special_ids", None) or []) | {tokenizer.eos_token_id}
        ends = [end for _, end, role in spans if role == ROLE_ASSISTANT]
        for k, end in enumerate(ends):
            if flags is not None and not (k < len(flags) and flags[k]):
                continue
            i = int(np.searchsorted(offsets[:, 0], end))  # first token starting at/after the message's end
            if i < len(ids) and int(ids[i]) in special:
                roles[i] = ROLE_ASSISTANT
    return Encoded(example.id, ids, roles.astype(np.int8))


def encode_budget(
    corpus: Corpus, tokenizer: Any, use_chat_template: bool, max_tokens: int, max_len: int = 512
) -> list[Encoded]:
    """Encode examples in corpus order until exactly ``max_tokens`` tokens are collected (the last
    one is cut). Raises :class:`BudgetError` if the budget is not positive or the corpus is too small."""
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise BudgetError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not isinstance(max_len, int) or max_len < 2:
        raise BudgetError(f"max_len must be an integer >= 2, got {max_len!r}")
    out, total = [], 0
    for i, ex in enumerate(corpus.examples):
        enc = encode(ex, tokenizer, use_chat_template, max_len)
        if len(enc) < 2:
            continue
        take = min(len(enc), max_tokens - total)
        if take < len(enc):
            enc = Encoded(enc.example_id, enc.input_ids[:take], enc.roles[:take])
        if take >= 2:
            out.append(enc)
            total += take
        if total >= max_tokens:
            return out
    split = f" split {corpus.split!r}" if corpus.split else ""
    raise BudgetError(
        f"max_tokens={max_tokens:,} is more than corpus {corpus.name!r}{split} holds: {total:,} tokens in "
        f"{len(corpus.examples):,} examples at max_len={max_len}; ask for at most {total:,}"
    )


def tokens_for_role_positions(corpus: Corpus, tokenizer: Any, use_chat_template: bool, positions: int,
                              role: int = ROLE_ASSISTANT, max_len: int = 512) -> int:
    """The ``max_tokens`` budget (corpus order, as :func:`encode_budget` takes it) whose tokens hold
    ``positions`` statistics positions of ``role`` (position 0 never counts), or the whole corpus's
    tokens when it holds fewer: a budget that gives a role-filtered analysis as many positions as an
    unfiltered one of ``positions`` tokens."""
    total = found = 0
    for ex in corpus.examples:
        enc = encode(ex, tokenizer, use_chat_template, max_len)
        if len(enc) < 2:
            continue
        hits = np.flatnonzero(enc.roles[1:] == role) + 1  # token indices of the role's positions
        if found + len(hits) >= positions:
            return total + int(hits[positions - found - 1]) + 1
        found += len(hits)
        total += len(enc)
    return total


def make_batches(encoded: Sequence[Encoded], batch_tokens: int = 4096, window: int = 64) -> list[list[Encoded]]:
    """Group examples into batches of at most ``batch_tokens`` padded tokens. Within windows of
    ``window`` consecutive examples, sorting by length keeps padding low; the order is deterministic."""
    if batch_tokens <= 0:
        raise BudgetError(f"batch_tokens must be positive, got {batch_tokens}")
    batches: list[list[Encoded]] = []
    for w in range(0, len(encoded), window):
        chunk = sorted(encoded[w : w + window], key=len, reverse=True)
        current: list[Encoded] = []
        for enc in chunk:
            width = max([len(enc)] + [len(c) for c in current])
            if current and width * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(enc)
        if current:
            batches.append(current)
    return batches
