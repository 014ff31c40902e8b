"""Export for each consumer (vLLM, SGLang old and new, SpecForge, speculators) and back."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from wavesurf.consumers import ConsumerError, read_layer_ids, written_layer_ids
from wavesurf.drafter.export import export_drafter, load_export
from wavesurf.drafter.head import DraftConfig, DraftHead, DrafterError, causal_mask, init_head, save_head

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


ALL = ["vllm", "sglang", "sglang-legacy", "specforge", "speculators"]


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


def _ids(fmt, layer_ids, n=30):
    return written_layer_ids(fmt, layer_ids, n)


def test_each_consumer_reads_the_ids_the_head_was_trained_on(head, tmp_path):
    """The ids written follow each consumer's reading rule (see export.py for the upstream files),
    and applying that rule to the written config gives back the head's vLLM ids."""
    configs = {fmt: json.loads((export_drafter(head, fmt, tmp_path / fmt) / "config.json").read_text()) for fmt in ALL}
    assert configs["vllm"]["eagle_aux_hidden_state_layer_ids"] == [3, 15, 27]  # vLLM: top level, as is
    assert "eagle_config" not in configs["vllm"]
    assert configs["speculators"]["eagle_aux_hidden_state_layer_ids"] == [3, 15, 27]
    assert configs["sglang-legacy"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 14, 26]  # always +1
    assert configs["specforge"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 14, 26]
    # SGLang with PR #25454: first id != 1 -> read as vLLM ids
    assert configs["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 15, 27]
    for fmt, cfg in configs.items():
        assert read_layer_ids(fmt, cfg) == [3, 15, 27], fmt
        assert cfg["norm_before_residual"] is False and cfg["draft_vocab_size"] == 4096
    for fmt in ("vllm", "sglang", "sglang-legacy", "specforge"):
        assert configs[fmt]["architectures"] == ["LlamaForCausalLMEagle3"] and configs[fmt]["vocab_size"] == 49152
    assert configs["speculators"]["transformer_layer_config"]["vocab_size"] == 49152


def test_sglang_rule_by_first_id():
    # SGLang's rule applied by hand: +1 exactly when the first written id is 1
    def sglang_reads(written):
        return [i + 1 for i in written] if written[0] == 1 else list(written)

    for ids in ([2, 15, 27], [3, 15, 27], [5, 9, 29], [2, 3, 4]):
        assert sglang_reads(_ids("sglang", ids)) == ids
        assert [i + 1 for i in _ids("sglang-legacy", ids)] == ids
    assert _ids("sglang", [2, 15, 27]) == [1, 14, 26]  # the default set: what old and new SGLang both read
    with pytest.raises(ConsumerError, match="first id is 1.*sglang-legacy"):
        _ids("sglang", [1, 15, 27])
    assert _ids("sglang-legacy", [1, 15, 27]) == [0, 14, 26]


@pytest.mark.parametrize("fmt", ALL)
def test_ids_no_consumer_captures_are_refused(fmt):
    for ids in ([0, 15, 27], [3, 15, 30]):
        with pytest.raises(ConsumerError, match=r"captures vLLM ids 1\.\.29 only"):
            _ids(fmt, ids)


def test_layer_count_other_than_three(smollm, tmp_path):
    two = DraftHead(DraftConfig.for_target(smollm, [5, 20], 4096))
    for fmt in ("vllm", "sglang", "sglang-legacy", "specforge"):
        with pytest.raises(ConsumerError, match="reads exactly 3 target layers.*--format speculators"):
            export_drafter(two, fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()
    cfg = json.loads((export_drafter(two, "speculators", tmp_path / "s") / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [5, 20]


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
                                     verifier_architecture="Gemma3ForCausalLM") / "config.json").read_text())
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
    with pytest.raises(ConsumerError, match="does not exist; choose one of vllm, sglang, sglang-legacy"):
        export_drafter(head, "onnx", tmp_path / "y")
    with pytest.raises(ConsumerError, match="'eagle3' was split by consumer; choose specforge"):
        export_drafter(head, "eagle3", tmp_path / "y")
    with pytest.raises(DrafterError, match="trained for target 'smollm2-135m'"):
        load_export(out, gemma)
    with pytest.raises(FileExistsError):
        export_drafter(head, "specforge", out)
    normed = DraftHead(replace(DraftConfig.for_target(smollm, [3, 15, 27], 4096), input_norm="rms"))
    for fmt in ALL:
        with pytest.raises(DrafterError, match="input_norm='rms'.*cannot express"):
            export_drafter(normed, fmt, tmp_path / f"normed-{fmt}")
        assert not (tmp_path / f"normed-{fmt}").exists()
    # a hand-edited convention slip is caught on load
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 15, 27]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="disagree with the metadata"):
        load_export(out)


def test_cli_export(head, tmp_path, capsys):
    from wavesurf.cli import main

    save_head(head, tmp_path / "d")
    assert main(["export", "--drafter", str(tmp_path / "d"), "--format", "specforge", "--out", str(tmp_path / "o")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ids_written"] == [2, 14, 26] and summary["dtype"] == "bfloat16"
    assert main(["export", "--drafter", str(tmp_path / "d"), "--format", "gguf", "--out", str(tmp_path / "p")]) == 2
    assert "choose one of vllm, sglang, sglang-legacy, specforge, speculators" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
