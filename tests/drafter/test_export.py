"""Export for each consumer (vLLM, SGLang old and new, SpecForge, speculators) and back."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from wavesurf.consumers import ConsumerError, read_layer_ids, written_layer_ids
from wavesurf.drafter.export import export_drafter, load_export
from wavesurf.drafter.head import DraftConfig, DraftHead, DrafterError, causal_mask, init_head, load_head, save_head

@pytest.fixture(scope="module")
def head(smollm):
    h = init_head(DraftHead(DraftConfig.for_target(smollm, [3, 15, 27], 4096)), seed=3)
    vocab = torch.randperm(smollm.vocab_size, generator=torch.Generator().manual_seed(0))[:4096].sort().values
    h.set_vocab(vocab)
    return h.eval()


def _draft(head, smollm, steps=4):
    """A short greedy chain draft from fixed target features: the tokens a server would propose."""
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 6, 3 * smollm.hidden_size, generator=gen)
    ids = torch.randint(0, smollm.vocab_size, (1, 6), generator=gen)
    embed = smollm.model.get_input_embeddings()
    with torch.no_grad():
        out = head.step(head.fuse(feats), embed(ids), torch.arange(6)[None], causal_mask(6))
        k, v, hidden = out.k, out.v, out.hidden[:, -1:]
        tokens = [int(head.draft_to_target[out.logits[0, -1].argmax()])]
        for s in range(steps - 1):
            pos = torch.tensor([[6 + s]])
            mask = torch.ones(1, 1, 1, k.shape[2] + 1, dtype=torch.bool)
            o = head.step(hidden, embed(torch.tensor([[tokens[-1]]])), pos, mask, k, v)
            k, v, hidden = torch.cat([k, o.k], 2), torch.cat([v, o.v], 2), o.hidden
            tokens.append(int(head.draft_to_target[o.logits[0, -1].argmax()]))
    return tokens, out.logits


ALL = ["vllm", "sglang", "specforge", "speculators"]
LLAMA = "LlamaForCausalLM"


@pytest.mark.parametrize("fmt", ALL)
def test_export_round_trip_reproduces_drafts(head, smollm, tmp_path, fmt):
    out = export_drafter(head, fmt, tmp_path / fmt, dtype="float32")
    back = load_export(out, smollm)
    for key, value in head.state_dict().items():
        assert torch.equal(value, back.state_dict()[key]), key
    assert _draft(back, smollm)[0] == _draft(head, smollm)[0]
    assert torch.equal(_draft(back, smollm)[1], _draft(head, smollm)[1])


def test_bfloat16_by_default(head, smollm, tmp_path):
    from safetensors import safe_open

    out = export_drafter(head, "vllm", tmp_path / "b")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16 and f.get_tensor("d2t").dtype == torch.int64
    back = load_export(out, smollm)
    fc, fc_back = head.state_dict()["fc.weight"], back.state_dict()["fc.weight"]
    assert fc_back.dtype == torch.float32 and not torch.equal(fc, fc_back)
    assert torch.allclose(fc, fc_back, rtol=2 ** -8, atol=0)  # bf16 keeps 8 significant bits
    with pytest.raises(DrafterError, match="dtype 'int8' is not supported; choose one of bfloat16"):
        export_drafter(head, "vllm", tmp_path / "i8", dtype="int8")


def _ids(fmt, layer_ids, n=30, arch=LLAMA, **kw):
    return written_layer_ids(fmt, layer_ids, n, arch, **kw)


def test_each_consumer_reads_the_ids_the_head_was_trained_on(head, tmp_path):
    """The ids written follow each consumer's reading rule for a llama target (tests/test_consumers.py
    runs the released consumers' own code on them), and that rule gives back the head's vLLM ids."""
    configs = {fmt: json.loads((export_drafter(head, fmt, tmp_path / fmt) / "config.json").read_text()) for fmt in ALL}
    assert configs["vllm"]["eagle_aux_hidden_state_layer_ids"] == [3, 15, 27]  # vLLM: top level, as is
    assert "eagle_config" not in configs["vllm"] and configs["vllm"]["num_aux_hidden_states"] == 3
    assert configs["speculators"]["eagle_aux_hidden_state_layer_ids"] == [3, 15, 27]
    assert configs["speculators"]["transformer_layer_config"]["num_aux_hidden_states"] == 3
    # released SGLang (0.5.14 and 0.5.23) adds +1 to every id of a llama target, whatever the first id
    assert configs["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 14, 26]
    assert configs["specforge"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 14, 26]
    for fmt, cfg in configs.items():
        assert read_layer_ids(cfg, fmt, 30, LLAMA) == [3, 15, 27], fmt
        assert cfg["norm_before_residual"] is False and cfg["draft_vocab_size"] == 4096
        assert cfg["fc_norm"] is False
        assert cfg["wavesurf"]["consumer"]["target_architecture"] == LLAMA
    for fmt in ("vllm", "sglang", "specforge"):
        assert configs[fmt]["architectures"] == ["LlamaForCausalLMEagle3"] and configs[fmt]["vocab_size"] == 49152
    assert configs["speculators"]["transformer_layer_config"]["vocab_size"] == 49152


def test_sglang_rule_by_architecture_and_version():
    for ids in ([2, 15, 27], [3, 15, 27], [1, 15, 27], [5, 9, 29]):
        assert _ids("sglang", ids) == [i - 1 for i in ids]  # llama: always +1
        assert _ids("sglang", ids, arch="Gemma3ForCausalLM") == [i - 1 for i in ids]
    # deepseek_v2: +1 only when the first id is 1
    assert _ids("sglang", [2, 15, 27], arch="DeepseekV3ForCausalLM") == [1, 14, 26]
    assert _ids("sglang", [3, 15, 27], arch="DeepseekV3ForCausalLM") == [3, 15, 27]
    with pytest.raises(ConsumerError, match="plus-one-if-first-is-one.*formats that can: vllm, speculators"):
        _ids("sglang", [1, 15, 27], arch="DeepseekV3ForCausalLM")
    # gpt_oss: 0.5.23 keeps ids whose largest is N (and captures id N); 0.5.14 always +1
    assert _ids("sglang", [24, 30, 36], n=36, arch="GptOssForCausalLM") == [24, 30, 36]
    assert _ids("sglang", [2, 18, 33], n=36, arch="GptOssForCausalLM") == [1, 17, 32]
    with pytest.raises(ConsumerError, match=r"sglang 0\.5\.14 .*captures vLLM ids 1\.\.35"):
        _ids("sglang", [24, 30, 36], n=36, arch="GptOssForCausalLM", version="0.5.14")
    with pytest.raises(ConsumerError, match="rule for target architecture 'FalconForCausalLM' was not read"):
        _ids("sglang", [2, 15, 27], arch="FalconForCausalLM")
    with pytest.raises(ConsumerError, match=r"sglang version '0\.5\.9' was not read.*0\.5\.23, 0\.5\.14"):
        _ids("sglang", [2, 15, 27], version="0.5.9")


def test_ids_zero_and_n_where_captured():
    assert _ids("vllm", [0, 15, 30]) == [0, 15, 30]  # vLLM captures the embedding output and the last block
    assert _ids("speculators", [0, 15, 30]) == [0, 15, 30]
    for fmt in ("sglang", "specforge"):
        for ids in ([0, 15, 27], [3, 15, 30]):
            with pytest.raises(ConsumerError, match=r"captures vLLM ids 1\.\.29 only.*formats that can: vllm, "):
                _ids(fmt, ids)
    with pytest.raises(ConsumerError, match="Gemma3ForCausalLM does not implement SupportsEagle3"):
        _ids("vllm", [2, 9, 15], n=18, arch="Gemma3ForCausalLM")


def test_layer_count_other_than_three(smollm, tmp_path):
    two = DraftHead(DraftConfig.for_target(smollm, [5, 20], 4096))
    with pytest.raises(ConsumerError, match="reads exactly 3 target layers.*formats that can: vllm, sglang, speculators"):
        export_drafter(two, "specforge", tmp_path / "specforge")
    assert not (tmp_path / "specforge").exists()
    for fmt in ("vllm", "sglang", "speculators"):
        cfg = json.loads((export_drafter(two, fmt, tmp_path / fmt) / "config.json").read_text())
        assert read_layer_ids(cfg, fmt, 30, LLAMA) == [5, 20]
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["num_aux_hidden_states"] == 2


def test_normalised_head_writes_fc_norm(smollm, tmp_path):
    from safetensors import safe_open

    normed = init_head(DraftHead(replace(DraftConfig.for_target(smollm, [3, 15, 27], 4096), input_norm="rms")), seed=4)
    for fmt in ALL:
        out = export_drafter(normed, fmt, tmp_path / fmt, dtype="float32")
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["fc_norm"] is True
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert torch.equal(f.get_tensor("fc_norm.2.weight"), torch.ones(smollm.hidden_size))
        back = load_export(out, smollm)
        assert back.config.input_norm == "rms" and _draft(back, smollm)[0] == _draft(normed, smollm)[0]


def test_inverse_rms_head_exports_plain_eagle3(smollm, tiny_store, tmp_cache, tmp_path):
    """A head trained with init_fc="inverse_rms" (fc frozen, so it stays at that start) is plain
    EAGLE-3: every format writes it without fc_norm and reads it back unchanged."""
    from safetensors import safe_open

    from wavesurf.drafter.features import stream_rms
    from wavesurf.drafter.train import TrainSettings, train_drafter

    layers = [2, 15, 27]
    settings = TrainSettings(init_fc="inverse_rms", frozen=("fc",), ttt_steps=2, draft_vocab_size=1024,
                             batch_tokens=256, max_steps=2)
    train_drafter(smollm, tiny_store, layers, settings, tmp_path / "run", progress=False)
    rms = torch.from_numpy(stream_rms(tiny_store, layers)).float().repeat_interleave(smollm.hidden_size)
    start = init_head(DraftHead(DraftConfig.for_target(smollm, layers, 1024)), seed=0).fc.weight / rms
    trained = load_head(tmp_path / "run", smollm)[0]
    torch.testing.assert_close(trained.fc.weight, start, rtol=1e-6, atol=0)
    assert trained.config.input_norm == "none"
    for fmt in ALL:
        out = export_drafter(tmp_path / "run", fmt, tmp_path / fmt, dtype="float32")
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["fc_norm"] is False and cfg["wavesurf"]["config"]["input_norm"] == "none"
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert not any(name.startswith("fc_norm") for name in f.keys())
        back = load_export(out, smollm)
        for key, value in trained.state_dict().items():
            assert torch.equal(value, back.state_dict()[key]), (fmt, key)
        assert _draft(back, smollm)[0] == _draft(trained, smollm)[0]


def test_speculators_verifier_and_full_vocabulary(smollm, gemma, tmp_path):
    from safetensors import safe_open

    full = DraftHead(DraftConfig.for_target(smollm, [2, 15, 27], smollm.vocab_size))
    out = export_drafter(full, "speculators", tmp_path / "s")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not {"d2t", "t2d"} & set(f.keys())  # full vocabulary: no mapping tensors
    back = load_export(out, smollm)
    assert torch.equal(back.draft_to_target, torch.arange(smollm.vocab_size))
    g = DraftHead(DraftConfig.for_target(gemma, [2, 9, 15], 4096))
    cfg = json.loads((export_drafter(g, "speculators", tmp_path / "g") / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["Gemma3ForCausalLM"]
    cfg = json.loads((export_drafter(g, "speculators", tmp_path / "g2", verifier="/models/my-gemma",
                                     target_architecture="Gemma3ForCausalLM") / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "/models/my-gemma"


def test_weight_names_match_serving_loaders(head, tmp_path):
    from safetensors import safe_open

    with safe_open(str(export_drafter(head, "sglang", tmp_path / "e") / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"} <= names
    with safe_open(str(export_drafter(head, "speculators", tmp_path / "s") / "model.safetensors"), "pt") as f:
        assert "layers.0.self_attn.q_proj.weight" in set(f.keys())


def test_export_from_saved_dir_and_bad_inputs(head, smollm, gemma, tmp_path):
    save_head(head, tmp_path / "saved")
    out = export_drafter(tmp_path / "saved", "specforge", tmp_path / "x")
    with pytest.raises(ConsumerError, match="does not exist; choose one of vllm, sglang, specforge, speculators"):
        export_drafter(head, "onnx", tmp_path / "y")
    with pytest.raises(ConsumerError, match="'eagle3' was replaced; choose specforge"):
        export_drafter(head, "eagle3", tmp_path / "y")
    with pytest.raises(ConsumerError, match="'sglang-legacy' was replaced; choose sglang, which now applies"):
        export_drafter(head, "sglang-legacy", tmp_path / "y")
    with pytest.raises(DrafterError, match="trained for target 'smollm2-135m'"):
        load_export(out, gemma)
    with pytest.raises(FileExistsError):
        export_drafter(head, "specforge", out)
    # a hand-edited convention slip is caught on load
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 15, 27]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="disagree with the metadata.*wavesurf export --check"):
        load_export(out)


def test_cli_export(head, tmp_path, capsys):
    from wavesurf.cli import main

    save_head(head, tmp_path / "d")
    assert main(["export", "--drafter", str(tmp_path / "d"), "--format", "specforge", "--out", str(tmp_path / "o")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ids_written"] == [2, 14, 26] and summary["dtype"] == "bfloat16"
    assert main(["export", "--drafter", str(tmp_path / "d"), "--format", "gguf", "--out", str(tmp_path / "p")]) == 2
    assert "choose one of vllm, sglang, specforge, speculators" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_cli_export_check(head, tmp_path, capsys):
    """--check says what each consumer version reads; an export written with the old 'sglang' rule
    (vLLM ids under eagle_config when the first id is not 1) is flagged: SGLang reads it one layer high."""
    from wavesurf.cli import main

    out = export_drafter(head, "sglang", tmp_path / "new")
    assert main(["export", "--check", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["consumer"]: r for r in report["consumers"]}
    assert report["ok"] is True and report["trained_layer_ids"] == [3, 15, 27]
    assert rows["sglang 0.5.23"]["reads"] == [3, 15, 27] and rows["sglang 0.5.14"]["matches"]
    assert rows["vllm 0.32.0"]["reads"] == [2, 15, 27] and rows["vllm 0.32.0"]["default_ids"]  # no top-level ids
    assert rows["speculators 0.9.0"]["reads"] is None

    old = json.loads((out / "config.json").read_text())  # as wavesurf wrote it before: no consumer record
    old["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 15, 27]
    del old["wavesurf"]["consumer"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    assert main(["export", "--check", str(tmp_path / "old")]) == 1
    report = json.loads(capsys.readouterr().out)
    rows = {r["consumer"]: r for r in report["consumers"]}
    assert report["ok"] is False and rows["sglang 0.5.23"]["reads"] == [4, 16, 28]

    (tmp_path / "empty").mkdir()
    assert main(["export", "--check", str(tmp_path / "empty")]) == 2
    assert "has no config.json; it is not a drafter export" in capsys.readouterr().err
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["export", "--check", str(tmp_path / "empty")]) == 2
    assert "names no EAGLE-3 target layers" in capsys.readouterr().err
    assert main(["export", "--drafter", str(tmp_path)]) == 2
    assert "export needs --format, --out (or --check DIR" in capsys.readouterr().err
    save_head(head, tmp_path / "d")
    assert main(["export", "--drafter", str(tmp_path / "d"), "--format", "sglang", "--consumer-version", "0.4",
                 "--out", str(tmp_path / "v")]) == 2
    assert "sglang version '0.4' was not read" in capsys.readouterr().err
