"""Does a head use the target layers it reads? Three measurements on held-out target answers.

* :func:`floor_miss_accuracy` — step-0 accuracy of a head on the positions where the bigram floor
  drafts wrong, where only what the head reads beyond the last token (its layers, its attention)
  can help; per held-out sequence, so its interval resamples sequences.
* :func:`stream_contributions` — how large each target stream's share of the fused input ``fc(x)``
  is (RMS over stored positions of ``fc_i(x_i)``, after the head's per-stream norm): which layer
  the head actually listens to.
* :func:`ablate_stream` — the same head with one stream's ``fc`` columns zeroed; scored with
  :func:`wavesurf.drafter.acceptance.offline_acceptance` it says what that layer is worth in tau.

The embedding-only control (a head trained reading no stream: ``TrainSettings(embedding_only=True)``)
is the fourth: trained by the speed table beside each set.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import AcceptanceError
from .acceptance import BigramTable, _check_store, _load_cached, _scan, _store_cached, head_hits
from .features import FeatureStore
from .head import DraftHead

if TYPE_CHECKING:
    from ..models import Target


@dataclass
class FloorMisses:
    """Per held-out sequence: positions where the floor's step-0 draft is wrong (``misses``) and,
    among them, where the head's is right (``rescued``); and the converse (``lost``: the floor is
    right, the head wrong, out of ``floor_hits``)."""

    name: str
    sequence_ids: list[str]
    misses: np.ndarray  # int64 [S]
    rescued: np.ndarray  # int64 [S]
    floor_hits: np.ndarray  # int64 [S]
    lost: np.ndarray  # int64 [S]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def rescue_rate(self) -> float:
        """Step-0 accuracy of the head where the floor is wrong."""
        m = self.misses.sum()
        return float(self.rescued.sum() / m) if m else float("nan")

    @property
    def loss_rate(self) -> float:
        """How often the head is wrong where the floor is right."""
        h = self.floor_hits.sum()
        return float(self.lost.sum() / h) if h else float("nan")

    def interval(self, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, float]:
        """The rescue rate with a percentile interval over held-out sequences (ratio of sums per
        replicate: sequences are the unit the positions cluster in)."""
        s = len(self.sequence_ids)
        if s < 2:
            return {"rescue_rate": self.rescue_rate, "rescue_lo": float("nan"), "rescue_hi": float("nan"),
                    "sequences": s, "note": "fewer than 2 sequences: no interval"}
        rng = np.random.default_rng(seed)
        w = rng.multinomial(s, np.full(s, 1.0 / s), size=n_boot)
        misses, rescued = w @ self.misses, w @ self.rescued
        with np.errstate(invalid="ignore", divide="ignore"):
            rates = np.where(misses > 0, rescued / np.maximum(misses, 1), np.nan)
        a = (1 - level) / 2
        lo, hi = np.nanquantile(rates, [a, 1 - a])
        return {"rescue_rate": self.rescue_rate, "rescue_lo": float(lo), "rescue_hi": float(hi),
                "loss_rate": self.loss_rate, "floor_misses": int(self.misses.sum()), "sequences": s}

    # ---- disk (a few integers per held-out sequence: JSON) ------------------------------------
    _COUNTS = ("misses", "rescued", "floor_hits", "lost")

    def save(self, directory: Path) -> None:
        meta = {k: (v.tolist() if k in self._COUNTS else v) for k, v in asdict(self).items()}
        (directory / "floor_misses.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, directory: Path) -> FloorMisses:
        meta = json.loads((directory / "floor_misses.json").read_text())
        return cls(**{k: (np.asarray(v, dtype=np.int64) if k in cls._COUNTS else v) for k, v in meta.items()})


def floor_miss_accuracy(target: Target, head: DraftHead, table: BigramTable, store: FeatureStore, *,
                        batch_tokens: int = 4096, name: str = "", progress: bool = False,
                        use_cache: bool = True) -> FloorMisses:
    """Step-0 agreement of ``head`` with the target's greedy token, split by whether the bigram
    floor (``table``) drafts that position right, on the continuations of ``store``. Cached by the
    head's, the table's and the store's fingerprints, as the acceptance scores are: every notebook
    that shows the speed table reads its diagnostics (a head's scan costs ~1/4 of its scoring)."""
    from .head import head_fingerprint

    head.config.check_target(target)
    _check_store(store, target, head.config.layer_ids)
    params = floor_miss_params(head_fingerprint(head), table, store)
    if use_cache and (found := load_floor_misses(params)) is not None:
        return replace(found, name=name)
    head = head.to(target.device).eval()
    embed = target.model.get_input_embeddings()

    def mine(batch: dict[str, Any]) -> Any:
        return head_hits(head, {k: v.to(target.device) for k, v in batch.items()}, embed, 1)

    # two scans of the same store in the same order: their continuations pair one to one
    segments, ids, cut = _scan(store, head.config.layer_ids, batch_tokens, mine, 1, progress, f"floor misses {name}")
    floor, _, _ = _scan(store, head.config.layer_ids, batch_tokens, lambda batch: table.hits(batch, 1), 1, False, "")
    result = floor_misses_from_segments(name, segments, floor, ids, {"layer_ids": list(head.config.layer_ids),
                                                                     "store": store.key, "cut_tokens": cut})
    if use_cache:
        store_floor_misses(params, result)
    return result


def floor_miss_params(head_fp: str, table: BigramTable, store: FeatureStore) -> dict[str, str]:
    """What a cached :class:`FloorMisses` is keyed by: the head's, the table's and the store's fingerprints."""
    return {"head": head_fp, "bigram": table.fingerprint, "store": store.key}


def load_floor_misses(params: dict[str, str]) -> FloorMisses | None:
    """The cached :class:`FloorMisses` under ``params`` (:func:`floor_miss_params`), None if missing."""
    return _load_cached("floor_misses", params, FloorMisses)


def store_floor_misses(params: dict[str, str], result: FloorMisses) -> None:
    _store_cached("floor_misses", params, result)


def floor_misses_from_segments(name: str, head_segments: list, floor_segments: list, sequence_ids: list[str],
                               info: dict[str, Any]) -> FloorMisses:
    """Count a :class:`FloorMisses` from the step-0 hit segments of a head and of the floor on the
    same continuations in the same order (``_scan`` of one store; pairs one to one)."""
    s = len(sequence_ids)
    misses, rescued, floor_hits, lost = (np.zeros(s, dtype=np.int64) for _ in range(4))
    for (seq, hits, length), (_, floor_hits_, _) in zip(head_segments, floor_segments, strict=True):
        valid = max(0, length - 1)
        h, f = hits[:valid, 0], floor_hits_[:valid, 0]
        misses[seq] += int((~f).sum())
        rescued[seq] += int((h & ~f).sum())
        floor_hits[seq] += int(f.sum())
        lost[seq] += int((~h & f).sum())
    keep = (misses + floor_hits) > 0
    return FloorMisses(name, [i for i, k in zip(sequence_ids, keep) if k], misses[keep], rescued[keep],
                       floor_hits[keep], lost[keep], dict(info))


def _stream_slice(head: DraftHead, i: int) -> slice:
    d = head.config.target_hidden_size
    return slice(i * d, (i + 1) * d)


def ablate_stream(head: DraftHead, layer_id: int) -> DraftHead:
    """A copy of ``head`` that ignores the stream of ``layer_id`` (its ``fc`` columns zeroed)."""
    import torch

    ids = list(head.config.layer_ids)
    if layer_id not in ids:
        raise AcceptanceError(f"layer {layer_id} is not read by this head (it reads {ids})")
    out = copy.deepcopy(head)
    with torch.no_grad():
        out.fc.weight[:, _stream_slice(head, ids.index(layer_id))] = 0
    return out


def stream_contributions(head: DraftHead, store: FeatureStore, *, max_tokens: int = 20_000,
                         batch_tokens: int = 4096) -> list[dict[str, float]]:
    """For each stream the head reads: its RMS (as ``fc`` sees it, after the head's input norm)
    and the RMS of its part of the fused input, ``fc_i(x_i)``, over up to ``max_tokens`` stored
    positions; ``share`` is that part's fraction of the sum over streams."""
    import torch

    if head.config.embedding_only:
        raise AcceptanceError("the embedding-only control reads no stream: it has no stream contributions")
    ids = list(head.config.layer_ids)
    k, d = len(ids), head.config.target_hidden_size
    sq_in = np.zeros(k)
    sq_out = np.zeros(k)
    n = 0
    weight = head.fc.weight.detach().float().cpu()
    with torch.inference_mode():
        for batch in store.batches(ids, batch_tokens):
            mask = batch["attention_mask"].bool()
            x = head.fc_inputs(batch["features"][mask].float())  # [P, k*d], after the head's input norm
            for i in range(k):
                part = x[:, i * d:(i + 1) * d]
                sq_in[i] += float(part.pow(2).mean(-1).sum())
                sq_out[i] += float((part @ weight[:, i * d:(i + 1) * d].T).pow(2).mean(-1).sum())
            n += int(mask.sum())
            if n >= max_tokens:
                break
    if n == 0:
        raise AcceptanceError("the feature store holds no positions to measure stream contributions on")
    rms_in, rms_out = np.sqrt(sq_in / n), np.sqrt(sq_out / n)
    total = rms_out.sum()
    return [{"layer_id": lid, "stream_rms": float(a), "fc_weight_norm": float(weight[:, i * d:(i + 1) * d].norm()),
             "contribution_rms": float(b), "share": float(b / total) if total > 0 else float("nan"), "positions": n}
            for i, (lid, a, b) in enumerate(zip(ids, rms_in, rms_out))]


__all__ = ["FloorMisses", "ablate_stream", "floor_miss_accuracy", "stream_contributions"]
