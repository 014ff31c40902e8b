"""Feature store: one real capture of the training split, read back for any stored layer subset."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from wavesurf.capture import capture
from wavesurf.data import ROLE_ASSISTANT, encode_budget, load_corpus
from wavesurf.drafter import DrafterError
from wavesurf.drafter.features import FeatureStore, TargetHead, build_feature_store

from .conftest import TINY


def _encoded(smollm):
    return encode_budget(load_corpus("sharegpt", split="train"), smollm.tokenizer, True, TINY["max_tokens"], TINY["max_len"])


def test_store_layout_and_size(smollm, tiny_store):
    s = tiny_store
    assert s.layer_ids == [1, 2, 15, 27, 30]  # layer N is always stored
    assert s.tokens == TINY["max_tokens"] == sum(len(q) for q in s.sequences)
    assert s.loss_roles == "assistant"
    states = 2 * smollm.hidden_size * len(s.layer_ids)
    assert s.manifest["bytes_per_token_states"] == states
    assert states < s.bytes_per_token < states + 40  # + ids, masks, argmax, entropy, headers


def test_reader_returns_stored_states_for_any_subset(smollm, tiny_store):
    data = tiny_store.batches([27, 2], batch_tokens=512)  # any order in, ascending out
    assert data.layer_ids == [2, 27]
    seen = 0
    by_example = {e.example_id: e for e in _encoded(smollm)}
    for i in range(len(data)):
        b = data[i]
        bsz, t = b["input_ids"].shape
        assert b["features"].shape == (bsz, t, 2 * smollm.hidden_size) and b["features"].dtype == torch.float32
        assert bsz * t <= 512 or bsz == 1
        lengths = b["attention_mask"].sum(1)
        seen += int(lengths.sum())
        assert not b["features"][~b["attention_mask"]].any()  # padding is zero
        assert b["attention_mask"][:, 0].all() and (b["attention_mask"].long().diff(dim=1) <= 0).all()  # right padding
    assert seen == tiny_store.tokens
    # compare the first batch with a fresh float32 capture of the same sequences
    b = data[0]
    ids = [row[m].numpy() for row, m in zip(b["input_ids"], b["attention_mask"])]
    matches = [next(e for e in by_example.values() if len(e) == len(x) and np.array_equal(e.input_ids, x)) for x in ids]
    (cb,) = capture(smollm, matches, 10**6, layer_ids=[2, 27, 30], max_len=TINY["max_len"], batch_tokens=10**6, progress=False)
    for r, e in enumerate(matches):
        row = next(k for k in range(len(cb.example_ids)) if cb.example_ids[k] == e.example_id)
        n = len(e)
        ref = torch.cat([cb.hidden[2][row, :n], cb.hidden[27][row, :n]], -1)
        torch.testing.assert_close(b["features"][r, :n], ref, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(b["last_hidden"][r, :n], cb.hidden[30][row, :n], rtol=2e-3, atol=2e-2)
        assert b["loss_mask"][r, :n].tolist() == (e.roles == ROLE_ASSISTANT).tolist()
        assert b["loss_mask"][r, :n].any()


def test_unknown_layer_is_refused_naming_the_stored_ids(tiny_store):
    with pytest.raises(DrafterError, match=r"\[3\].*stored ids: \[1, 2, 15, 27, 30\]"):
        tiny_store.batches([2, 3])


def test_target_logits_from_stored_layer_n(smollm, tiny_store):
    b = tiny_store.batches([2], batch_tokens=512)[0]
    m = b["attention_mask"]
    with torch.no_grad():
        out = smollm.model(input_ids=b["input_ids"], attention_mask=m.long(), output_hidden_states=True)
    rows = torch.arange(0, smollm.vocab_size, 7)  # a draft vocabulary: every 7th id
    head = TargetHead(smollm, rows.numpy())
    ref = out.logits[..., rows][m]
    scale = ref.abs().max()
    fp16 = head.logits(b["last_hidden"])[m]
    assert (fp16 - ref).abs().max() / scale < 1e-3  # float16 storage
    assert (torch.softmax(fp16, -1) - torch.softmax(ref, -1)).abs().max() < 5e-3
    (cb,) = capture(smollm, [e for e in _encoded(smollm)][:2], 10**6, layer_ids=[30], max_len=128, batch_tokens=10**6,
                    progress=False)
    with torch.no_grad():
        ref32 = smollm.model(input_ids=cb.input_ids, attention_mask=cb.attention_mask.long()).logits[..., rows]
    fp32 = head.logits(cb.hidden[30])
    mm = cb.attention_mask
    assert (fp32[mm] - ref32[mm]).abs().max() / ref32[mm].abs().max() < 1e-5  # float32 states: exact up to rounding
    # the stored full-vocabulary argmax is the model's
    assert torch.equal(b["target_argmax"][m], out.logits.argmax(-1)[m])


def test_interrupted_build_resumes_after_finished_shards(smollm, tiny_store, tmp_path):
    path = tmp_path / "store"
    calls: list[int] = []

    class Stop(Exception):
        pass

    def stop_after_two(i, tokens):
        calls.append(i)
        if i == 1:
            raise Stop

    with pytest.raises(Stop):
        build_feature_store(smollm, path=path, progress=False, on_shard=stop_after_two, **TINY)
    assert sorted(p.name for p in path.glob("shard_*")) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    with pytest.raises(DrafterError, match="not a finished feature store"):
        FeatureStore(path)
    first = load_file(str(path / "shard_00000.safetensors"))
    calls.clear()
    store = build_feature_store(smollm, path=path, progress=False, on_shard=lambda i, t: calls.append(i), **TINY)
    n = len(tiny_store.manifest["shards"])
    assert calls == list(range(2, n))  # finished shards were not recomputed
    assert torch.equal(load_file(str(path / "shard_00000.safetensors"))["hidden.2"], first["hidden.2"])
    for shard in tiny_store.manifest["shards"]:  # identical to the uninterrupted build
        a, b = load_file(str(path / shard["file"])), load_file(str(tiny_store.path / shard["file"]))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert store.tokens == tiny_store.tokens
    # a finished store is returned as is; other parameters in the same place are refused
    assert build_feature_store(smollm, path=path, progress=False, **TINY).key == store.key
    with pytest.raises(DrafterError, match="max_tokens"):
        build_feature_store(smollm, path=path, progress=False, **{**TINY, "max_tokens": 1000})


def test_bad_settings_are_refused(smollm, tmp_path):
    with pytest.raises(DrafterError, match="dtype 'bfloat16'"):
        build_feature_store(smollm, path=tmp_path / "s", dtype="bfloat16", max_tokens=100)
    with pytest.raises(ValueError, match=r"\[31\]"):
        build_feature_store(smollm, path=tmp_path / "s", layer_ids=[2, 31], max_tokens=100)


def test_stream_rms_equals_a_float64_reference_over_real_positions(tiny_store):
    """Over every stored token the RMS equals numpy float64 on the shards themselves (real tokens
    only: padding would pull it down); with a cap, on the first tokens in batch order."""
    from safetensors.numpy import load_file as load_numpy

    from wavesurf.drafter.features import stream_rms

    ids = [2, 15, 27]
    shards = [load_numpy(str(tiny_store.path / s["file"])) for s in tiny_store.manifest["shards"]]
    full = np.array([np.sqrt(np.mean(np.concatenate([s[f"hidden.{i}"] for s in shards]).astype(np.float64) ** 2))
                     for i in ids])
    np.testing.assert_allclose(stream_rms(tiny_store, ids, max_tokens=10**6, batch_tokens=512), full, rtol=1e-9)
    assert full.max() / full.min() > 10  # why the init exists: the streams differ in scale by far more than 1
    d = tiny_store.hidden_size
    batches = tiny_store.batches(ids, 512)
    first = np.concatenate([b["features"][b["attention_mask"]].numpy().astype(np.float64)
                            for b in (batches[i] for i in range(len(batches)))])[:700]
    capped = np.array([np.sqrt(np.mean(first[:, c * d:(c + 1) * d] ** 2)) for c in range(len(ids))])
    got = stream_rms(tiny_store, ids, max_tokens=700, batch_tokens=512)
    np.testing.assert_allclose(got, capped, rtol=1e-9)
    assert not np.allclose(got, full, rtol=1e-3)  # the cap is honoured
    with pytest.raises(DrafterError, match=r"max_tokens=0 must be a positive integer"):
        stream_rms(tiny_store, ids, max_tokens=0)
    with pytest.raises(DrafterError, match="stored ids"):
        stream_rms(tiny_store, [3, 15])
