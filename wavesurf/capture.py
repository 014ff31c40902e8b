"""One pass of the target over a corpus, yielding every layer's residual stream per batch.

Layer ids follow vLLM (see :mod:`wavesurf.models`): id 0 is the embedding output and id N the
output of the last block *before* the final norm (HF's ``hidden_states[N]`` is after it). States
are taken with forward hooks, so nothing is copied; a batch lives only until the consumer drops
it, and memory does not grow with the token budget.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._version import __version__
from .cache import atomic_directory, write_manifest
from .errors import CaptureError
from .data import ROLE_ASSISTANT, Corpus, Encoded, check_corpus_target, encode_budget, make_batches
from .models import Target, block_output_ids
from .taps import ResidualTaps, decoder_blocks

ROLE_FILTERS = ("all", "assistant")


def check_roles(roles: str) -> str:
    """Which tokens count for statistics: ``all`` or ``assistant``."""
    if roles not in ROLE_FILTERS:
        raise CaptureError(f"roles={roles!r} is not one of {ROLE_FILTERS}")
    return roles


@dataclass
class CaptureBatch:
    """One padded batch (right padding) with the residual stream of the requested layers."""

    index: int
    hidden: dict[int, Any]  # vLLM layer id -> float tensor [B, T, d]
    input_ids: Any  # long [B, T]
    attention_mask: Any  # bool [B, T]; False on padding
    positions: Any  # long [B, T]; 0 at the first token of each sequence
    roles: Any  # int8 [B, T]; wavesurf.data.ROLE_*
    token_entropy: Any  # float32 [B, T]; nats, of the next-token distribution; 0 on padding
    example_ids: list[str]

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def stat_mask(self, roles: str = "all") -> Any:
        """Positions that count for statistics: not padding, not position 0, and of the chosen roles."""
        check_roles(roles)
        mask = self.attention_mask & (self.positions > 0)
        if roles == "assistant":
            mask = mask & (self.roles == ROLE_ASSISTANT)
        return mask

    def layer(self, layer_id: int) -> Any:
        try:
            return self.hidden[layer_id]
        except KeyError:
            raise KeyError(f"layer {layer_id} was not captured; captured ids: {sorted(self.hidden)}") from None


def token_entropy_from_hidden(model: Any, last_hidden: Any, chunk_rows: int = 1024) -> Any:
    """Entropy (nats) of softmax(lm_head(last_hidden)) per row, in float32 chunks so that the
    [rows, V] logits never exist at once. ``last_hidden`` is *after* the final norm.

    Two [chunk, V] buffers are reused across chunks and every step is in place: fresh 200 MB
    allocations per chunk (page faults) cost more than the arithmetic on a CPU.
    """
    import torch
    import torch.nn.functional as F

    head = model.get_output_embeddings()
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    rows = min(chunk_rows, flat.shape[0])
    z_buf = p_buf = None
    for s in range(0, flat.shape[0], chunk_rows):
        x = flat[s : s + chunk_rows]
        if head.bias is None and head.weight.dtype == torch.float32 and x.dtype == torch.float32:
            if z_buf is None:
                z_buf = torch.empty(rows, head.weight.shape[0], dtype=torch.float32, device=flat.device)
            z = torch.mm(x, head.weight.t(), out=z_buf[: x.shape[0]])
        else:
            z = F.linear(x, head.weight, head.bias).float()
        if cap:
            z.div_(cap).tanh_().mul_(cap)
        z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))  # log p
        if p_buf is None:
            p_buf = torch.empty(rows, z.shape[1], dtype=torch.float32, device=flat.device)
        p = torch.exp(z, out=p_buf[: z.shape[0]])
        out[s : s + chunk_rows] = -p.mul_(z).sum(dim=-1)
    return out.clamp_(min=0.0).reshape(last_hidden.shape[:-1])


def pad_batch(batch: Sequence[Encoded], pad_id: int, device: str):
    import torch

    width = max(len(e) for e in batch)
    ids = np.full((len(batch), width), pad_id, dtype=np.int64)
    roles = np.zeros((len(batch), width), dtype=np.int8)
    mask = np.zeros((len(batch), width), dtype=bool)
    for r, e in enumerate(batch):
        ids[r, : len(e)] = e.input_ids
        roles[r, : len(e)] = e.roles
        mask[r, : len(e)] = True
    positions = np.broadcast_to(np.arange(width), ids.shape).copy()
    to = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return to(ids), to(mask), to(positions), to(roles)


def _pad_id(target: Target) -> int:
    tok = target.tokenizer
    for cand in (tok.pad_token_id, tok.eos_token_id, 0):
        if cand is not None:
            return int(cand)
    return 0


def capture(
    target: Target,
    corpus: Corpus | Sequence[Encoded],
    max_tokens: int,
    *,
    layer_ids: Iterable[int] | None = None,
    max_len: int = 512,
    batch_tokens: int = 4096,
    progress: bool = True,
    shard: Any = None,
) -> Iterator[CaptureBatch]:
    """Run the target once over ``max_tokens`` tokens of ``corpus`` and yield a
    :class:`CaptureBatch` per forward pass, with the residual streams of ``layer_ids`` (default:
    all ids 0..N) and the next-token entropy at every position.

    ``shard`` (a :class:`wavesurf.distributed.Shard`): run only the batches it wants (batch
    indices stay global), for statistics split over several processes.

    The budget counts real (non-padding) tokens fed to the model; the corpus is read in order
    and the last example is cut so the total is exact. A budget the corpus cannot meet raises
    :class:`~wavesurf.errors.BudgetError` before any forward pass.
    """
    import torch
    from .progress import progress_bar

    if layer_ids is None:
        ids = target.layer_ids
    else:
        layer_ids = list(layer_ids)
        ids = target.check_layer_ids(layer_ids) if layer_ids else []  # [] = entropy only
    if isinstance(corpus, Corpus):
        check_corpus_target(corpus, target)
        encoded = encode_budget(corpus, target.tokenizer, target.has_chat_template, max_tokens, max_len)
    else:
        encoded = list(corpus)
    batches = make_batches(encoded, batch_tokens)
    model, pad_id = target.model, _pad_id(target)
    base = decoder_blocks(model)
    hooks = ResidualTaps(model, ids)
    mine = [b for i, b in enumerate(batches) if shard is None or shard.owns(i)]
    desc = f"capture {target.name}" + (f" [{shard.rank + 1}/{shard.world}]" if shard is not None and shard.active else "")
    bar = progress_bar(total=sum(len(e) for b in mine for e in b), unit="tok", unit_scale=True, disable=not progress,
               desc=desc, smoothing=0.1)
    try:
        for index, batch in enumerate(batches):
            if shard is not None and not shard.wants(index):
                continue
            input_ids, mask, positions, roles = pad_batch(batch, pad_id, target.device)
            hooks.states = {}
            with torch.no_grad():  # not inference_mode: drafter training reuses these tensors
                out = base(input_ids=input_ids, attention_mask=mask.long(), use_cache=False)
                entropy = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
                entropy[mask] = token_entropy_from_hidden(model, out.last_hidden_state[mask])  # no logits for padding
            hidden = {i: hooks.states[i] for i in ids}
            hooks.states = {}
            bar.update(int(mask.sum()))
            yield CaptureBatch(index, hidden, input_ids, mask, positions, roles, entropy, [e.example_id for e in batch])
    finally:
        hooks.remove()
        bar.close()


def collect_states(batches: Iterable[CaptureBatch], layer_ids: Sequence[int], roles: str = "all") -> dict[str, np.ndarray]:
    """Keep the statistics positions of ``layer_ids`` in memory as float64 numpy arrays (for
    brute-force checks and small analyses; memory grows with tokens)."""
    parts: dict[str, list[np.ndarray]] = {"token_entropy": []}
    for b in batches:
        m = b.stat_mask(roles)
        for i in layer_ids:
            parts.setdefault(f"layer_{i}", []).append(b.layer(i)[m].double().cpu().numpy())
        parts["token_entropy"].append(b.token_entropy[m].cpu().numpy())
    return {k: np.concatenate(v) for k, v in parts.items()}


# ---------------------------------------------------------------------------------------------
def write_capture(
    batches: Iterable[CaptureBatch],
    out_dir: Path,
    layer_ids: Sequence[int],
    info: dict[str, Any],
    dtype: str = "float32",
    shard_tokens: int = 65536,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the real (non-padding) tokens of ``layer_ids`` as safetensors shards plus a manifest.

    Each shard holds ``hidden.<id>`` [n, d] per layer and ``input_ids``, ``positions``,
    ``sequence`` (row in the run), ``roles``, ``token_entropy`` [n]. The directory appears at
    ``out_dir`` only when complete.
    """
    import torch
    from safetensors.torch import save_file

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise CaptureError(f"dtype={dtype!r} is not one of float32, bfloat16, float16")
    shards: list[dict[str, Any]] = []
    buffer: dict[str, list[Any]] = {}
    seq_offset = 0

    def flush(tmp: Path) -> None:
        if not buffer:
            return
        tensors = {k: torch.cat(v).contiguous() for k, v in buffer.items()}
        name = f"shard_{len(shards):05d}.safetensors"
        save_file(tensors, str(tmp / name))
        shards.append({"file": name, "tokens": int(tensors["input_ids"].shape[0])})
        buffer.clear()

    with atomic_directory(Path(out_dir), overwrite=overwrite) as tmp:
        for b in batches:
            m = b.attention_mask
            rows = torch.arange(m.shape[0], device=m.device)[:, None].expand_as(m)
            fields = {
                "input_ids": b.input_ids[m], "positions": b.positions[m], "roles": b.roles[m],
                "token_entropy": b.token_entropy[m], "sequence": rows[m] + seq_offset,
            }
            fields.update({f"hidden.{i}": b.layer(i)[m].to(torch_dtype) for i in layer_ids})
            for k, v in fields.items():
                buffer.setdefault(k, []).append(v.cpu())
            seq_offset += m.shape[0]
            if sum(t.shape[0] for t in buffer["input_ids"]) >= shard_tokens:
                flush(tmp)
        flush(tmp)
        return write_manifest(
            tmp, {**info, "layer_ids": list(layer_ids), "dtype": dtype, "shards": shards,
                  "tokens": sum(s["tokens"] for s in shards)}, hash_files=False)


