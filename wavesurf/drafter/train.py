"""Train an EAGLE-3 draft head on any set of target layers from a feature store, with
training-time test (TTT) as in EAGLE-3's reference code (SafeAILab/EAGLE
``eagle/traineagle3/cnets.py``, ``Model.forward``; the book's methods chapter).

Alignment, for a sequence of tokens x_0..x_{T-1} and target states at every position:

* step 0 at position t reads ``fuse(features_t)`` and ``embed(x_{t+1})`` and predicts x_{t+2},
  supervised by the target's distribution at position t+1 (restricted to the draft vocabulary and
  renormalised);
* step j > 0 reads the draft's own pre-norm output of step j-1 at position t and ``embed(x_{t+1+j})``
  (ground truth, teacher forcing), rotary position t+j, and predicts x_{t+2+j} against the target
  at position t+1+j;
* a query of step j at position t attends to the step-0 keys at positions <= t (causal) and, for
  each earlier step 1..j, to that step's key at the same position t only (the diagonal);
* a prediction counts iff x_{t+2+j} is a real token with loss_mask (assistant) set and the
  target's argmax at t+1+j lies in the draft vocabulary; step j's loss is the soft-label
  cross-entropy averaged over counted positions, and the total is ``sum_j step_weight**j * loss_j``.

Built on HF Accelerate, so data parallel needs no code change: each process reads every P-th batch
and ``batch_tokens`` is per process. On GPUs: ``accelerate launch --multi_gpu --num_processes P -m
wavesurf.cli train ...``. On a CPU-only machine the same command works (torchrun starts P processes;
a CPU target makes them join one gloo group); ``accelerate launch --cpu --num_processes P`` starts
only one process unless MPI is set up. Verified: ``accelerate launch --multi_gpu --num_processes 2
--num_machines 1 --mixed_precision no --dynamo_backend no -m wavesurf.cli train --layers 2,15,27 ...``
on 2 CPU cores.

Over ~450 lines because the training loop, its resumable checkpoints and the settings whose every
field keys the checkpoint must stay in one place: a resumed run is refused when any of them differs.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import is_int
from ..cache import cache_root, describe_differences, params_key, safe_name
from ..models import block_output_ids
from ..settings_cli import setting
from .features import FeatureStore, TargetHead, stream_rms
from .head import INPUT_NORMS, DraftConfig, DraftHead, DrafterError, check_draft_layer_ids, init_head, save_head
from .vocab import build_draft_vocab, check_draft_vocab_size

if TYPE_CHECKING:
    from ..models import Target

SCHEDULES = ("cosine", "linear", "constant")
LM_HEAD_INITS = ("random", "target")
ATTENTION_INITS = ("random", "induction")
#: how ``fc`` starts: "inverse_rms" divides the columns reading each stream by its RMS (:func:`init_fc_inverse_rms`)
FC_INITS = ("random", "inverse_rms")
#: arithmetic of ``fc`` under ``precision="bfloat16"``: "auto" follows autocast, "float32" keeps it in float32
FC_PRECISIONS = ("auto", "float32")
#: arithmetic of the head's forward and backward passes: "bfloat16" runs them under
#: ``torch.autocast`` (weights, optimizer state and the loss's log-softmax stay float32)
PRECISIONS = ("float32", "bfloat16", "auto")
#: parts of a head ``TrainSettings.frozen`` may keep at their initial weights: name -> parameter prefixes
FREEZABLE = {"fc": ("fc.",), "attention": ("midlayer.self_attn.", "midlayer.hidden_norm.", "midlayer.input_layernorm.")}
TRAINER_STATE = "trainer.json"
#: settings that do not change the trained weights (a resume may change them)
_NOT_FINGERPRINTED = ("checkpoint_every", "log_every")
#: options added later: left out of the fingerprint at their default, so earlier heads keep their keys
_FINGERPRINTED_IF_SET = {"init_attention": "random", "frozen": [], "precision": "float32", "embedding_only": False,
                         "init_fc": "random", "fc_precision": "auto"}  # defaults as fingerprinted
#: stored tokens :func:`~wavesurf.drafter.features.stream_rms` reads for ``init_fc="inverse_rms"``
INVERSE_RMS_TOKENS = 8192


@dataclass
class TrainSettings:
    """Drafter training settings (EAGLE-3 defaults where the reference has one).

    ``batch_tokens`` is the padded batch size in tokens *per process*. Training stops after
    ``max_steps`` optimizer steps, or after ``train_tokens`` real tokens (converted to steps with
    the store's mean tokens per batch), whichever comes first; with neither, one pass over the
    store. ``vocab_tokens`` None counts the draft vocabulary over the whole training corpus the
    store was built from, up to 2M tokens (independent of the head's budget: a vocabulary counted
    over a small budget fills with ids the drafter never sees); a number counts that many tokens.
    ``init_lm_head="target"`` starts ``lm_head`` from the target's unembedding rows of the draft
    vocabulary and ``norm`` from the target's final norm; ``input_norm="rms"`` divides each target
    stream by its root mean square before ``fc`` (see :class:`DraftConfig`). ``embedding_only=True``
    trains the control that reads no target stream (same budget, data order and seed): what a head
    drafts from the token embedding alone, the floor a head must beat for its layers to matter.
    ``precision="bfloat16"`` runs the head's matrix products in bfloat16 under ``torch.autocast``
    (CPUs with AVX512-BF16 or AMX, and GPUs, do them faster; the target's soft labels, the weights
    and AdamW stay float32); ``benchmarks/drafter_sweep.py`` measures what it changes.
    ``init_fc="inverse_rms"`` divides, after every other initialisation, the ``fc`` columns that
    read stream i by that stream's RMS over the first 8192 stored tokens
    (:func:`~wavesurf.drafter.features.stream_rms`): each stream enters ``fc`` at comparable scale,
    as under ``input_norm="rms"``, but as one constant per stream folded into the weights, so the
    head is plain EAGLE-3 (no ``fc_norm``) and every consumer reads its export unchanged. Refused
    with ``input_norm="rms"`` (the streams are unit RMS already), ``embedding_only=True`` (``fc``
    reads nothing) and ``init_attention="induction"`` (which sets ``fc`` itself and fits its key
    map on that ``fc``); allowed with ``frozen=["fc"]`` (a fixed ``fc`` that weighs every stream
    alike). ``fc_precision="float32"`` computes ``fc`` (and the per-stream RMS division of
    ``input_norm="rms"``) in float32 under ``precision="bfloat16"``, handing its output to the rest
    of the head in bfloat16 as before (:meth:`~wavesurf.drafter.head.DraftHead.fuse`); with
    ``precision="float32"`` it changes nothing. It is training arithmetic only: offline scoring
    (:mod:`~wavesurf.drafter.acceptance`) and decoding run every head in its float32 weights
    without autocast, and exports carry weights, so neither the head's config nor its exports
    record it.
    ``lr`` is higher than EAGLE-3's 5e-5 (tuned there for 800k steps) because runs here are short.
    Memory grows with ``batch_tokens * ttt_steps * draft_vocab_size`` (one float32 [tokens, V_d]
    log-softmax per unrolled step is kept for the backward pass).
    """

    # setting(...) adds the command-line help (wavesurf.settings_cli); the defaults are the fields' own
    ttt_steps: int = setting(7, positive=True, help="unrolled training-time-test steps (EAGLE-3: 7)")
    step_weight: float = setting(0.8, help="loss weight of unrolled step j is step_weight**j")
    lr: float = setting(3e-4, help="peak learning rate of AdamW")
    warmup_steps: int = setting(20, help="linear warmup steps")
    schedule: str = setting("cosine", choices=SCHEDULES, help="decay after warmup")
    betas: tuple[float, float] = setting((0.9, 0.95), help="AdamW betas")
    weight_decay: float = setting(0.0, help="AdamW weight decay")
    grad_clip: float = setting(0.5, help="gradient norm clipped to this")
    batch_tokens: int = setting(2048, positive=True, help="padded tokens per batch and process")
    max_steps: int | None = setting(None, positive=True, help="optimizer steps (default: one pass over the store)")
    train_tokens: int | None = setting(None, positive=True, help="stop after about this many training tokens")
    seed: int = setting(0, help="seed of the head's initialisation and data order")
    draft_vocab_size: int = setting(32000, positive=True, help="draft vocabulary size (EAGLE-3: 32000)")
    vocab_tokens: int | None = setting(None, positive=True, help="training-split tokens counted for the draft "
                                       "vocabulary (default: the whole corpus, up to 2M)")
    init_lm_head: str = setting("random", choices=LM_HEAD_INITS, help="target: start lm_head and its norm from the "
                                "target's unembedding rows of the draft vocabulary")
    init_attention: str = setting("random", choices=ATTENTION_INITS, help="induction: start fc and attention as a "
                                  "copy head (wavesurf.drafter.induction); pair it with init_lm_head target")
    init_fc: str = setting("random", choices=FC_INITS, help="inverse_rms: divide the fc columns reading each stream "
                           "by that stream's RMS over 8192 stored tokens, so every stream enters fc at comparable "
                           "scale without a norm (exports stay plain EAGLE-3)")
    frozen: tuple[str, ...] = setting((), choices=tuple(FREEZABLE), help="parts of the head kept at their initial "
                                      "weights while the rest trains")
    input_norm: str = setting("none", choices=INPUT_NORMS, help="rms: divide each target stream by its RMS before "
                              "the fusion layer (exported as fc_norm, EAGLE 3.1's per-stream RMSNorm, which vLLM, "
                              "SGLang, SpecForge and speculators read)")
    precision: str = setting("float32", choices=PRECISIONS, help="arithmetic of the head's forward/backward: "
                             "bfloat16 runs them under torch.autocast, faster on CPUs with AVX512-BF16/AMX and on "
                             "GPUs (emulated, many times slower, on other CPUs); auto: bfloat16 where the device "
                             "has it natively, else float32; weights and optimizer stay float32")
    fc_precision: str = setting("auto", choices=FC_PRECISIONS, help="float32: the fusion layer fc (and the input "
                                "norm) in float32 under precision bfloat16, the rest of the head as before; no "
                                "effect with precision float32, none on exports")
    embedding_only: bool = setting(False, help="train the control that reads no target stream (fc sees zeros): what "
                                   "the same head drafts from the token embedding alone; a diagnostic, not exported")
    checkpoint_every: int = setting(100, positive=True, help="steps between checkpoints")
    log_every: int = setting(10, positive=True, help="steps per logged loss/accuracy window")

    def check(self) -> None:
        def positive_int(name: str, allow_none: bool = False, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not is_int(v, 0 if allow_zero else 1):
                what = "a non-negative" if allow_zero else "a positive"
                raise DrafterError(f"{name}={v!r} must be {what} integer{' or None' if allow_none else ''}")

        for name in ("ttt_steps", "batch_tokens", "checkpoint_every", "log_every"):
            positive_int(name)
        positive_int("warmup_steps", allow_zero=True)
        for name in ("max_steps", "train_tokens", "vocab_tokens"):
            positive_int(name, allow_none=True)
        if self.init_attention not in ATTENTION_INITS:
            raise DrafterError(f"init_attention={self.init_attention!r} is not one of {ATTENTION_INITS}")
        if isinstance(self.frozen, str) or any(part not in FREEZABLE for part in self.frozen):
            raise DrafterError(f"frozen={self.frozen!r} must be a list of parts among {sorted(FREEZABLE)}")
        if self.init_lm_head not in LM_HEAD_INITS:
            raise DrafterError(f"init_lm_head={self.init_lm_head!r} is not one of {LM_HEAD_INITS}")
        if self.input_norm not in INPUT_NORMS:
            raise DrafterError(f"input_norm={self.input_norm!r} is not one of {INPUT_NORMS}")
        if not isinstance(self.embedding_only, bool):
            raise DrafterError(f"embedding_only={self.embedding_only!r} must be True or False")
        if self.precision not in PRECISIONS:
            raise DrafterError(f"precision={self.precision!r} is not one of {PRECISIONS}")
        if self.init_fc not in FC_INITS:
            raise DrafterError(f"init_fc={self.init_fc!r} is not one of {FC_INITS}")
        if self.fc_precision not in FC_PRECISIONS:
            raise DrafterError(f"fc_precision={self.fc_precision!r} is not one of {FC_PRECISIONS}")
        if self.init_fc == "inverse_rms":
            clash = {"input_norm": (self.input_norm, "rms", "'none' (the streams reach fc at unit RMS already)"),
                     "embedding_only": (self.embedding_only, True, "False (the control's fc reads no stream)"),
                     "init_attention": (self.init_attention, "induction",
                                        "'random' (the induction start sets fc itself and fits its key map on it)")}
            for name, (value, refused, allowed) in clash.items():
                if value == refused:
                    raise DrafterError(f"init_fc='inverse_rms' with {name}={value!r}: it needs {name}={allowed}; "
                                       "or use init_fc='random'")
        if self.schedule not in SCHEDULES:
            raise DrafterError(f"schedule={self.schedule!r} is not one of {SCHEDULES}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise DrafterError(f"lr={self.lr!r} must be a positive number")
        if not 0 < self.step_weight <= 1:
            raise DrafterError(f"step_weight={self.step_weight!r} must be in (0, 1]")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise DrafterError(f"betas={self.betas!r} must be two numbers in [0, 1)")
        if self.weight_decay < 0 or not self.grad_clip > 0:
            raise DrafterError(f"weight_decay={self.weight_decay!r} must be >= 0 and grad_clip={self.grad_clip!r} > 0")

    def fingerprint(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        d["frozen"] = sorted(self.frozen)
        for name, default in _FINGERPRINTED_IF_SET.items():
            if d[name] == default:
                d.pop(name)
        return {k: v for k, v in d.items() if k not in _NOT_FINGERPRINTED}


@dataclass
class TrainResult:
    """What a training run produced: where the head is, how much it saw and how fast, and the
    per-TTT-step accuracy/loss (token-weighted over the last ``log_every`` steps) plus history."""

    out_dir: str
    layer_ids: list[int]
    sglang_layer_ids: list[int | None]
    steps: int
    train_tokens: int
    seconds: float
    tokens_per_second: float
    accuracy: list[float]
    loss: list[float]
    vocab_coverage: float
    history: list[dict[str, Any]] = field(default_factory=list)
    resumed_at_step: int = 0

    def to_dict(self, history: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not history:
            d.pop("history")
        return d


#: devices whose torch has a fused AdamW kernel (``torch.optim.AdamW(fused=True)``)
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


# ---------------------------------------------------------------------------------------------
# training-time test
def ttt_unroll(head: DraftHead, features: Any, embeds: Any, attention_mask: Any, steps: int,
               with_logits: bool = True, fc_float32: bool = False) -> Iterator[tuple[int, Any]]:
    """The unrolled draft steps that training and offline scoring share (one home, so the
    "exact offline tau" the speed table reports is the head training optimised): step j at
    position t reads the fused target features of t (step 0) or its own previous output, and the
    embedding of x_{t+1+j}; it attends to the step-0 keys at and before t and to its own earlier
    steps at t (:meth:`~wavesurf.drafter.head.DraftHead.step_ttt`; batches are right-padded, so a
    real position never sees a padded one). Yields ``(j, DraftStep)`` while step j has a position to
    draft for; the caller reads the logits it needs (``with_logits=False``: none are computed, the
    caller reads out the rows it needs with ``head.readout``). ``fc_float32``: the fusion in float32
    under autocast (``TrainSettings.fc_precision``; without autocast, as scoring runs, the same)."""
    import torch

    from .head import rope_tables

    b, t = attention_mask.shape
    hidden = head.fuse(features, float32=fc_float32)
    if embeds.dtype != hidden.dtype and not torch.is_autocast_enabled(embeds.device.type):
        embeds = embeds.to(hidden.dtype)  # a head kept in another dtype than the target's embedding (scoring)
    # shared by every step: the normed embeddings (step j reads them shifted by 1 + j) and the
    # rotary tables of positions 0..t-1+steps (step j reads positions j..j+t-1)
    normed = head.midlayer.input_layernorm(embeds)
    cos, sin = rope_tables(torch.arange(t + steps, device=attention_mask.device)[None], head.config.head_dim,
                           head.config.rope_theta)
    keys: list[Any] = []
    values: list[Any] = []
    for j in range(steps):
        if t - 1 - j <= 0:
            return
        e = torch.zeros_like(normed)
        e[:, : t - 1 - j] = normed[:, 1 + j:]
        out = head.step_ttt(hidden, e, (cos[:, :, j:j + t], sin[:, :, j:j + t]), keys, values,
                            with_logits=with_logits)
        yield j, out
        hidden = out.hidden
        keys.append(out.k)
        values.append(out.v)


@dataclass
class TTTOutput:
    loss: Any  # scalar: sum_j w**j * loss_j
    step_loss_sum: Any  # float64 [S]: summed cross-entropy over counted positions
    step_correct: Any  # float64 [S]
    step_count: Any  # float64 [S]: counted positions
    logits: list[Any] | None = None  # per step [B, T-2-j, V_d], when asked for


def ttt_forward(
    head: DraftHead,
    batch: dict[str, Any],
    embed: Callable[[Any], Any],
    target_head: TargetHead,
    ttt_steps: int,
    step_weight: float = 0.8,
    keep_logits: bool = False,
    fc_float32: bool = False,
) -> TTTOutput:
    """Unroll ``ttt_steps`` draft steps over one feature batch (see the module docstring).

    ``target_head`` must be restricted to the head's draft vocabulary (``TargetHead(target,
    head.draft_to_target)``); ``embed`` maps token ids to the target's input embeddings;
    ``fc_float32`` as in :func:`ttt_unroll`.
    """
    import torch
    from torch.nn import functional as F

    ids, attn = batch["input_ids"], batch["attention_mask"]
    b, t = ids.shape
    with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):  # labels in float32 always
        embeds = embed(ids)
        # label position p (the target at p supervises draft step j at position t = p-1-j) counts iff
        # x_{p+1} is a real assistant token and the target's full-vocabulary argmax at p is a draft token
        in_vocab = head.t2d[batch["target_argmax"]]
        counted = torch.zeros_like(attn)
        counted[:, :-1] = (attn & batch["loss_mask"])[:, 1:] & in_vocab[:, :-1]
        rows, label_pos = counted.nonzero(as_tuple=True)
        t_prob = torch.softmax(target_head.logits(batch["last_hidden"][rows, label_pos]), dim=-1)  # [M, V_d]
        # the draft id of the target's argmax (in the draft vocabulary there: the restricted argmax)
        draft_index = torch.cumsum(head.t2d.long(), 0) - 1  # draft ids ascend with target ids
        t_arg = draft_index[batch["target_argmax"][rows, label_pos]]

    drafted, labels, counts, kept_logits = [], [], [], []
    for j, out in ttt_unroll(head, batch["features"], embeds, attn, ttt_steps, with_logits=keep_logits,
                             fc_float32=fc_float32):
        n = t - 2 - j  # positions t with a token x_{t+2+j} to predict
        if n <= 0:
            break
        here = (label_pos >= 1 + j).nonzero(as_tuple=True)[0]  # label positions with a draft position t = p-1-j >= 0
        drafted.append(out.hidden[rows[here], label_pos[here] - 1 - j])  # [M_j, H]
        labels.append(here)
        counts.append(len(here))
        if keep_logits:
            kept_logits.append(out.logits[:, :n].detach())
    # one readout and one loss over every step's counted rows: the steps share lm_head, so one
    # product (and one gradient of its weight) instead of one per step
    steps = len(counts)
    total = embeds.new_zeros(())
    sums = torch.zeros(3, ttt_steps, dtype=torch.float64)
    if steps:  # else a batch too short to draft anything
        labels_all = torch.cat(labels)
        logits = head.readout(torch.cat(drafted)).float()  # [sum_j M_j, V_d]
        ce = F.cross_entropy(logits, t_prob[labels_all], reduction="none")  # soft labels, per row
        step_of_row = torch.repeat_interleave(torch.arange(steps), torch.tensor(counts)).to(ce.device)
        n_count = torch.tensor(counts, dtype=ce.dtype, device=ce.device)
        row_weight = step_weight ** torch.arange(steps, dtype=ce.dtype, device=ce.device) / n_count.clamp(min=1.0)
        total = (ce * row_weight[step_of_row]).sum()
        with torch.no_grad():
            correct = (logits.argmax(-1) == t_arg[labels_all]).to(ce.dtype)
            per_step = torch.zeros(2, steps, dtype=ce.dtype, device=ce.device)
            per_step[0].index_add_(0, step_of_row, ce.detach())
            per_step[1].index_add_(0, step_of_row, correct)
            sums[:2, :steps] = per_step.double().cpu()
            sums[2, :steps] = n_count.double().cpu()
    return TTTOutput(total, sums[0], sums[1], sums[2], kept_logits if keep_logits else None)


def _ttt_module():
    import torch

    class TTTModel(torch.nn.Module):
        """The head wrapped so that one ``forward`` is one TTT unroll: Accelerate/DDP wraps this
        module, and gradients are synchronised through its forward. Returns (loss, stats [3, S])."""

        def __init__(self, head: DraftHead, fc_float32: bool = False):
            super().__init__()
            self.head = head
            self.fc_float32 = fc_float32

        def forward(self, batch: dict[str, Any], embed: Any, target_head: TargetHead, ttt_steps: int,
                    step_weight: float) -> tuple[Any, Any]:
            res = ttt_forward(self.head, batch, embed, target_head, ttt_steps, step_weight,
                              fc_float32=self.fc_float32)
            return res.loss, torch.stack([res.step_loss_sum, res.step_correct, res.step_count])

    return TTTModel


def lr_lambda(settings: TrainSettings, total_steps: int) -> Callable[[int], float]:
    """Multiplier of ``lr`` at optimizer step s: linear warmup, then cosine/linear decay to 0 at
    ``total_steps`` (or constant)."""
    warm = settings.warmup_steps

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if settings.schedule == "constant" or total_steps <= warm:
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total_steps - warm))
        return 0.5 * (1 + math.cos(math.pi * frac)) if settings.schedule == "cosine" else 1.0 - frac

    return f


# ---------------------------------------------------------------------------------------------
def default_out_dir(target: Target, layer_ids: Sequence[int], fingerprint: dict[str, Any]) -> Path:
    return cache_root() / "drafter" / "heads" / f"{safe_name(target.name)}-L{'-'.join(map(str, layer_ids))}-{params_key(fingerprint)}"


def init_from_target(head: DraftHead, target: Target) -> DraftHead:
    """Copy the target's unembedding rows of the draft vocabulary into ``lm_head`` and the target's
    final-norm scale into ``norm``: the head then starts as "the target's own readout of whatever
    the decoder layer writes", instead of from noise."""
    import torch

    from .features import TargetHead

    th = TargetHead(target, head.draft_to_target.cpu().numpy())
    with torch.no_grad():
        if head.lm_head.weight.shape != th.weight.shape:
            raise DrafterError(f"cannot start lm_head {tuple(head.lm_head.weight.shape)} from the target's "
                               f"unembedding rows {tuple(th.weight.shape)}: the head's width differs from the target's")
        head.lm_head.weight.copy_(th.weight.to(head.lm_head.weight.dtype))
        ones = torch.ones(1, head.config.hidden_size, dtype=th.weight.dtype, device=th.weight.device)
        scale = th.norm(ones)[0] * (1 + head.config.rms_norm_eps) ** 0.5  # the norm's effective weight (Gemma: 1 + w)
        head.norm.weight.copy_(scale.to(head.norm.weight.dtype))
    return head


