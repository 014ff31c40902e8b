"""Export to the eagle3 (SGLang/SpecForge) and speculators (vLLM) formats and back."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from wavesurf.drafter.export import export_drafter, load_export
from wavesurf.drafter.head import DraftConfig, DraftHead, DrafterError, causal_mask, init_head, save_head

pytestmark = pytest.mark.filterwarnings("ignore:SGLang ids")


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


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_export_round_trip_reproduces_drafts(head, smollm, tmp_path, fmt):
    out = export_drafter(head, fmt, tmp_path / fmt)
    back = load_export(out, smollm)
    for key, value in head.state_dict().items():
        assert torch.equal(value, back.state_dict()[key]), key
    assert _draft(back, smollm)[0] == _draft(head, smollm)[0]
    assert torch.equal(_draft(back, smollm)[1], _draft(head, smollm)[1])


def test_layer_id_conventions_per_format(head, tmp_path):
    with pytest.warns(UserWarning, match="do not start at 1"):  # SGLang's first-id heuristic
        e = json.loads((export_drafter(head, "eagle3", tmp_path / "e") / "config.json").read_text())
    s = json.loads((export_drafter(head, "speculators", tmp_path / "s") / "config.json").read_text())
    assert e["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 14, 26]  # SGLang: output of block k
    assert s["eagle_aux_hidden_state_layer_ids"] == [3, 15, 27]  # vLLM ids, unchanged
    assert s["norm_before_residual"] is False and "norm_before_residual" in e
    assert e["architectures"] == ["LlamaForCausalLMEagle3"] and e["draft_vocab_size"] == 4096
    assert e["vocab_size"] == 49152 and s["transformer_layer_config"]["vocab_size"] == 49152


def test_weight_names_match_serving_loaders(head, tmp_path):
    from safetensors import safe_open

    with safe_open(str(export_drafter(head, "eagle3", tmp_path / "e") / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"} <= names
    with safe_open(str(export_drafter(head, "speculators", tmp_path / "s") / "model.safetensors"), "pt") as f:
        assert "layers.0.self_attn.q_proj.weight" in set(f.keys())


def test_export_from_saved_dir_and_bad_inputs(head, smollm, gemma, tmp_path):
    save_head(head, tmp_path / "saved")
    out = export_drafter(tmp_path / "saved", "eagle3", tmp_path / "x")
    with pytest.raises(DrafterError, match="does not exist; choose one of eagle3, speculators"):
        export_drafter(head, "onnx", tmp_path / "y")
    with pytest.raises(DrafterError, match="trained for target 'smollm2-135m'"):
        load_export(out, gemma)
    with pytest.raises(FileExistsError):
        export_drafter(head, "eagle3", out)
    normed = DraftHead(replace(DraftConfig.for_target(smollm, [3, 15, 27], 4096), input_norm="rms"))
    for fmt in ("eagle3", "speculators"):
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
    assert main(["export", "--drafter", str(tmp_path / "d"), "--format", "speculators", "--out", str(tmp_path / "o")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ids_written"] == [3, 15, 27] and summary["convention_written"] == "vllm"
    assert main(["export", "--drafter", str(tmp_path / "d"), "--format", "gguf", "--out", str(tmp_path / "p")]) == 2
    assert "choose one of eagle3, speculators" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