class CaptureStats:
    """Running counts over captured batches: tokens fed, positions kept, mean token entropy."""

    def __init__(self, roles: str = "all"):
        self.roles, self.tokens, self.kept, self.entropy_sum, self.batches = roles, 0, 0, 0.0, 0

    def watch(self, batches: Iterable[CaptureBatch]) -> Iterator[CaptureBatch]:
        for b in batches:
            m = b.stat_mask(self.roles)
            self.tokens += b.n_tokens
            self.kept += int(m.sum())
            self.entropy_sum += float(b.token_entropy[m].double().sum())
            self.batches += 1
            yield b

    def summary(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "tokens_kept": self.kept, "roles": self.roles,
                "mean_token_entropy_nats": round(self.entropy_sum / self.kept, 4) if self.kept else math.nan,
                "batches": self.batches}


def run_capture(
    model: str | Target,
    dataset: str,
    max_tokens: int,
    *,
    split: str | None = None,
    split_seed: int = 0,
    layer_ids: Sequence[int] | None = None,
    out_dir: str | Path | None = None,
    max_len: int = 512,
    batch_tokens: int = 4096,
    roles: str = "all",
    dtype: str = "float32",
    overwrite: bool = False,
    device: str = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Capture a corpus and return a JSON-able summary; with ``out_dir``, write ``layer_ids``
    (default: the EAGLE-3 rule ``[2, N//2, N-3]``) to disk."""
    from .data import load_corpus
    from .models import load_target

    t0 = time.perf_counter()
    check_roles(roles)
    if out_dir is not None and Path(out_dir).exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; remove it or pass --overwrite")
    target = model if isinstance(model, Target) else load_target(model, device=device)
    write_ids = target.check_layer_ids(layer_ids) if layer_ids is not None else target.default_layer_ids()
    corpus = load_corpus(dataset, split=split, seed=split_seed)
    stats = CaptureStats(roles)
    t_fwd = time.perf_counter()
    batches = stats.watch(capture(target, corpus, max_tokens, layer_ids=write_ids if out_dir else [],
                                  max_len=max_len, batch_tokens=batch_tokens, progress=progress))
    summary: dict[str, Any] = {
        "model": target.name, "n_layers": target.n_layers, "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size, "dataset": corpus.name, "split": split, "max_tokens": max_tokens,
        "max_len": max_len, "device": target.device,
    }
    if out_dir is not None:
        info = {**summary, "convention": "vllm (0 = embeddings, N = last block before the final norm)",
                "sglang_layer_ids": block_output_ids(write_ids), "split_seed": split_seed,
                "wavesurf": __version__}
        write_capture(batches, Path(out_dir), write_ids, info, dtype=dtype, overwrite=overwrite)
    else:
        for _ in batches:
            pass
    seconds = time.perf_counter() - t_fwd
    summary.update(stats.summary())
    summary.update({
        "layers_written": list(write_ids) if out_dir else [],
        "layer_convention": "vllm",
        "out": str(out_dir) if out_dir else None,
        "tokens_per_second": round(stats.tokens / seconds, 1) if seconds else None,
        "seconds": round(time.perf_counter() - t0, 2),
    })
    return summary