def init_fc_inverse_rms(head: DraftHead, rms: Sequence[float]) -> DraftHead:
    """Divide the ``fc`` columns that read stream i by ``rms[i]`` (its RMS in the store,
    :func:`~wavesurf.drafter.features.stream_rms`): each stream then starts with a comparable share
    of the fused feature, as under ``input_norm="rms"``, but the scale is folded into the weights,
    so the head keeps the plain EAGLE-3 graph and export (no ``fc_norm``)."""
    import torch

    k, d = len(head.config.layer_ids), head.config.target_hidden_size
    rms = np.asarray(rms, dtype=np.float64)
    if rms.shape != (k,) or not (np.isfinite(rms) & (rms > 0)).all():
        raise DrafterError(f"stream RMS {rms.tolist()} must be {k} positive numbers, one per layer {head.config.layer_ids}")
    scale = torch.from_numpy(1.0 / rms).repeat_interleave(d)
    with torch.no_grad():
        head.fc.weight.mul_(scale.to(head.fc.weight))
    return head


def _checkpoints(out_dir: Path) -> list[Path]:
    found = [p for p in out_dir.glob("checkpoint-*") if (p / TRAINER_STATE).is_file() and p.name[11:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[11:]))


def train_drafter(
    target: Target,
    store: FeatureStore,
    layer_ids: Sequence[int],
    settings: TrainSettings | None = None,
    out_dir: str | Path | None = None,
    *,
    resume: bool = True,
    progress: bool = True,
    callback: Callable[[int, dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train a draft head reading ``layer_ids`` (vLLM ids) of ``target`` from ``store`` and save
    it with :func:`~wavesurf.drafter.head.save_head` in ``out_dir`` (default: a keyed directory
    under ``cache_root()/drafter/heads``).

    Checkpoints (head, optimizer, scheduler, RNG, steps done, data position) are written
    atomically every ``checkpoint_every`` steps; with ``resume`` a run continues from the latest
    one, and a finished run is returned as is. A directory from another target, layer set, store
    or settings is refused. ``callback(step, record)`` runs after every optimizer step.
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from ..progress import progress_bar

    settings = settings or TrainSettings()
    settings.check()
    store.check_target(target)
    ids = check_draft_layer_ids(layer_ids, target.n_layers)
    ids = store.check_layer_ids(ids)
    check_draft_vocab_size(settings.draft_vocab_size, target.vocab_size)

    accelerator = Accelerator(cpu=str(target.device) == "cpu", step_scheduler_with_optimizer=False)
    if accelerator.device.type != torch.device(target.device).type:
        raise DrafterError(f"the target is on {target.device} but Accelerate trains on {accelerator.device}; "
                           "load the target on that device")
    # "auto" is settled here, before the fingerprint: a head's key and info name what it ran in
    settings = replace(settings, precision=resolve_precision(settings.precision, accelerator.device.type))
    fingerprint = {"target": [target.name, target.n_layers, target.hidden_size, target.vocab_size],
                   "store": store.key, "layer_ids": ids, "settings": settings.fingerprint(),
                   "num_processes": accelerator.num_processes}
    out = Path(out_dir) if out_dir is not None else default_out_dir(target, ids, fingerprint)
    from .head import HEAD_CONFIG

    finished = out / HEAD_CONFIG
    ckpts = _checkpoints(out) if out.is_dir() else []
    if finished.is_file() or ckpts:
        if not resume:
            raise FileExistsError(f"{out} already holds a drafter run; resume it (resume=True) or choose another out_dir")
        old = (json.loads(finished.read_text())["info"].get("fingerprint") if finished.is_file()
               else json.loads((ckpts[-1] / TRAINER_STATE).read_text())["fingerprint"])
        if old != fingerprint:
            raise DrafterError(f"{out} holds a drafter run with other parameters ({describe_differences(old or {}, fingerprint)}); "
                               "choose another out_dir")
        if finished.is_file():
            return TrainResult(**json.loads(finished.read_text())["info"]["result"])

    if accelerator.is_main_process and out.is_dir():  # checkpoints whose write was interrupted
        for stale in out.glob(".checkpoint-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    with accelerator.main_process_first():
        vocab = build_draft_vocab(target, settings.draft_vocab_size, dataset=store.params["dataset"],
                                  split=store.params["split"], split_seed=store.params["split_seed"],
                                  max_tokens=settings.vocab_tokens, max_len=max(store.params["max_len"], 2048))
    set_seed(settings.seed)
    config = replace(DraftConfig.for_target(target, ids, settings.draft_vocab_size), input_norm=settings.input_norm,
                     embedding_only=settings.embedding_only)
    head = init_head(DraftHead(config), seed=settings.seed)
    head.set_vocab(torch.from_numpy(vocab.ids))
    if settings.init_lm_head == "target":
        init_from_target(head, target)
    embedding = target.model.get_input_embeddings()
    if settings.init_attention == "induction":
        from .induction import induction_init

        induction_init(head, store.batches(ids, 4096), embedding, seed=settings.seed)
    if settings.init_fc == "inverse_rms":  # last: it scales whatever fc the other starts left
        init_fc_inverse_rms(head, stream_rms(store, ids, INVERSE_RMS_TOKENS))
    head.to(accelerator.device).train()
    target_head = TargetHead(target, vocab.ids)
    frozen = tuple(prefix for part in settings.frozen for prefix in FREEZABLE[part])
    for name, param in head.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    # fused: one kernel for the whole update where torch has one for the device (CPU, CUDA); the
    # same AdamW arithmetic as the per-tensor loop, its step ~4x faster for the 2-core CPU's heads
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.lr,
                                  betas=tuple(settings.betas), weight_decay=settings.weight_decay,
                                  fused=accelerator.device.type in FUSED_ADAMW_DEVICES)

    def loader_for(epoch: int) -> Any:
        n = len(store.batches(ids, settings.batch_tokens))
        order = np.random.default_rng([settings.seed, epoch]).permutation(n)
        data = store.batches(ids, settings.batch_tokens, order=order)
        return accelerator.prepare_data_loader(DataLoader(data, batch_size=1, collate_fn=_only, shuffle=False))

    first = loader_for(0)
    steps_per_epoch = len(first)
    tokens_per_step = store.tokens / steps_per_epoch  # all processes together
    limits = [settings.max_steps] if settings.max_steps else []
    if settings.train_tokens:
        limits.append(max(1, math.ceil(settings.train_tokens / tokens_per_step)))
    total_steps = min(limits) if limits else steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(settings, total_steps))
    model, optimizer, scheduler = accelerator.prepare(_ttt_module()(head, settings.fc_precision == "float32"),
                                                      optimizer, scheduler)

    state: dict[str, Any] = {"steps": 0, "tokens": 0, "seconds": 0.0, "history": [],
                             "window": np.zeros((3, settings.ttt_steps)).tolist(), "fingerprint": fingerprint}
    resumed_at = 0
    if ckpts:
        accelerator.load_state(str(ckpts[-1] / "state"))
        state = json.loads((ckpts[-1] / TRAINER_STATE).read_text())
        resumed_at = state["steps"]
    window = np.asarray(state["window"], dtype=np.float64)
    step = state["steps"]
    bf16 = settings.precision == "bfloat16"
    if bf16 and accelerator.device.type == "cpu" and not cpu_has_bfloat16():
        warnings.warn("precision='bfloat16' on a CPU without AVX512-BF16 or AMX: bfloat16 is emulated there and "
                      "trains slower than float32", RuntimeWarning, stacklevel=2)

    def autocast() -> Any:
        return torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=bf16)

    bar = progress_bar(total=total_steps, initial=step, unit="step", disable=not (progress and accelerator.is_main_process),
               desc=f"train {target.name} L{','.join(map(str, ids))}")
    t_start, seconds0 = time.perf_counter(), state["seconds"]
    last_record: dict[str, Any] | None = state["history"][-1] if state["history"] else None
    try:
        while step < total_steps:
            epoch, within = divmod(step, steps_per_epoch)
            loader = first if epoch == 0 and step == 0 else loader_for(epoch)
            if within:
                loader = accelerator.skip_first_batches(loader, within)
            for batch in loader:
                with autocast():
                    loss, stats = model(batch, embedding, target_head, settings.ttt_steps, settings.step_weight)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), settings.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                local = torch.cat([stats.flatten(),
                                   batch["attention_mask"].sum().double().cpu().reshape(1)])
                summed = accelerator.reduce(local.to(accelerator.device), reduction="sum").cpu().numpy()
                window += summed[:-1].reshape(3, settings.ttt_steps)
                state["tokens"] += int(summed[-1])
                record = None
                if step % settings.log_every == 0 or step == total_steps:
                    record = _record(step, state["tokens"], scheduler.get_last_lr()[0], window, settings)
                    state["history"].append(record)
                    last_record = record
                    window[:] = 0
                    bar.set_postfix(loss=f"{record['loss']:.3f}",
                                    acc="/".join(f"{a:.2f}" for a in record["accuracy_per_step"][:4]))
                bar.update(1)
                if step % settings.checkpoint_every == 0 and step < total_steps:
                    state.update(steps=step, window=window.tolist(),
                                 seconds=seconds0 + time.perf_counter() - t_start)
                    _save_checkpoint(accelerator, out, state)
                if callback is not None:
                    callback(step, record or {"step": step})
                if step >= total_steps:
                    break
    finally:
        bar.close()
    seconds = seconds0 + time.perf_counter() - t_start
    record = last_record or _record(step, state["tokens"], settings.lr, window, settings)
    result = TrainResult(
        out_dir=str(out), layer_ids=ids, sglang_layer_ids=block_output_ids(ids), steps=step,
        train_tokens=int(state["tokens"]), seconds=round(seconds, 3),
        tokens_per_second=round(state["tokens"] / seconds, 2) if seconds > 0 else 0.0,
        accuracy=record["accuracy_per_step"], loss=record["loss_per_step"], vocab_coverage=vocab.coverage,
        history=state["history"], resumed_at_step=resumed_at)
    if accelerator.is_main_process:
        info = {"layer_ids": ids, "layer_convention": "vllm (0 = embeddings, N = last block before the final norm)",
                "sglang_layer_ids": result.sglang_layer_ids, "train_tokens": result.train_tokens,
                "seconds": result.seconds, "tokens_per_second": result.tokens_per_second,
                "settings": asdict(settings), "vocab": vocab.summary(), "vocab_coverage": vocab.coverage,
                "accuracy_per_step": result.accuracy, "loss_per_step": result.loss, "store": store.describe(),
                "num_processes": accelerator.num_processes, "fingerprint": fingerprint,
                "result": result.to_dict(history=True)}
        _save_final(accelerator.unwrap_model(model).head, out, info)
    accelerator.wait_for_everyone()
    return result


