"""A feature store for drafter training: the target runs once over the training split, and every
drafter (any layer set, any draft vocabulary) trains from the stored residual streams.

Layout (``cache_root()/drafter/features/<model>-<key>/``, key = every parameter that changes the
content)::

    build.json                 parameters; written first, checked when a build resumes
    shard_00000.safetensors    one capture batch, real tokens only (no padding):
        hidden.<id>   [n, d] float16 (float32 where float16 would overflow, or dtype="float32")
        input_ids     [n] int64
        loss_mask     [n] bool    token is an assistant token (or content, see ``loss_roles``)
        target_argmax [n] int64   argmax of the target's full next-token distribution
        token_entropy [n] float32 nats
        lengths       [b] int64   sequences of the batch, in order (positions restart at 0)
    wavesurf-manifest.json     written last: the store is complete

Layer N (last block, before the final norm) is always stored: the trainer recomputes the
target's next-token logits over the draft vocabulary from it (:class:`TargetHead`) instead of
storing [n, V] logits. Shards are written atomically one by one, so an interrupted build keeps
its finished shards and a rebuild continues after them. Disk: ``2 * d * len(layer_ids)`` bytes
per token for float16 states (4 * d for a layer whose values overflow float16 in a shard, as
Gemma's residual streams do), plus 25 bytes of ids and masks.
"""
from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import is_int
from .._version import __version__
from ..cache import (describe_differences, entry_dir, params_key, read_manifest, resume_build, verify_directory,
                     write_manifest)
from ..settings_cli import max_len_setting, setting, split_seed_setting
from ..data import ROLE_ASSISTANT, ROLE_TEMPLATE, make_batches
from .head import DrafterError

if TYPE_CHECKING:
    from ..models import Target

FEATURE_FORMAT = 1
STORE_DTYPES = ("float16", "float32")


