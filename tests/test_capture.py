import math

import numpy as np
import pytest
import torch

from wavesurf.capture import capture, collect_states, run_capture, token_entropy_from_hidden, write_capture
from wavesurf.data import encode_budget, load_corpus
from wavesurf.errors import BudgetError, LayerIdError


@pytest.fixture(scope="module")
def small_encoded(smollm):
    # uneven lengths so batches carry padding
    return encode_budget(load_corpus("sharegpt", split="stats"), smollm.tokenizer, True, 600, max_len=96)


@pytest.fixture(scope="module")
def first_batch(smollm, small_encoded):
    return next(capture(smollm, small_encoded, 600, batch_tokens=100_000, progress=False))


def test_layer_ids_and_shapes(smollm, first_batch):
    b = first_batch
    assert sorted(b.hidden) == list(range(31))
    assert all(h.shape == (*b.input_ids.shape, 576) for h in b.hidden.values())
    assert b.n_tokens == 600 and not b.attention_mask.all()  # padded batch


def test_layer0_is_embedding_output(smollm, first_batch):
    emb = smollm.model.get_input_embeddings()(first_batch.input_ids)
    assert torch.equal(first_batch.layer(0), emb)


def test_last_layer_is_before_final_norm(smollm, first_batch):
    b = first_batch
    with torch.no_grad():
        hf = smollm.model(input_ids=b.input_ids, attention_mask=b.attention_mask.long(), output_hidden_states=True,
                          use_cache=False)
    m = b.attention_mask
    for i in range(1, 30):  # blocks 1..N-1 match HF's hidden_states exactly
        assert torch.allclose(b.layer(i)[m], hf.hidden_states[i][m], atol=1e-5, rtol=1e-5), i
    ours_n, hf_n = b.layer(30)[m], hf.hidden_states[30][m]
    assert not torch.allclose(ours_n, hf_n, atol=1e-2)  # HF's last entry is after the final norm
    with torch.no_grad():
        normed = smollm.model.model.norm(ours_n)
    assert torch.allclose(normed, hf_n, atol=1e-5, rtol=1e-5)
    # and the token entropy comes from the same logits HF computes
    logp = torch.log_softmax(hf.logits[m].double(), -1)
    ref = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(b.token_entropy[m].double(), ref, atol=2e-4)


def test_token_entropy_range_and_padding(smollm, first_batch):
    h = first_batch.token_entropy
    m = first_batch.attention_mask
    assert h.dtype == torch.float32
    assert float(h[m].min()) >= 0.0 and float(h[m].max()) <= math.log(smollm.vocab_size)
    assert float(h[~m].abs().max()) == 0.0
    assert 0.5 < float(h[m].mean()) < 6.0  # a real chat model is neither certain nor uniform


def test_stat_mask_drops_position0_padding_and_roles(first_batch):
    b = first_batch
    m = b.stat_mask()
    assert not m[:, 0].any() and not (m & ~b.attention_mask).any()
    assert int(m.sum()) == b.n_tokens - b.input_ids.shape[0]
    a = b.stat_mask("assistant")
    assert (a <= m).all() and (b.roles[a] == 3).all()
    with pytest.raises(ValueError, match="not one of"):
        b.stat_mask("bot")


def test_right_padding_does_not_change_states(smollm, small_encoded):
    shortest = min(small_encoded, key=len)
    alone = next(capture(smollm, [shortest], len(shortest), layer_ids=[0, 15, 30], progress=False))
    batched = next(capture(smollm, small_encoded, 600, layer_ids=[0, 15, 30], batch_tokens=100_000, progress=False))
    row = batched.example_ids.index(shortest.example_id)
    n = len(shortest)
    for i in (0, 15, 30):
        assert torch.allclose(alone.layer(i)[0, :n], batched.layer(i)[row, :n], atol=1e-4, rtol=1e-4)


def test_chunked_entropy_matches_unchunked(smollm, first_batch):
    with torch.no_grad():
        last = smollm.model.model.norm(first_batch.layer(30)[first_batch.attention_mask])
        a = token_entropy_from_hidden(smollm.model, last, chunk_rows=7)
        b = token_entropy_from_hidden(smollm.model, last, chunk_rows=100_000)
    assert torch.allclose(a, b, atol=1e-5)


