"""Drafter training on a real tiny feature store: TTT masks and alignment, no padding leak,
learning, checkpoints and exact resume, refusals, CLI."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from wavesurf.cli import main
from wavesurf.drafter import DrafterError
from wavesurf.drafter.features import TargetHead
from wavesurf.drafter.head import DraftConfig, DraftHead, init_head, load_head
from wavesurf.drafter.train import TrainSettings, train_drafter, ttt_forward, ttt_unroll
from wavesurf.errors import LayerIdError

LAYERS = [2, 15, 27]
FAST = dict(ttt_steps=2, draft_vocab_size=1024, batch_tokens=256, warmup_steps=1, lr=1e-3, log_every=2)


def ttt_masks(attention_mask, steps):
    """The reference: attention masks of the unrolled steps, mask j bool [B, 1, T, (j+1)T] over the
    keys [step 0 | step 1 | ... | step j]: causal over real step-0 keys plus the same-position key
    of each later step (EAGLE-3's training-time test)."""
    b, t = attention_mask.shape
    eye = torch.eye(t, dtype=torch.bool)[None, None].expand(b, 1, t, t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :]
    causal = causal | eye
    return [torch.cat([causal] + [eye] * j, dim=-1) for j in range(steps)]


def test_ttt_attention_equals_masked_attention_over_all_steps_keys(smollm, tiny_store):
    """step_ttt (causal step-0 keys plus one score per later step) equals step() over the
    concatenated keys with the reference masks, in float64, on the real positions of a
    right-padded batch, at every unrolled step."""
    b = tiny_store.batches(LAYERS, batch_tokens=4096)[0]
    assert b["attention_mask"].sum(1).min() < b["input_ids"].shape[1]  # padded rows included
    head, _ = _head(smollm, tiny_store)
    head = head.double()
    emb = smollm.model.get_input_embeddings()
    attn = b["attention_mask"]
    batch_size, t = attn.shape
    steps = 4
    masks = ttt_masks(attn, steps)
    with torch.no_grad():
        embeds = emb(b["input_ids"]).double()
        fast = list(ttt_unroll(head, b["features"].double(), embeds, attn, steps))
        hidden, past_k, past_v = head.fuse(b["features"].double()), None, None
        positions = torch.arange(t)[None].expand(batch_size, t)
        for j in range(steps):
            e = torch.zeros_like(embeds)
            e[:, : t - 1 - j] = embeds[:, 1 + j:]
            ref = head.step(hidden, e, positions + j, masks[j], past_k, past_v)
            got = fast[j][1]
            for r in range(batch_size):
                n = int(attn[r].sum())
                torch.testing.assert_close(got.logits[r, :n], ref.logits[r, :n], rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(got.hidden[r, :n], ref.hidden[r, :n], rtol=1e-9, atol=1e-9)
            hidden = ref.hidden
            past_k = ref.k if past_k is None else torch.cat([past_k, ref.k], dim=2)
            past_v = ref.v if past_v is None else torch.cat([past_v, ref.v], dim=2)


def _head(smollm, store, vocab_size=512, seed=0):
    head = init_head(DraftHead(DraftConfig.for_target(smollm, LAYERS, vocab_size)), seed=seed, std=0.05)
    ids = torch.arange(vocab_size) * (smollm.vocab_size // vocab_size)
    head.set_vocab(ids)
    return head, TargetHead(smollm, ids.numpy())


def test_no_leak_from_later_positions_or_padding(smollm, tiny_store):
    b = tiny_store.batches(LAYERS, batch_tokens=4096)[0]  # all sequences; the budget cut the last one short
    assert b["input_ids"].shape[0] > 1 and b["attention_mask"].sum(1).min() < b["input_ids"].shape[1]
    head, th = _head(smollm, tiny_store)
    emb = smollm.model.get_input_embeddings()
    with torch.no_grad():
        full = ttt_forward(head, b, emb, th, 3, keep_logits=True)
        # perturbing the target features at positions >= s changes nothing before s, at any step
        s = 20
        pert = {**b, "features": b["features"].clone()}
        pert["features"][:, s:] += torch.randn_like(pert["features"][:, s:])
        other = ttt_forward(head, pert, emb, th, 3, keep_logits=True)
        # the shortest sequence alone (no padding, batch of one) gives the same outputs
        r = int(b["attention_mask"].sum(1).argmin())
        n = int(b["attention_mask"][r].sum())
        alone = ttt_forward(head, {k: v[r : r + 1, :n] for k, v in b.items()}, emb, th, 3, keep_logits=True)
    for j in range(3):
        torch.testing.assert_close(other.logits[j][:, :s], full.logits[j][:, :s], rtol=0, atol=1e-5)
        assert not torch.allclose(other.logits[j][:, s:], full.logits[j][:, s:])
        torch.testing.assert_close(alone.logits[j][0], full.logits[j][r, : n - 2 - j], rtol=1e-5, atol=1e-5)
    # counted positions: real, assistant, next target token in the draft vocabulary; never more at later steps
    assert full.step_count[0] > 0 and (full.step_count.diff() <= 0).all()


def test_step0_loss_is_soft_cross_entropy_against_target_in_draft_vocab(smollm, tiny_store):
    b = tiny_store.batches(LAYERS, batch_tokens=512)[0]
    head, th = _head(smollm, tiny_store)
    emb = smollm.model.get_input_embeddings()
    with torch.no_grad():
        res = ttt_forward(head, b, emb, th, 1, keep_logits=True)
        # independent recomputation of step 0 for position t: feature t, embedding of token t+1, target at t+1
        t_len = b["input_ids"].shape[1]
        h = head.fuse(b["features"][:, : t_len - 1])
        e = emb(b["input_ids"][:, 1:])
        mask = torch.ones(t_len - 1, t_len - 1, dtype=torch.bool).tril()[None, None]
        mask = mask & b["attention_mask"][:, None, None, : t_len - 1] | torch.eye(t_len - 1, dtype=torch.bool)
        out = head.step(h, e, torch.arange(t_len - 1)[None].expand(h.shape[0], -1), mask)
        p = torch.softmax(th.logits(b["last_hidden"][:, 1:]), -1)
        ce = -(p * torch.log_softmax(out.logits, -1)).sum(-1)
        keep = (b["attention_mask"] & b["loss_mask"])[:, 2:] & head.t2d[b["target_argmax"][:, 1:-1]]
        ce = ce[:, : t_len - 2]
    torch.testing.assert_close(res.logits[0], out.logits[:, : t_len - 2], rtol=1e-5, atol=1e-5)
    assert res.step_count[0] == keep.sum()
    torch.testing.assert_close(res.loss, (ce * keep).sum() / keep.sum(), rtol=1e-5, atol=1e-6)


def test_loss_read_out_on_counted_rows_equals_the_dense_loss_and_its_gradient(smollm, tiny_store):
    """Training reads out only the positions its loss counts; a dense float64 reference over every
    position (masked afterwards) gives the same loss, counts, accuracy and gradient at every step."""
    b = tiny_store.batches(LAYERS, batch_tokens=4096)[0]  # padded rows included
    head, th = _head(smollm, tiny_store)
    emb = smollm.model.get_input_embeddings()
    steps, w = 3, 0.8
    res = ttt_forward(head, b, emb, th, steps, w)
    res.loss.backward()
    sparse_grad = {n: p.grad.clone() for n, p in head.named_parameters()}
    head.zero_grad()
    t_len = b["input_ids"].shape[1]
    with torch.no_grad():
        p = torch.softmax(th.logits(b["last_hidden"]).double(), -1)
    predictable = b["attention_mask"] & b["loss_mask"]
    in_vocab = head.t2d[b["target_argmax"]]
    total = 0.0
    for j, logits in enumerate(ttt_forward(head, b, emb, th, steps, w, keep_logits=True).logits):
        n = t_len - 2 - j
        count = predictable[:, 2 + j:] & in_vocab[:, 1 + j: 1 + j + n]
        ce = -(p[:, 1 + j: 1 + j + n] * torch.log_softmax(logits.double(), -1)).sum(-1)
        assert res.step_count[j] == count.sum()
        torch.testing.assert_close(res.step_loss_sum[j], (ce * count).sum().detach(), rtol=1e-4, atol=1e-4)
        right = (logits.argmax(-1) == p[:, 1 + j: 1 + j + n].argmax(-1)) & count
        assert abs(float(res.step_correct[j]) - float(right.sum())) <= 1  # a near tie may break either way
        total = total + w**j * (ce * count).sum() / count.sum()
    # the dense pass again, with gradients (keep_logits detaches what it keeps)
    dense = 0.0
    with torch.no_grad():
        embeds = emb(b["input_ids"])
    for j, out in ttt_unroll(head, b["features"], embeds, b["attention_mask"], steps):
        n = t_len - 2 - j
        count = predictable[:, 2 + j:] & in_vocab[:, 1 + j: 1 + j + n]
        ce = -(p[:, 1 + j: 1 + j + n] * torch.log_softmax(out.logits[:, :n].double(), -1)).sum(-1)
        dense = dense + w**j * (ce * count).sum() / count.sum()
    torch.testing.assert_close(res.loss.double(), dense.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.as_tensor(float(total)), torch.as_tensor(float(dense.detach())), rtol=1e-6, atol=1e-6)
    dense.backward()
    for name, param in head.named_parameters():
        torch.testing.assert_close(sparse_grad[name].double(), param.grad.double(), rtol=1e-4, atol=1e-6)


def test_training_learns_and_saves_a_loadable_head(smollm, tiny_store, tmp_cache, tmp_path):
    settings = TrainSettings(**{**FAST, "max_steps": 16, "log_every": 4})
    res = train_drafter(smollm, tiny_store, LAYERS, settings, tmp_path / "run", progress=False)
    assert res.steps == 16 and len(res.history) == 4
    first, last = res.history[0], res.history[-1]
    assert last["loss"] < first["loss"]
    assert len(res.accuracy) == 2 and res.accuracy[0] > first["accuracy_per_step"][0]
    assert res.train_tokens > 0 and res.tokens_per_second > 0 and 0 < res.vocab_coverage <= 1
    head, info = load_head(tmp_path / "run", smollm)
    assert info["layer_ids"] == LAYERS and info["sglang_layer_ids"] == [1, 14, 26]
    assert info["settings"]["ttt_steps"] == 2 and info["accuracy_per_step"] == res.accuracy
    assert head.config.draft_vocab_size == 1024 and head.t2d.sum() == 1024
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    # a finished run is returned without training again
    again = train_drafter(smollm, tiny_store, LAYERS, settings, tmp_path / "run", progress=False)
    assert again.steps == 16 and again.seconds == res.seconds


def test_bfloat16_training_is_close_to_float32_and_keeps_float32_weights(smollm, tiny_store, tmp_cache, tmp_path):
    # 4 steps of 128 tokens: where bfloat16 is emulated (no AVX512-BF16/AMX) it trains ~25x slower than float32
    # (benchmarks/precision_speed.py)
    base = {**FAST, "max_steps": 4, "batch_tokens": 128, "log_every": 2}
    assert "precision" not in TrainSettings(**base).fingerprint()  # earlier heads keep their cache keys
    assert TrainSettings(**base, precision="bfloat16").fingerprint()["precision"] == "bfloat16"
    f32 = train_drafter(smollm, tiny_store, LAYERS, TrainSettings(**base), tmp_path / "f32", progress=False)
    bf16 = train_drafter(smollm, tiny_store, LAYERS, TrainSettings(**base, precision="bfloat16"), tmp_path / "bf16",
                         progress=False)
    assert bf16.history[-1]["loss"] < bf16.history[0]["loss"]
    assert bf16.history[-1]["loss"] == pytest.approx(f32.history[-1]["loss"], rel=0.02)
    a, b = load_file(str(tmp_path / "f32" / "drafter.safetensors")), load_file(str(tmp_path / "bf16" / "drafter.safetensors"))
    assert all(b[k].dtype == a[k].dtype for k in a) and b["fc.weight"].dtype == torch.float32
    diff = max(float((b[k].float() - a[k].float()).abs().max()) for k in a if k.endswith("weight"))
    assert 0 < diff < 0.05  # bfloat16 products round differently, yet train the same head
    _, info = load_head(tmp_path / "bf16", smollm)
    assert info["settings"]["precision"] == "bfloat16"
    with pytest.raises(DrafterError, match=r"precision='float16' is not one of \('float32', 'bfloat16', 'auto'\)"):
        TrainSettings(precision="float16").check()


def test_auto_precision_is_settled_before_the_fingerprint(smollm, tiny_store, tmp_cache):
    """precision='auto' trains in bfloat16 only where the CPU has it natively; the head is the very
    run (key, info) that names the resolved precision, so either spelling finds it in the cache."""
    from wavesurf.drafter.train import cpu_has_bfloat16, resolve_precision

    native = "bfloat16" if cpu_has_bfloat16() else "float32"
    assert resolve_precision("auto", "cpu") == native
    assert [resolve_precision(p, "cpu") for p in ("float32", "bfloat16")] == ["float32", "bfloat16"]
    base = {**FAST, "max_steps": 2}
    auto = train_drafter(smollm, tiny_store, LAYERS, TrainSettings(**base, precision="auto"), progress=False)
    _, info = load_head(auto.out_dir, smollm)
    assert info["settings"]["precision"] == native
    spelled = train_drafter(smollm, tiny_store, LAYERS, TrainSettings(**base, precision=native), progress=False)
    assert spelled.out_dir == auto.out_dir and spelled.seconds == auto.seconds  # read back, not trained again


class _LinearDtypes(torch.overrides.TorchFunctionMode):
    """Records the output dtype of every linear product run while it is active."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear:
            self.seen.append(out.dtype)
        return out


def test_init_fc_and_fc_precision_refuse_bad_values_and_keep_the_default_key():
    from wavesurf.cache import params_key

    # options added later stay out of the fingerprint at their defaults: earlier heads keep their cache keys
    assert {"init_fc", "fc_precision"}.isdisjoint(TrainSettings().fingerprint())
    assert params_key(TrainSettings().fingerprint()) == "b2447c82359860cf"  # the key before these options
    assert TrainSettings(init_fc="inverse_rms").fingerprint()["init_fc"] == "inverse_rms"
    assert TrainSettings(fc_precision="float32").fingerprint()["fc_precision"] == "float32"
    with pytest.raises(DrafterError, match=r"init_fc='unit' is not one of \('random', 'inverse_rms'\)"):
        TrainSettings(init_fc="unit").check()
    with pytest.raises(DrafterError, match=r"fc_precision='bfloat16' is not one of \('auto', 'float32'\)"):
        TrainSettings(fc_precision="bfloat16").check()
    clashes = {"input_norm='rms'.*needs input_norm='none'": {"input_norm": "rms"},
               "embedding_only=True.*needs embedding_only=False": {"embedding_only": True},
               "init_attention='induction'.*needs init_attention='random'": {"init_attention": "induction",
                                                                             "init_lm_head": "target"}}
    for message, clash in clashes.items():
        with pytest.raises(DrafterError, match=f"init_fc='inverse_rms' with {message}.*or use init_fc='random'"):
            TrainSettings(init_fc="inverse_rms", **clash).check()
        TrainSettings(**clash).check()  # each is fine on its own
    TrainSettings(init_fc="inverse_rms", frozen=("fc",)).check()  # a fixed fc weighing every stream alike
    TrainSettings(fc_precision="float32").check()  # accepted with precision float32, where it changes nothing


def test_inverse_rms_init_gives_every_stream_a_comparable_share_of_fc(smollm, tiny_store):
    from wavesurf.drafter.diagnostics import stream_contributions
    from wavesurf.drafter.features import stream_rms
    from wavesurf.drafter.train import init_fc_inverse_rms

    def spread(head):
        parts = [c["contribution_rms"] for c in stream_contributions(head, tiny_store)]  # RMS of fc_i(x_i)
        return max(parts) / min(parts)

    head = init_head(DraftHead(DraftConfig.for_target(smollm, LAYERS, 1024)), seed=0)
    random_spread = spread(head)
    rms = stream_rms(tiny_store, LAYERS)
    init_fc_inverse_rms(head, rms)
    assert random_spread > 10 and spread(head) < 1.2  # SmolLM2: ~30 from random init, ~1.03 after
    with pytest.raises(DrafterError, match=r"must be 3 positive numbers, one per layer \[2, 15, 27\]"):
        init_fc_inverse_rms(head, [1.0, 0.0, 2.0])


def test_fc_precision_float32_computes_fc_in_float32_under_autocast_and_trains(smollm, tiny_store, tmp_cache, tmp_path):
    head = init_head(DraftHead(DraftConfig.for_target(smollm, LAYERS, 1024)), seed=0)
    features = tiny_store.batches(LAYERS, 256)[0]["features"]
    exact = head.fuse(features)  # float32 throughout
    seen = []
    with torch.autocast("cpu", dtype=torch.bfloat16), _LinearDtypes(seen):
        plain = head.fuse(features)
        kept = head.fuse(features, float32=True)
    assert seen == [torch.bfloat16, torch.float32]  # fc's own output inside autocast: as autocast, then float32
    # the rest of the head gets autocast's dtype as before, rounded once from the float32 fusion
    assert plain.dtype == kept.dtype == torch.bfloat16 and torch.equal(kept, exact.to(torch.bfloat16))
    assert not torch.equal(plain, kept)  # a bfloat16 fc rounds its inputs and weights
    assert torch.equal(head.fuse(features, float32=True), exact)  # without autocast: the plain path

    calls = []
    fuse = DraftHead.fuse

    def spy(self, features, float32=False):
        calls.append((float32, torch.is_autocast_enabled("cpu")))
        return fuse(self, features, float32)

    settings = TrainSettings(**{**FAST, "max_steps": 4, "precision": "bfloat16", "fc_precision": "float32"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DraftHead, "fuse", spy)
        res = train_drafter(smollm, tiny_store, LAYERS, settings, tmp_path / "fc32", progress=False)
    assert calls == [(True, True)] * 4  # every training step fuses in float32 under bfloat16 autocast
    assert res.history[-1]["loss"] < res.history[0]["loss"]
    assert load_file(str(tmp_path / "fc32" / "drafter.safetensors"))["fc.weight"].dtype == torch.float32
    head, info = load_head(tmp_path / "fc32", smollm)
    assert info["settings"]["fc_precision"] == "float32" and "fc_precision" not in head.config.to_dict()


def test_interrupted_run_resumes_to_the_same_weights(smollm, tiny_store, tmp_cache, tmp_path):
    settings = TrainSettings(**{**FAST, "max_steps": 6, "checkpoint_every": 3})
    straight = train_drafter(smollm, tiny_store, LAYERS, settings, tmp_path / "a", progress=False)

    class Stop(Exception):
        pass

    def stop_at_4(step, record):
        if step == 4:  # one step past the checkpoint at 3: that step is redone, not double counted
            raise Stop

    with pytest.raises(Stop):
        train_drafter(smollm, tiny_store, LAYERS, settings, tmp_path / "b", progress=False, callback=stop_at_4)
    assert [p.name for p in (tmp_path / "b").glob("checkpoint-*")] == ["checkpoint-0000003"]
    resumed = train_drafter(smollm, tiny_store, LAYERS, settings, tmp_path / "b", progress=False)
    assert resumed.resumed_at_step == 3 and resumed.steps == 6
    assert resumed.train_tokens == straight.train_tokens
    assert [h["loss"] for h in resumed.history] == pytest.approx([h["loss"] for h in straight.history], rel=1e-5)
    a, b = load_file(str(tmp_path / "a" / "drafter.safetensors")), load_file(str(tmp_path / "b" / "drafter.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


def test_refusals(smollm, tiny_store, tmp_cache, tmp_path):
    settings = TrainSettings(**{**FAST, "max_steps": 2, "checkpoint_every": 1})

    def stop(step, record):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_drafter(smollm, tiny_store, LAYERS, settings, tmp_path / "run", progress=False, callback=stop)
    with pytest.raises(DrafterError, match=r"layer_ids: \[2, 15, 27\] there, \[1, 15, 27\] now"):
        train_drafter(smollm, tiny_store, [1, 15, 27], settings, tmp_path / "run", progress=False)
    with pytest.raises(DrafterError, match="ttt_steps"):
        train_drafter(smollm, tiny_store, LAYERS, TrainSettings(**{**FAST, "max_steps": 2, "ttt_steps": 3}),
                      tmp_path / "run", progress=False)
    with pytest.raises(FileExistsError):
        train_drafter(smollm, tiny_store, LAYERS, settings, tmp_path / "run", progress=False, resume=False)
    with pytest.raises(DrafterError, match="draft_vocab_size=50000"):
        train_drafter(smollm, tiny_store, LAYERS, TrainSettings(draft_vocab_size=50000), tmp_path / "x")
    with pytest.raises(LayerIdError, match="repeated"):
        train_drafter(smollm, tiny_store, [2, 2, 15], settings, tmp_path / "x")
    with pytest.raises(LayerIdError, match="out of range"):
        train_drafter(smollm, tiny_store, [2, 31], settings, tmp_path / "x")
    with pytest.raises(DrafterError, match="stored ids"):
        train_drafter(smollm, tiny_store, [3, 15], settings, tmp_path / "x")
    with pytest.raises(DrafterError, match="schedule='step'"):
        train_drafter(smollm, tiny_store, LAYERS, TrainSettings(schedule="step"), tmp_path / "x")


def test_cli_train(smollm, tmp_cache, tmp_path, capsys):
    # the default corpus is the target's own answers: without `wavesurf distill` the error says how to make it
    assert main(["train", "--layers", "2,15,27", "--quiet"]) != 0
    assert "wavesurf distill" in capsys.readouterr().err
    args = ["train", "--layers", "2,15,27", "--dataset", "sharegpt", "--max-train-tokens", "1024", "--max-len", "128",
            "--store-layers", "train",
            "--ttt-steps", "2", "--draft-vocab", "512", "--steps", "3", "--batch-tokens", "256", "--out",
            str(tmp_path / "cli"), "--precision", "bfloat16", "--quiet"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 3 and out["layer_ids"] == LAYERS and out["feature_store"]["layer_ids"] == [2, 15, 27, 30]
    assert (tmp_path / "cli" / "drafter.safetensors").is_file()
    assert load_head(tmp_path / "cli", smollm)[1]["settings"]["precision"] == "bfloat16"
    assert main(["train", "--layers", "2,15,27", "--warmup-steps", "-1", "--quiet"]) == 2  # before the model loads
    assert "wavesurf train: error: warmup_steps=-1" in capsys.readouterr().err


def test_fused_adamw_on_this_device_makes_the_per_tensor_update():
    """Training asks torch for a fused AdamW on CPU and CUDA (FUSED_ADAMW_DEVICES); it must exist
    here and make the same update as the per-tensor loop (float64 reference, a few steps)."""
    from wavesurf.drafter.train import FUSED_ADAMW_DEVICES

    assert "cpu" in FUSED_ADAMW_DEVICES
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (48,), (7, 5, 3)]
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(4)]
    final = {}
    for fused in (False, True):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused,
                                foreach=None if fused else False)
        for g in grads:
            for p, gp in zip(params, g):
                p.grad = gp.clone()
            opt.step()
        final[fused] = [p.detach() for p in params]
        assert not torch.equal(final[fused][0], start[0])  # it moved
    for a, b in zip(final[False], final[True]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_autocast_once_gives_every_linear_the_input_autocast_would(smollm, tiny_store):
    """The block casts an input that several linears read once under autocast (q/k/v, gate/up):
    each linear must compute exactly what autocast's own per-call cast gives; without autocast
    the input passes unchanged."""
    from wavesurf.drafter.head import _autocast_once

    head, _ = _head(smollm, tiny_store)
    layer = head.midlayer
    x = torch.randn(2, 7, 2 * head.config.hidden_size) * 3
    y = torch.randn(2, 7, head.config.hidden_size) * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        once_x, once_y = _autocast_once(x), _autocast_once(y)
        assert once_x.dtype == torch.bfloat16
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            assert torch.equal(proj(once_x), proj(x))
        assert torch.equal(layer.mlp(once_y), layer.mlp(y))
    assert _autocast_once(x) is x