@dataclass
class FeatureSettings:
    """What a feature store holds. ``layer_ids`` None = every id 0..N (vLLM convention); id N is
    always added. ``max_tokens`` is the exact number of real training-split tokens captured (None:
    every example of the corpus, each cut at ``max_len``)."""

    # setting(...) adds the command-line help (wavesurf.settings_cli); the defaults are the fields' own
    dataset: str = setting("sharegpt", help="training corpus: sharegpt@<model> (the target's own answers to the "
                           "ShareGPT train split, made by `wavesurf distill`; what EAGLE-3 trains on), sharegpt "
                           "(GPT-3.5's answers), or a .jsonl path")
    split: str | None = setting("train", help="ShareGPT split")
    split_seed: int = split_seed_setting()
    max_tokens: int = setting(200_000, positive=True, help="training-split tokens captured into the feature store")
    max_len: int = max_len_setting()
    batch_tokens: int = setting(4096, positive=True, help="padded tokens per forward pass of the target")
    layer_ids: list[int] | None = None
    dtype: str = setting("float16", choices=STORE_DTYPES, help="feature dtype on disk")

    def check(self) -> None:
        if self.dtype not in STORE_DTYPES:
            raise DrafterError(f"feature dtype {self.dtype!r} is not one of {STORE_DTYPES}")
        for name in ("max_tokens", "max_len", "batch_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_tokens":
                continue
            if not is_int(value, 1):
                raise DrafterError(f"{name}={value!r} must be a positive integer" + (" or None (the whole corpus)"
                                                                                      if name == "max_tokens" else ""))


class TargetHead:
    """The target's final norm and unembedding (plus final-logit softcapping if its config has
    one), optionally restricted to the rows ``vocab_ids``: next-token logits from stored layer-N
    states without storing [n, V] logits."""

    def __init__(self, target: Target, vocab_ids: Any | None = None):
        import torch

        from ..taps import decoder_blocks

        model = target.model
        self.norm = decoder_blocks(model).norm
        head = model.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if vocab_ids is not None:
            idx = torch.as_tensor(np.asarray(vocab_ids), dtype=torch.long, device=weight.device)
            weight = weight[idx]
            bias = bias[idx] if bias is not None else None
        self.weight = weight.detach()
        self.bias = bias.detach() if bias is not None else None
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    def logits(self, last_hidden: Any) -> Any:
        """float32 logits [..., rows] of layer-N states [..., d] (any float dtype)."""
        import torch
        from torch.nn import functional as F

        with torch.no_grad():
            x = self.norm(last_hidden.to(self.weight.dtype))
            z = F.linear(x, self.weight, self.bias).float()
            if self.softcap:
                z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def argmax(self, last_hidden: Any, chunk_rows: int = 1024) -> Any:
        """Argmax over the rows of each state, in chunks (never [n, V] at once)."""
        import torch

        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for s in range(0, flat.shape[0], chunk_rows):
            out[s : s + chunk_rows] = self.logits(flat[s : s + chunk_rows]).argmax(-1)
        return out.reshape(last_hidden.shape[:-1])


# ---------------------------------------------------------------------------------------------
def store_dir(model_name: str, key: str) -> Path:
    return entry_dir("drafter/features", model_name, key)


def _shard_name(i: int) -> str:
    return f"shard_{i:05d}.safetensors"


def store_params(target: Target, settings: FeatureSettings) -> dict[str, Any]:
    from ..data import generated_corpus_info

    ids = sorted(set(target.check_layer_ids(settings.layer_ids) if settings.layer_ids is not None
                     else target.layer_ids) | {target.n_layers})
    params = {"format": FEATURE_FORMAT, "wavesurf": __version__, "model": target.name, "source": target.source,
              "n_layers": target.n_layers, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
              "target_dtype": target.dtype, **asdict(replace(settings, layer_ids=ids))}
    # a <corpus>@<model> name: the key follows the generated corpus it resolves to (plain corpora: unchanged)
    corpus_info = generated_corpus_info(settings.dataset, settings.split, settings.split_seed)
    if corpus_info is not None:
        params["corpus_info"] = corpus_info
    return params


def build_feature_store(
    target: Target,
    settings: FeatureSettings | None = None,
    *,
    path: str | Path | None = None,
    progress: bool = True,
    on_shard: Callable[[int, int], None] | None = None,
    **overrides: Any,
) -> FeatureStore:
    """Capture the training split once and store it (see the module docstring), or return the
    finished store with the same parameters. An unfinished build in the same place resumes after
    its last finished shard. ``path`` overrides the cache location; ``on_shard(index, tokens
    written so far)`` is called after each shard is on disk."""
    import torch
    from safetensors.torch import save_file
    from ..progress import progress_bar

    from ..capture import capture
    from ..data import check_corpus_target, encode, encode_budget, load_corpus

    settings = replace(settings or FeatureSettings(), **overrides)
    settings.check()
    params = store_params(target, settings)
    key = params_key(params)
    where = Path(path) if path is not None else store_dir(target.name, key)
    if read_manifest(where) is not None:
        store = FeatureStore(where)
        if store.params != params:
            raise DrafterError(f"{where} holds a feature store with other parameters "
                               f"({describe_differences(store.params, params)}); choose another path")
        return store
    ids = params["layer_ids"]
    corpus = load_corpus(settings.dataset, split=settings.split, seed=settings.split_seed)
    check_corpus_target(corpus, target)
    if settings.max_tokens is None:  # the whole corpus, each example cut at max_len
        encoded = [e for e in (encode(x, target.tokenizer, target.has_chat_template, settings.max_len)
                               for x in corpus.examples) if len(e) >= 2]
    else:
        encoded = encode_budget(corpus, target.tokenizer, target.has_chat_template, settings.max_tokens,
                                settings.max_len)
    has_assistant = any(bool((e.roles == ROLE_ASSISTANT).any()) for e in encoded)
    loss_roles = "assistant" if has_assistant else "content"
    batches = make_batches(encoded, settings.batch_tokens)

    resume_build(where, params, {"key": key}, "feature store", DrafterError)
    for stale in where.glob(".shard_*.tmp"):  # a shard whose write was interrupted
        stale.unlink()
    done = 0
    while (where / _shard_name(done)).is_file():
        done += 1
    done = min(done, len(batches))
    head = TargetHead(target)
    torch_dtype = getattr(torch, settings.dtype)
    total = sum(len(e) for e in encoded)
    written = sum(len(e) for b in batches[:done] for e in b)
    bar = progress_bar(total=total, initial=written, unit="tok", unit_scale=True, disable=not progress,
               desc=f"features {target.name}", smoothing=0.1)
    t0 = time.perf_counter()
    widened: list[list[int]] = []  # [shard, layer] stored float32 because float16 would overflow
    try:
        for i in range(done, len(batches)):
            batch = batches[i]
            width = max(len(e) for e in batch)
            (cb,) = list(capture(target, batch, total, layer_ids=ids, max_len=settings.max_len,
                                 batch_tokens=width * len(batch), progress=False))
            m = cb.attention_mask
            lengths = m.sum(1)
            tensors = {}
            for j in ids:
                state = cb.hidden[j][m]
                small = state.to(torch_dtype)
                if bool(torch.isfinite(small).all()):
                    tensors[f"hidden.{j}"] = small.cpu().contiguous()
                elif bool(torch.isfinite(state).all()):  # beyond float16's range (Gemma): keep this one float32
                    tensors[f"hidden.{j}"] = state.float().cpu().contiguous()
                    widened.append([i, j])
                else:
                    raise DrafterError(f"layer {j} of batch {i} holds non-finite values; the target's forward is broken")
            roles = cb.roles[m]
            loss_mask = roles == ROLE_ASSISTANT if has_assistant else roles != ROLE_TEMPLATE
            tensors.update({
                "input_ids": cb.input_ids[m].cpu(), "loss_mask": loss_mask.cpu(),
                "target_argmax": head.argmax(cb.hidden[target.n_layers][m]).cpu(),
                "token_entropy": cb.token_entropy[m].float().cpu(), "lengths": lengths.cpu().long(),
            })
            tmp = where / f".{_shard_name(i)}.tmp"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                      metadata={"example_ids": json.dumps(cb.example_ids)})
            os.replace(tmp, where / _shard_name(i))
            written += int(lengths.sum())
            bar.update(int(lengths.sum()))
            if on_shard is not None:
                on_shard(i, written)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    shards = [{"file": _shard_name(i), "tokens": sum(len(e) for e in b), "sequences": len(b)}
              for i, b in enumerate(batches)]
    info = {"params": params, "key": key, "layer_ids": ids, "loss_roles": loss_roles, "tokens": total,
            "shards": shards, "convention": "vllm (0 = embeddings, N = last block before the final norm)",
            "bytes_per_token_states": (2 if settings.dtype == "float16" else 4) * target.hidden_size * len(ids),
            "float32_fallback_last_session": widened,
            "build_seconds_last_session": round(seconds, 2),
            "build_tokens_per_second_last_session": round((total - sum(s["tokens"] for s in shards[:done])) / seconds, 1)
            if seconds > 0 and done < len(batches) else None}
    write_manifest(where, info, hash_files=False)
    return FeatureStore(where)


