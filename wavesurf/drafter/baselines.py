"""The plain loops speculative decoding is measured against: HF ``model.generate`` (greedy, or
prompt-lookup decoding) and our own one-forward-per-token loop."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from .generation import DecodeResult, as_ids, check_decode_settings, eos_ids, finish_tokens, sample_token

if TYPE_CHECKING:
    from ..models import Target


@torch.inference_mode()
def greedy_generate(target: Target, input_ids: Any, max_new_tokens: int, temperature: float = 0.0,
                    seed: int = 0) -> DecodeResult:
    """Our own KV-cached loop, one target forward per token, HF's default cache and masks (the
    baseline that shows what generate's bookkeeping costs). T > 0 samples."""
    from transformers import DynamicCache

    check_decode_settings(max_new_tokens, temperature)
    t0 = time.perf_counter()
    ids = as_ids(input_ids, target.device)
    eos, model = eos_ids(target), target.model
    gen = torch.Generator(device="cpu").manual_seed(seed) if temperature > 0 else None
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids[None], cache=cache, use_cache=True, logits_to_keep=1)
    produced: list[int] = []
    produced, done = finish_tokens([sample_token(out.logits[0, -1].float().cpu(), temperature, gen)], produced, eos, max_new_tokens)
    forwards, cycles = 1, []
    while not done:
        nxt = torch.tensor([[produced[-1]]], device=ids.device)
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        forwards += 1
        produced, done = finish_tokens([sample_token(out.logits[0, -1].float().cpu(), temperature, gen)], produced, eos, max_new_tokens)
        cycles.append(1)
    return DecodeResult("plain", produced, time.perf_counter() - t0, forwards, cycles, prompt_tokens=len(ids),
                        stopped="eos" if produced and produced[-1] in eos else "max_new_tokens")


class _ForwardCounter:
    def __init__(self, model: Any):
        self.n = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def remove(self):
        self.handle.remove()


@torch.inference_mode()
def hf_generate(target: Target, input_ids: Any, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                prompt_lookup_num_tokens: int | None = None) -> DecodeResult:
    """HF ``model.generate`` (greedy at T=0), optionally prompt-lookup decoding; target forwards
    are counted with a hook."""
    check_decode_settings(max_new_tokens, temperature)
    ids = as_ids(input_ids, target.device)
    eos = eos_ids(target)
    model = target.model
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        kwargs.update(temperature=float(temperature), top_k=None, top_p=None)
        torch.manual_seed(seed)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = int(prompt_lookup_num_tokens)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = next(iter(eos), 0)
    counter = _ForwardCounter(model)
    t0 = time.perf_counter()
    try:
        out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], pad_token_id=pad, **kwargs)
    finally:
        counter.remove()
    seconds = time.perf_counter() - t0
    produced, _ = finish_tokens(out[0, len(ids):].tolist(), [], eos, max_new_tokens)
    method = "hf_prompt_lookup" if prompt_lookup_num_tokens else "hf_generate"
    later = counter.n - 1  # forwards after the prefill; tokens after the first spread evenly over them
    cycles = [(len(produced) - 1) / later] * later if later > 0 else []
    return DecodeResult(method, produced, seconds, counter.n, cycles, prompt_tokens=len(ids),
                        stopped="eos" if produced and produced[-1] in eos else "max_new_tokens")


__all__ = ["greedy_generate", "hf_generate"]
