"""Induction (copy) initialisation of a head, on the real SmolLM2 target."""
from __future__ import annotations

import math

import pytest
import torch

LAYERS = [1, 15, 27]


def test_slow_rotary_dims_match_a_brute_force_angle_check():
    from wavesurf.drafter.induction import slow_rotary_dims

    for hd, theta, dist, angle in [(64, 100_000.0, 400, 0.5), (64, 10_000.0, 100, 0.3), (128, 500_000.0, 2000, 0.5)]:
        want = [i for i in range(hd // 2) if theta ** (-2 * i / hd) * dist <= angle]
        assert slow_rotary_dims(hd, theta, dist, angle) == want + [i + hd // 2 for i in want]
    assert slow_rotary_dims(64, 100_000.0, 400, 0.5)  # SmolLM2 has some


def _features(target, ids):
    from wavesurf.taps import ResidualTaps

    with torch.no_grad(), ResidualTaps(target.model, LAYERS) as taps:
        target.model(ids)
        return torch.cat([taps.states[i].float() for i in LAYERS], dim=-1)


def _step0_hits(head, target, ids):
    """Teacher-forced step 0 over ``ids`` [1, T]: does the draft at t equal x_{t+2}?"""
    from wavesurf.drafter.head import causal_mask

    t = ids.shape[1]
    with torch.no_grad():
        embeds = torch.zeros(1, t, head.config.hidden_size)
        embeds[:, :-1] = target.model.get_input_embeddings()(ids[:, 1:]).float()
        out = head.step(head.fuse(_features(target, ids)), embeds, torch.arange(t)[None], causal_mask(t))
        draft = head.draft_to_target[out.logits.argmax(-1)][0, : t - 2]
    return draft == ids[0, 2:]


def test_an_induction_head_copies_what_followed_an_earlier_occurrence(smollm, tiny_store):
    from wavesurf.drafter.head import DraftConfig, DraftHead, init_head
    from wavesurf.drafter.induction import induction_init
    from wavesurf.drafter.train import init_from_target

    config = DraftConfig.for_target(smollm, LAYERS, smollm.vocab_size)  # full vocabulary: identity map
    text = smollm.tokenizer("The harbour lights flickered as the old ferry pulled away from the pier, and the "
                            "gulls followed it out past the breakwater into the grey morning.")["input_ids"]
    ids = torch.tensor([text + text])
    n = len(text)

    plain = init_from_target(init_head(DraftHead(config), seed=0), smollm)
    copier = init_from_target(init_head(DraftHead(config), seed=0), smollm)
    r2 = induction_init(copier, tiny_store.batches(LAYERS, 512), smollm.model.get_input_embeddings(), seed=0)
    assert 0.5 < r2 <= 1.0  # the lowest stream still names its token
    # second copy: position t (>= n) has seen x_{t+1} before, followed by x_{t+2}
    second_plain = _step0_hits(plain, smollm, ids)[n:].float().mean().item()
    second_copy = _step0_hits(copier, smollm, ids)[n:].float().mean().item()
    # a random 3 x 64-dim value path carries a token well enough to win in a fifth of the cases
    # over the full 49k vocabulary (measured 0.26); a plain head never copies
    assert second_copy >= 0.2, second_copy
    assert second_plain <= 0.05, second_plain


def test_frozen_parts_keep_their_initial_weights_and_defaults_keep_old_keys(smollm, tiny_store, tmp_cache, tmp_path):
    from wavesurf.drafter.head import DraftHead, init_head, load_head
    from wavesurf.drafter.induction import induction_init
    from wavesurf.drafter.train import TrainSettings, train_drafter
    from wavesurf.errors import DrafterError

    assert {"init_attention", "frozen"}.isdisjoint(TrainSettings().fingerprint())  # earlier heads keep their keys
    assert TrainSettings(frozen=["fc"]).fingerprint()["frozen"] == ["fc"]
    settings = TrainSettings(max_steps=2, ttt_steps=2, draft_vocab_size=512, batch_tokens=512, warmup_steps=0,
                             lr=1e-2, init_attention="induction", init_lm_head="target", frozen=["fc", "attention"])
    result = train_drafter(smollm, tiny_store, LAYERS, settings, out_dir=tmp_path / "head", progress=False)
    head, _ = load_head(result.out_dir, smollm)
    fresh = init_head(DraftHead(head.config), seed=0)
    induction_init(fresh, tiny_store.batches(LAYERS, 4096), smollm.model.get_input_embeddings(), seed=0)
    assert torch.equal(head.fc.weight, fresh.fc.weight)
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, fresh.midlayer.self_attn.q_proj.weight)
    assert torch.equal(head.midlayer.hidden_norm.weight, fresh.midlayer.hidden_norm.weight)
    assert not torch.equal(head.midlayer.mlp.up_proj.weight, fresh.midlayer.mlp.up_proj.weight)  # the rest trains

    for bad, allowed in [({"frozen": ["mlp"]}, "attention"), ({"frozen": "fc"}, "fc"),
                         ({"init_attention": "copy"}, "induction")]:
        with pytest.raises(DrafterError, match=allowed):
            TrainSettings(**bad).check()
    assert math.isfinite(result.loss[0])