# ---------------------------------------------------------------------------------------------
@dataclass
class _Seq:
    shard: int
    start: int  # row of its first token in the shard
    length: int

    def __len__(self) -> int:
        return self.length


class FeatureStore:
    """A finished feature store; :meth:`batches` reads training batches for any stored layer subset."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        problem = verify_directory(self.path)
        if problem is not None:
            raise DrafterError(f"{self.path} is not a finished feature store ({problem}); build it with "
                               "build_feature_store (an unfinished build resumes)")
        self.manifest = read_manifest(self.path)
        self.params: dict[str, Any] = self.manifest["params"]
        self.key: str = self.manifest["key"]
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.n_layers: int = int(self.params["n_layers"])
        self.hidden_size: int = int(self.params["hidden_size"])
        self.tokens: int = int(self.manifest["tokens"])
        self.loss_roles: str = self.manifest["loss_roles"]
        self.sequences: list[_Seq] = []
        from safetensors import safe_open

        for i, shard in enumerate(self.manifest["shards"]):
            with safe_open(str(self.path / shard["file"]), framework="pt") as fh:
                lengths = fh.get_tensor("lengths").tolist()
            start = 0
            for n in lengths:
                self.sequences.append(_Seq(i, start, int(n)))
                start += int(n)

    @property
    def model(self) -> str:
        return str(self.params["model"])

    @property
    def bytes_per_token(self) -> float:
        """Disk bytes per stored token, everything included."""
        return sum(f["bytes"] for f in self.manifest["files"].values()) / self.tokens

    def check_target(self, target: Target) -> None:
        mine = (self.params["model"], self.n_layers, self.hidden_size, self.params["vocab_size"])
        theirs = (target.name, target.n_layers, target.hidden_size, target.vocab_size)
        if mine != theirs:
            raise DrafterError(f"feature store {self.path} was built from target {mine[0]!r} (N={mine[1]}, d={mine[2]}, "
                               f"V={mine[3]}), not {theirs[0]!r} (N={theirs[1]}, d={theirs[2]}, V={theirs[3]})")

    def check_layer_ids(self, layer_ids: Sequence[int]) -> list[int]:
        """Ascending ids, each one stored; otherwise a :class:`DrafterError` naming the stored ids."""
        from .head import check_draft_layer_ids

        ids = check_draft_layer_ids(layer_ids, self.n_layers)
        missing = [i for i in ids if i not in self.layer_ids]
        if missing:
            raise DrafterError(f"layer ids {missing} are not in feature store {self.path.name}; stored ids: "
                               f"{self.layer_ids}. Build a store with these ids (layer_ids=None stores all)")
        return ids

    def batches(self, layer_ids: Sequence[int], batch_tokens: int = 4096, order: Sequence[int] | None = None) -> FeatureBatches:
        """Training batches (a torch ``Dataset`` of ready batches) of at most ``batch_tokens``
        padded tokens, for ``layer_ids`` (concatenated in ascending order); ``order`` permutes them."""
        return FeatureBatches(self, self.check_layer_ids(layer_ids), batch_tokens, order)

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "model": self.model, "tokens": self.tokens, "layer_ids": self.layer_ids,
                "dtype": self.params["dtype"], "loss_roles": self.loss_roles, "sequences": len(self.sequences),
                "bytes_per_token": round(self.bytes_per_token, 1),
                "bytes_per_token_states": self.manifest["bytes_per_token_states"]}


def _plan(store: FeatureStore, batch_tokens: int) -> list[list[_Seq]]:
    if not is_int(batch_tokens, 1):
        raise DrafterError(f"batch_tokens={batch_tokens!r} must be a positive integer")
    return make_batches(store.sequences, batch_tokens)  # type: ignore[arg-type]


class FeatureBatches:
    """Map-style dataset: item i is one padded batch (right padding) as a dict of CPU tensors:

    ``features`` float32 [B, T, k*d] (layer ids ascending), ``last_hidden`` float32 [B, T, d]
    (layer N), ``input_ids`` int64 [B, T], ``attention_mask`` bool [B, T], ``loss_mask`` bool
    [B, T], ``target_argmax`` int64 [B, T]. Padding holds zeros / False.
    """

    def __init__(self, store: FeatureStore, layer_ids: list[int], batch_tokens: int, order: Sequence[int] | None = None):
        self.store, self.layer_ids, self.batch_tokens = store, layer_ids, batch_tokens
        self.plan = _plan(store, batch_tokens)
        self.order = list(range(len(self.plan))) if order is None else [int(i) for i in order]
        if sorted(self.order) != list(range(len(self.plan))):
            raise DrafterError(f"order must be a permutation of 0..{len(self.plan) - 1}")
        self._open: OrderedDict[int, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self.plan)

    def tokens(self, i: int) -> int:
        return sum(len(s) for s in self.plan[self.order[i]])

    def _shard(self, i: int) -> Any:
        from safetensors import safe_open

        if i not in self._open:
            self._open[i] = safe_open(str(self.store.path / self.store.manifest["shards"][i]["file"]), framework="pt")
            if len(self._open) > 8:
                self._open.popitem(last=False)
        return self._open[i]

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        seqs = self.plan[self.order[i]]
        b, t, d, n = len(seqs), max(len(s) for s in seqs), self.store.hidden_size, self.store.n_layers
        k = len(self.layer_ids)
        out = {
            "features": torch.zeros(b, t, k * d), "last_hidden": torch.zeros(b, t, d),
            "input_ids": torch.zeros(b, t, dtype=torch.long), "attention_mask": torch.zeros(b, t, dtype=torch.bool),
            "loss_mask": torch.zeros(b, t, dtype=torch.bool), "target_argmax": torch.zeros(b, t, dtype=torch.long),
        }
        for r, s in enumerate(seqs):
            fh, rows = self._shard(s.shard), slice(s.start, s.start + s.length)
            for c, j in enumerate(self.layer_ids):
                out["features"][r, : s.length, c * d : (c + 1) * d] = fh.get_slice(f"hidden.{j}")[rows]
            out["last_hidden"][r, : s.length] = fh.get_slice(f"hidden.{n}")[rows]
            for name in ("input_ids", "loss_mask", "target_argmax"):
                out[name][r, : s.length] = fh.get_slice(name)[rows]
            out["attention_mask"][r, : s.length] = True
        return out

    def __getstate__(self) -> dict[str, Any]:  # safetensors handles do not pickle (DataLoader workers)
        return {**self.__dict__, "_open": OrderedDict()}


def open_feature_store(path: str | Path) -> FeatureStore:
    return FeatureStore(path)


def stream_rms(store: FeatureStore, layer_ids: Sequence[int], max_tokens: int = 8192,
               batch_tokens: int = 4096) -> np.ndarray:
    """Root mean square of each stored stream (``layer_ids`` ascending), float64 [k], over the
    first ``max_tokens`` real positions of ``store`` in batch order (padding excluded).

    Why: residual streams differ in scale by one to two orders of magnitude across depth
    (SmolLM2-135M: ~3 at layer 2, ~95 at layers 15 and 27), so an ``fc`` whose columns all start at
    one scale hears mostly the loudest streams; ``TrainSettings(init_fc="inverse_rms")`` divides
    each stream's columns by this. A few thousand tokens pin a scale, not a distribution."""
    import torch

    if not is_int(max_tokens, 1):
        raise DrafterError(f"max_tokens={max_tokens!r} must be a positive integer")
    batches = store.batches(layer_ids, batch_tokens)
    k, d = len(batches.layer_ids), store.hidden_size
    squares = torch.zeros(k, dtype=torch.float64)
    n = 0
    for i in range(len(batches)):
        batch = batches[i]
        x = batch["features"][batch["attention_mask"]][: max_tokens - n].double()  # [P, k*d], real positions
        squares += x.unflatten(-1, (k, d)).pow(2).sum(dim=(0, 2))
        n += x.shape[0]
        if n >= max_tokens:
            break
    if n == 0:
        raise DrafterError(f"feature store {store.path.name} holds no positions to measure stream RMS on")
    return np.sqrt(squares.numpy() / (n * d))


__all__ = ["FeatureSettings", "FeatureStore", "FeatureBatches", "TargetHead", "build_feature_store",
           "open_feature_store", "store_dir", "stream_rms"]
