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


def test_select_probe_runs_the_probe_on_the_same_corpus(small_stats, capsys):
    assert main(["select", "--k", "1", "--method", "probe", "--ridge", "0.1", *SMALL_ARGS]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "probe" and len(out["layer_ids"]) == 1 and out["scores"]["probe_sets_scored"] == 30
    assert "jackknife_agreement" not in out  # a resample of the statistics does not resample the probe


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
    assert 0.0 <= out["jackknife_agreement"] <= 1.0
    assert main(["select", "--method", "default", "--eagle-config", "specforge", *SMALL_ARGS]) == 0
    snippet = json.loads(capsys.readouterr().out)
    assert snippet == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True},
                       "fc_norm": False}
    assert main(["select", "--method", "default", "--eagle-config", "sglang", *SMALL_ARGS]) == 0
    snippet = json.loads(capsys.readouterr().out)  # SmolLM2 is a LlamaForCausalLM: SGLang adds +1 to every id
    assert snippet["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert snippet["num_aux_hidden_states"] == 3


@pytest.mark.parametrize("argv, message", [
    (["select", "--method", "pca"], "available: default, entropy, entropy-spaced, aggregate, greedy-aggregate, mrmr, cka, "
                                    "combined, probe"),
    (["select", "--method", "probe", "--ridge", "0"], "ridge=0.0 must be a finite number > 0"),
    (["select", "--k", "0"], "allowed are 1..31"),
    (["analyze", "--filter", "top20"], "allowed:"),
    # too few kept, after capture (minibatch CKA: no cross moments to accumulate before the refusal)
    (["analyze", "--filter", "10.5nats", "--estimator", "minibatch"], "the statistics need at least 577"),
    (["analyze", "--filter", "12nats"], "filter '12nats' keeps no position: a next-token entropy over 49,152 tokens "
                                        "is at most ln(49,152) = 10.80 nats"),  # refused before capture
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


# ---------------------------------------------------------------------------------------------
# options generated from the settings dataclasses (wavesurf.settings_cli)

#: every option each verb had before its options were generated from the settings dataclasses:
#: a public interface, so each one must still parse
OPTIONS_BEFORE = {
    "analyze": "--model --dataset --split --split-seed --max-tokens --max-len --batch-tokens --roles --filter "
               "--pilot-tokens --include-position0 --l2-normalize --estimator --memory-budget-gb --minibatch-size "
               "--seed --resample-groups --no-cache --device --model-dtype --allow-download --quiet",
    "select": "--k --method --allow-embedding --trade-off --min-spacing --eagle-config --model --dataset --split "
              "--split-seed --max-tokens --max-len --batch-tokens --roles --filter --pilot-tokens --include-position0 "
              "--l2-normalize --estimator --memory-budget-gb --minibatch-size --seed --resample-groups --no-cache "
              "--device --model-dtype --allow-download --quiet",
    "train": "--model --layers --dataset --split-seed --max-train-tokens --max-len --store-layers --store-dtype "
             "--ttt-steps --draft-vocab --vocab-tokens --steps --train-tokens --batch-tokens --lr --warmup-steps "
             "--schedule --seed --init-lm-head --init-attention --freeze --input-norm --embedding-only --precision "
             "--checkpoint-every --log-every --out --no-resume --device --model-dtype --allow-download --quiet",
    "bench": "--model --drafter --dataset --n-prompts --max-new-tokens --max-prompt-tokens --mode --draft-len "
             "--n-calibration --lookup-ngram --no-guard --depth --top-k --total-tokens --temperature --seed --methods "
             "--prompt-lookup-tokens --no-cache --device --model-dtype --allow-download --quiet",
}


def _options(parser):
    return {o: a for a in parser._actions for o in a.option_strings}


@pytest.mark.parametrize("verb", sorted(OPTIONS_BEFORE))
def test_every_option_of_before_still_exists(verb):
    from wavesurf.cli import verb_parser

    assert set(OPTIONS_BEFORE[verb].split()) <= set(_options(verb_parser(verb)))


def test_every_settings_field_has_its_option_with_the_dataclass_default():
    from dataclasses import MISSING, fields

    from wavesurf.cli import VERB_SETTINGS, verb_parser

    for verb, groups in VERB_SETTINGS.items():
        parser = verb_parser(verb)
        options = _options(parser)
        for group in groups:
            cls = group.settings_class()
            for f in fields(cls):
                if f.name in group.exclude:
                    assert group.exclude[f.name], (cls.__name__, f.name)  # says why
                    continue
                action = options.get(group.option(f))
                assert action is not None, f"{verb}: {cls.__name__}.{f.name} has no option {group.option(f)}"
                assert action.dest == group.dest(f)
                expected = group.overrides.get(f.name, {}).get(
                    "default", f.default if f.default is not MISSING else f.default_factory())
                assert parser.get_default(action.dest) == expected, (verb, f.name)
                assert "%(default)" not in (action.help or "")


def test_parsed_defaults_build_the_dataclass_defaults():
    from wavesurf.bench import BenchSettings
    from wavesurf.cli import BENCH_OPTIONS, FEATURE_OPTIONS, TRAIN_OPTIONS, build_parser
    from wavesurf.drafter.features import FeatureSettings
    from wavesurf.drafter.train import TrainSettings

    args = build_parser().parse_args(["train", "--layers", "2,15,27"])
    assert TRAIN_OPTIONS.build(args) == TrainSettings()
    assert FEATURE_OPTIONS.build(args, dataset="sharegpt", max_tokens=200_000) == FeatureSettings()
    assert BENCH_OPTIONS.build(build_parser().parse_args(["bench", "--drafter", "untrained"])) == BenchSettings()


def test_established_option_names_and_list_spellings_parse_to_the_same_settings():
    from wavesurf.cli import BENCH_OPTIONS, TRAIN_OPTIONS, build_parser

    parse = build_parser().parse_args
    old = TRAIN_OPTIONS.build(parse(["train", "--layers", "2", "--steps", "5", "--draft-vocab", "512",
                                     "--freeze", "fc", "attention", "--betas", "0.8", "0.9"]))
    new = TRAIN_OPTIONS.build(parse(["train", "--layers", "2", "--max-steps", "5", "--draft-vocab-size", "512",
                                     "--frozen", "fc,attention", "--betas", "0.8", "0.9"]))
    assert old == new and (old.max_steps, old.draft_vocab_size, old.frozen, old.betas) == (
        5, 512, ("fc", "attention"), (0.8, 0.9))
    bench = BENCH_OPTIONS.build(parse(["bench", "--drafter", "untrained", "--methods", "hf_generate,eagle3",
                                       "--no-guard", "--mode", "auto"]))
    assert bench.methods == ("hf_generate", "eagle3") and bench.guard is False and bench.auto


@pytest.mark.parametrize("argv, message", [
    (["train", "--layers", "2", "--draft-vocab", "0"], "must be a positive integer"),
    (["train", "--layers", "2", "--freeze", "lm_head"], "invalid choice: 'lm_head'"),
    (["train", "--layers", "2", "--schedule", "step"], "invalid choice: 'step'"),
    (["bench", "--drafter", "untrained", "--mode", "beam"], "invalid choice: 'beam'"),
    (["analyze", "--estimator", "guess"], "invalid choice: 'guess'"),
])
def test_generated_options_refuse_while_parsing(capsys, argv, message):
    with pytest.raises(SystemExit) as ex:
        main(argv)
    assert ex.value.code == 2 and message in capsys.readouterr().err


def test_a_settings_field_without_help_or_command_line_form_is_refused():
    from dataclasses import dataclass

    from wavesurf.settings_cli import SettingsOptions, setting

    @dataclass
    class Plain:
        n: int = 1

    @dataclass
    class Obj:
        shape: object = setting(None, help="an object")

    import argparse

    with pytest.raises(TypeError, match=r"Plain.n has no help"):
        SettingsOptions(Plain).add_to(argparse.ArgumentParser())
    with pytest.raises(TypeError, match="no command-line form"):
        SettingsOptions(Obj).add_to(argparse.ArgumentParser())
    SettingsOptions(Obj, exclude={"shape": "Python only"}).add_to(argparse.ArgumentParser())


def test_cli_served_positions_need_the_targets_answers(smollm, tmp_cache, capsys):
    """Statistics on served positions (the target's own answers, assistant tokens) without those
    answers: the error names the `wavesurf distill` command that makes them, before any model work."""
    argv = ["analyze", "--model", "smollm2-135m", "--dataset", "sharegpt@smollm2-135m", "--split", "train",
            "--roles", "assistant", "--max-tokens", "2000"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "wavesurf distill --model smollm2-135m --dataset sharegpt --split train" in err
