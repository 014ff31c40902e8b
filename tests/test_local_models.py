"""Any HF causal LM from a local directory: small random-weight Llama, Qwen2 and Gemma-3 models
saved with SmolLM2's tokenizer go through analyze -> select -> train -> export -> bench on the CLI."""
from __future__ import annotations

import json

import pytest

ARCHITECTURES = ["llama", "qwen2", "gemma3"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def local_model(request, tiny_model_dir):
    where, architecture = tiny_model_dir(request.param)
    return request.param, where, architecture


def _run(capsys, argv):
    from wavesurf.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_local_directory_through_the_cli(local_model, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WAVESURF_CACHE", str(tmp_path / "cache"))
    arch, model_dir, architecture = local_model
    model = ["--model", str(model_dir)]
    small = ["--dataset", "sharegpt", "--max-tokens", "600", "--max-len", "128", "--batch-tokens", "1024", "--quiet"]

    analysis = _run(capsys, ["analyze", *model, *small])
    assert analysis["n_layers"] == 6 and analysis["model"] == model_dir.name

    selection = _run(capsys, ["select", *model, "--k", "3", "--method", "combined", *small])
    ids = selection["layer_ids"]
    assert len(ids) == 3 and all(1 <= i <= 6 for i in ids), ids
    # vLLM and speculators capture ids 0..N; SGLang-family consumers 1..N-1; vLLM 0.32.0 has no EAGLE-3 for Gemma-3
    assert "speculators" in selection["export_formats"]
    assert ("vllm" in selection["export_formats"]) == (architecture != "Gemma3ForCausalLM")
    assert ("sglang" in selection["export_formats"]) == (6 not in ids)

    drafter = tmp_path / "drafter"
    trained = _run(capsys, ["train", *model, "--layers", ",".join(map(str, ids)), "--dataset", "sharegpt",
                            "--max-train-tokens", "400", "--max-len", "128", "--ttt-steps", "2", "--draft-vocab", "512",
                            "--batch-tokens", "256", "--warmup-steps", "1", "--out", str(drafter), "--quiet"])
    assert trained["layer_ids"] == ids

    # no --verifier: the speculators config names the directory the head was trained on
    exported = _run(capsys, ["export", "--drafter", str(drafter), "--format", "speculators",
                             "--out", str(tmp_path / "export")])
    assert exported["ids_written"] == ids and exported["target_architecture"] == architecture
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(model_dir.resolve()),
                                                        "architectures": [architecture]}
    sglang = ["export", "--drafter", str(drafter), "--format", "sglang", "--out", str(tmp_path / "sglang")]
    if 6 in ids:  # the last block's output: SGLang records the stream entering each block only
        from wavesurf.cli import main

        assert main(sglang) == 2 and "cannot be served by sglang 0.5.23" in capsys.readouterr().err
        assert not (tmp_path / "sglang").exists()
    else:
        assert _run(capsys, sglang)["ids_written"] == [i - 1 for i in ids]  # llama, qwen2, gemma3: always +1

    bench = _run(capsys, ["bench", *model, "--drafter", str(drafter), "--dataset", "mt-bench", "--n-prompts", "1",
                          "--max-new-tokens", "8", "--draft-len", "2", "--methods", "eagle3", "--no-cache", "--quiet"])
    assert bench["methods"]["eagle3"]["lossless"] == "1/1"  # token-identical to HF greedy on this architecture


def test_one_directory_spelled_three_ways(tiny_model_dir, capsys, tmp_path, monkeypatch):
    """distill with a relative path, train with the absolute one, then distill and train again
    through a symlink with a trailing slash: one model, so one corpus, one feature store, one head."""
    from wavesurf import distill

    monkeypatch.setenv("WAVESURF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(distill, "DEFAULT_MAX_NEW_TOKENS", 8)  # so the tiny corpus is the default one
    monkeypatch.setattr(distill, "DEFAULT_MAX_LEN", 128)
    model_dir, _ = tiny_model_dir("llama")
    (tmp_path / "link").symlink_to(model_dir, target_is_directory=True)
    monkeypatch.chdir(model_dir.parent)
    relative, absolute, linked = model_dir.name, str(model_dir.resolve()), f"{tmp_path / 'link'}/"
    gen = ["--dataset", "sharegpt", "--max-tokens", "120", "--max-new-tokens", "8", "--max-len", "128",
           "--device", "cpu", "--quiet"]
    train = ["--layers", "2,3,4", "--max-train-tokens", "400", "--max-len", "128", "--ttt-steps", "2",
             "--draft-vocab", "512", "--batch-tokens", "256", "--warmup-steps", "1", "--device", "cpu", "--quiet"]

    def entries():
        cache = tmp_path / "cache"
        return {p.relative_to(cache): p.stat().st_mtime_ns
                for sub in ("corpora", "drafter/features", "drafter/heads") for p in (cache / sub).glob("*/*")}

    made = _run(capsys, ["distill", "--model", relative, *gen])
    assert made["use_as"] == f"sharegpt@{model_dir.name}"
    first = _run(capsys, ["train", "--model", absolute, *train])  # the corpus of the relative spelling is accepted
    assert first["model"] == model_dir.name
    before = entries()
    again = _run(capsys, ["distill", "--model", linked, *gen])
    assert (again["key"], again["path"]) == (made["key"], made["path"])
    assert _run(capsys, ["train", "--model", linked, *train]) == first  # the finished head, read back
    assert entries() == before  # nothing generated, captured or trained again

    from wavesurf.drafter.head import load_head

    head, _ = load_head(first["out_dir"], target=None)
    assert head.config.extra["target_path"] == absolute  # what an export names as the verifier
    exported = _run(capsys, ["export", "--drafter", first["out_dir"], "--format", "speculators",
                             "--out", str(tmp_path / "export")])
    assert exported["target_architecture"] == "LlamaForCausalLM"
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == absolute