def resolve_precision(precision: str, device_type: str = "cpu") -> str:
    """``precision`` with ``"auto"`` settled for ``device_type``: bfloat16 where the device multiplies
    it natively (a CPU with AVX512-BF16 or AMX, a CUDA device that supports it), float32 elsewhere.
    On a CPU with AVX2 only (an AMD EPYC host here), bfloat16 autocast trained the default
    profile's head ~20x slower than float32 (37.8 vs 817 tok/s, 2 threads, torch 2.13.0:
    benchmarks/precision_speed.py, results/precision_speed-20261207T052104.json)."""
    import torch

    if precision != "auto":
        return precision
    if device_type == "cuda":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if device_type == "cpu" and cpu_has_bfloat16() else "float32"


def cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), where autocast pays off."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def _only(items: list[Any]) -> Any:
    return items[0]


def _record(step: int, tokens: int, lr: float, window: np.ndarray, settings: TrainSettings) -> dict[str, Any]:
    loss_sum, correct, count = window
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = np.where(count > 0, loss_sum / count, np.nan)
        acc = np.where(count > 0, correct / count, np.nan)
    weights = settings.step_weight ** np.arange(settings.ttt_steps)
    ok = count > 0
    return {"step": step, "tokens": int(tokens), "lr": float(lr),
            "loss": float((weights[ok] * loss[ok]).sum()) if ok.any() else float("nan"),
            "loss_per_step": [round(float(x), 5) for x in loss], "accuracy_per_step": [round(float(x), 5) for x in acc],
            "positions_per_step": [int(x) for x in count]}


