import json

import pytest

from wavesurf.cli import build_parser, main


def test_help_reads_well(capsys):
    for verb in (None, "models", "datasets", "capture"):
        with pytest.raises(SystemExit) as ex:
            main([verb, "--help"] if verb else ["--help"])
        assert ex.value.code == 0
    out = capsys.readouterr().out
    assert "vLLM convention" in out and "--max-tokens" in out and "EAGLE-3 rule" in out


def test_models_lists_both(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["name"], r["n_layers"], r["hidden_size"], r["vocab_size"]) for r in rows} == {
        ("smollm2-135m", 30, 576, 49152), ("gemma3-270m", 18, 640, 262144)}


def test_datasets_lists_sizes(capsys):
    assert main(["datasets", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["mt-bench"]["examples"] == 80 and rows["humaneval"]["examples"] == 164
    assert sum(rows["sharegpt"]["splits"].values()) == rows["sharegpt"]["examples"]


@pytest.mark.parametrize("argv, message", [
    (["capture", "--max-tokens", "0"], "must be a positive integer"),
    (["capture", "--max-tokens", "100", "--layers", "2,x"], "comma-separated vLLM layer ids"),
])
def test_argument_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as ex:
        main(argv)
    assert ex.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["capture", "--max-tokens", "100", "--layers", "2,99"], "0..30"),
    (["capture", "--max-tokens", "100", "--model", "nope"], "smollm2-135m"),
    (["capture", "--max-tokens", "100000000", "--dataset", "humaneval"], "ask for at most"),
    (["capture", "--max-tokens", "100", "--dataset", "missing.jsonl"], "does not exist"),
])
def test_runtime_errors_exit_2(capsys, argv, message):
    assert main(argv + ["--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wavesurf capture: error:") and message in err


def test_capture_prints_summary(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["capture", "--dataset", "mt-bench", "--max-tokens", "300", "--layers", "1,30",
                 "--out", str(out), "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] == 300 and summary["layers_written"] == [1, 30] and summary["n_layers"] == 30
    assert {"model", "hidden_size", "tokens_kept", "mean_token_entropy_nats", "seconds"} <= set(summary)
    assert (out / "wavesurf-manifest.json").is_file()


def test_parser_has_verbs():
    verbs = build_parser()._subparsers._group_actions[0].choices
    assert {"models", "datasets", "capture"} <= set(verbs)


SMALL_ARGS = ["--max-tokens", "1500", "--max-len", "128", "--batch-tokens", "1024", "--resample-groups", "4", "--quiet"]


def test_analyze_and_select_use_the_cache(small_stats, capsys):
    assert main(["analyze", *SMALL_ARGS]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["key"] == small_stats.key and summary["layer_convention"] == "vllm"
    assert len(summary["entropy_nats"]) == 31 and summary["compartments"][0][0] == 0
    lo, hi = summary["entropy_95ci_nats"]["15"]
    assert lo < summary["entropy_nats"]["15"] < hi
    assert main(["select", "--k", "3", "--method", "aggregate", *SMALL_ARGS]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["convention"] == "vllm" and out["sglang_layer_ids"] == [i - 1 for i in out["layer_ids"]]
    assert 0.0 <= out["chosen_in_resamples"] <= 1.0
    assert main(["select", "--method", "default", "--eagle-config", "specforge", *SMALL_ARGS]) == 0
    snippet = json.loads(capsys.readouterr().out)
    assert snippet == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True},
                       "fc_norm": False}
    assert main(["select", "--method", "default", "--eagle-config", "sglang", *SMALL_ARGS]) == 0
    snippet = json.loads(capsys.readouterr().out)  # SmolLM2 is a LlamaForCausalLM: SGLang adds +1 to every id
    assert snippet["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert snippet["num_aux_hidden_states"] == 3


@pytest.mark.parametrize("argv, message", [
    (["select", "--method", "pca"], "available: default, entropy, aggregate, cka, combined"),
    (["select", "--k", "0"], "allowed are 1..31"),
    (["analyze", "--filter", "top20"], "allowed:"),
    (["analyze", "--filter", "12nats"], "the statistics need at least 577"),
])
def test_analysis_errors_exit_2(capsys, argv, message):
    assert main(argv + SMALL_ARGS) == 2
    assert message in capsys.readouterr().err


def test_bad_resample_groups_exit_2_before_any_model_work(capsys):
    assert main(["analyze", *SMALL_ARGS, "--resample-groups", "1"]) == 2  # the last value wins
    assert "resample_groups=1 is not allowed" in capsys.readouterr().err


def test_import_and_help_do_not_load_torch_and_submodules_resolve():
    """``import wavesurf`` and ``wavesurf --help`` stay light; ``ws.models`` / ``ws.stats.analysis``
    still resolve as attributes (notebooks use them), and an unknown name is an AttributeError."""
    import subprocess
    import sys

    code = ("import sys, wavesurf as ws; assert 'torch' not in sys.modules; "
            "from wavesurf.cli import build_parser; build_parser(); assert 'torch' not in sys.modules; "
            "assert callable(ws.models.configure_torch); assert ws.stats.analysis.analyze is ws.analyze; "
            "assert callable(ws.stats.compartments)\n"
            "try:\n    ws.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
            "else:\n    raise SystemExit('no AttributeError')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