def test_streaming_keeps_only_asked_layers(smollm, small_encoded):
    batches = list(capture(smollm, small_encoded, 600, layer_ids=[2, 15], batch_tokens=200, progress=False))
    assert len(batches) > 1 and all(sorted(b.hidden) == [2, 15] for b in batches)
    assert sum(b.n_tokens for b in batches) == 600
    with pytest.raises(KeyError, match="captured ids"):
        batches[0].layer(3)
    kept = collect_states(iter(batches), [2, 15])
    assert kept["layer_2"].shape == (600 - len(small_encoded), 576) and kept["layer_2"].dtype == np.float64


def test_bad_layer_ids_and_budget(smollm):
    mt = load_corpus("mt-bench")
    with pytest.raises(LayerIdError, match="0..30"):
        next(capture(smollm, mt, 100, layer_ids=[5, 31], progress=False))
    with pytest.raises(BudgetError, match="ask for at most"):
        next(capture(smollm, mt, 10**8, progress=False))


def test_write_capture_round_trip(smollm, small_encoded, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "cap"
    man = write_capture(capture(smollm, small_encoded, 600, layer_ids=[2, 27], batch_tokens=256, progress=False),
                        out, [2, 27], {"model": "smollm2-135m"}, shard_tokens=250)
    assert man["tokens"] == 600 and len(man["shards"]) >= 2 and man["layer_ids"] == [2, 27]
    shards = [load_file(out / s["file"]) for s in man["shards"]]
    h27 = np.concatenate([s["hidden.27"] for s in shards])
    assert h27.shape == (600, 576)
    ref = np.concatenate([b.layer(27)[b.attention_mask].numpy() for b in
                          capture(smollm, small_encoded, 600, layer_ids=[27], batch_tokens=256, progress=False)])
    np.testing.assert_allclose(h27, ref, rtol=1e-5, atol=1e-5)
    pos = np.concatenate([s["positions"] for s in shards])
    assert (pos == 0).sum() == len(small_encoded)
    with pytest.raises(FileExistsError):
        write_capture(iter([]), out, [2], {})


def test_interrupted_capture_leaves_no_output(smollm, small_encoded, tmp_path):
    def interrupted():
        for k, b in enumerate(capture(smollm, small_encoded, 600, layer_ids=[2], batch_tokens=256, progress=False)):
            if k == 1:
                raise KeyboardInterrupt
            yield b

    out = tmp_path / "cap"
    with pytest.raises(KeyboardInterrupt):
        write_capture(interrupted(), out, [2], {}, shard_tokens=10)
    assert list(tmp_path.iterdir()) == []


def test_run_capture_summary(smollm, tmp_path):
    s = run_capture(smollm, "humaneval", 500, max_len=128, out_dir=tmp_path / "c", progress=False)
    assert s["tokens"] == 500 and s["layers_written"] == [2, 15, 27] and s["layer_convention"] == "vllm"
    assert 0 < s["tokens_kept"] < 500 and 0 < s["mean_token_entropy_nats"] < math.log(49152)
    assert (tmp_path / "c" / "wavesurf-manifest.json").is_file()
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_capture(smollm, "humaneval", 500, out_dir=tmp_path / "c", progress=False)


@pytest.mark.gemma
def test_gemma_capture(gemma):
    enc = encode_budget(load_corpus("mt-bench"), gemma.tokenizer, gemma.has_chat_template, 200, max_len=64)
    b = next(capture(gemma, enc, 200, batch_tokens=100_000, progress=False))
    assert sorted(b.hidden) == list(range(19)) and b.layer(18).shape[-1] == 640
    assert torch.equal(b.layer(0), gemma.model.get_input_embeddings()(b.input_ids))  # scaled embedding output
    h = b.token_entropy[b.attention_mask]
    assert float(h.min()) >= 0 and float(h.max()) <= math.log(262144)
    assert int(b.input_ids[0, 0]) == gemma.tokenizer.bos_token_id  # plain-text format starts with BOS