def _save_checkpoint(accelerator: Any, out: Path, state: dict[str, Any]) -> None:
    """Write checkpoint-<step>/ atomically (temporary name, then rename) and drop older ones."""
    step = state["steps"]
    tmp = out / f".checkpoint-{step:07d}.tmp"
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAINER_STATE).write_text(json.dumps(state))
        final = out / f"checkpoint-{step:07d}"
        os.replace(tmp, final)
        for old in _checkpoints(out):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _save_final(head: DraftHead, out: Path, info: dict[str, Any]) -> None:
    """save_head into a temporary directory, then move the weights and, last, the config in:
    the config's presence marks a finished run. Checkpoints are removed afterwards."""
    from .head import HEAD_CONFIG, HEAD_WEIGHTS

    tmp = out / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_head(head, tmp, info)
    os.replace(tmp / HEAD_WEIGHTS, out / HEAD_WEIGHTS)
    os.replace(tmp / HEAD_CONFIG, out / HEAD_CONFIG)
    shutil.rmtree(tmp, ignore_errors=True)
    for old in _checkpoints(out):
        shutil.rmtree(old, ignore_errors=True)


def settings_from_dict(data: dict[str, Any]) -> TrainSettings:
    known = {f.name for f in fields(TrainSettings)}
    data = {k: v for k, v in data.items() if k in known}
    if "betas" in data:
        data["betas"] = tuple(data["betas"])
    return TrainSettings(**data)


def train_from_features(target: Target, features: Any, layer_ids: Sequence[int], settings: TrainSettings,
                        out_dir: str | Path | None = None, *, resume: bool = True,
                        progress: bool = True) -> tuple[TrainResult, FeatureStore, Any]:
    """Build (or reuse) the feature store and train, in one process or several: under
    ``accelerate launch`` / ``torchrun`` the main process builds the store while the others wait,
    then every process joins the same group in :func:`train_drafter`. Returns the result, the store
    and accelerate's ``PartialState`` (``is_main_process``, ``num_processes``)."""
    from accelerate import PartialState

    from .features import build_feature_store

    state = PartialState(cpu=str(target.device) == "cpu")  # the group train_drafter's Accelerator joins
    with state.main_process_first():
        store = build_feature_store(target, features, progress=progress and state.is_main_process)
    result = train_drafter(target, store, layer_ids, settings, out_dir, resume=resume, progress=progress)
    return result, store, state


__all__ = ["TrainSettings", "TrainResult", "train_drafter", "train_from_features", "ttt_forward", "lr_lambda", "SCHEDULES",
           "PRECISIONS", "resolve_precision", "FC_INITS", "FC_PRECISIONS", "init_fc_inverse_rms"]
