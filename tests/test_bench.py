"""The benchmark on the real SmolLM2 with small budgets: tidy rows, two MT-bench turns, losslessness
recorded, the results cache keyed by every parameter, bad settings refused before any work."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from wavesurf.bench import (
    DECODE_METHODS, BenchError, BenchPrompt, BenchSettings, bench_prompts, prompt_ids, run_bench, untrained_head,
)
from wavesurf.cache import params_key
from wavesurf.drafter.head import head_fingerprint
from wavesurf.cli import main


def test_run_bench_rows_summary_and_cache(smollm, tmp_cache):
    head = untrained_head(smollm)
    settings = BenchSettings(n_prompts=1, max_new_tokens=6, mode="chain", draft_len=3)
    res = run_bench(smollm, head, "mt-bench", settings, progress=False)
    assert [r["method"] for r in res.rows] == list(DECODE_METHODS)
    for r in res.rows:
        assert r["turns"] == 2 and r["prompt_id"] == "mt-bench/81"
        assert 2 <= r["new_tokens"] <= 12 and r["lossless"] is True  # every method equals HF greedy
        assert r["tokens_per_second"] > 0 and r["seconds"] > 0
    spec = next(r for r in res.rows if r["method"] == "eagle3")
    # tau = tokens after each turn's first / forwards after each turn's prefill
    assert spec["tau"] == pytest.approx((spec["new_tokens"] - 2) / (spec["target_forwards"] - 2), abs=1e-3)
    m = res.summary["methods"]
    assert m["hf_generate"]["speedup"] == 1.0 and m["eagle3"]["lossless"] == "1/1"
    assert res.path is not None and (res.path / "summary.json").is_file()
    with open(res.path / "rows.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(DECODE_METHODS)
    assert json.loads((res.path / "summary.json").read_text())["settings"]["drafter"] == head_fingerprint(head)
    # the cache key: exactly these names (results cached before BenchSettings keep their keys)
    assert res.key == params_key(res.settings) and sorted(res.settings) == sorted([
        "model", "drafter", "dataset", "split", "split_seed", "n_prompts", "max_new_tokens", "mode", "depth", "top_k",
        "total_tokens", "temperature", "seed", "methods", "prompt_lookup_tokens", "max_prompt_tokens", "warmup",
        "tie_eps", "device", "threads", "wavesurf", "layer_ids", "draft_vocab_size"])
    assert res.settings["methods"] == list(DECODE_METHODS) and (res.settings["depth"], res.settings["top_k"]) == (3, 1)
    again = run_bench(smollm, head, "mt-bench", settings, progress=False)  # served from the cache: same key, same numbers
    assert again.key == res.key and again.rows[0]["seconds"] == res.rows[0]["seconds"]
    other = untrained_head(smollm, seed=1)  # another drafter is never served this result
    assert head_fingerprint(other) != head_fingerprint(head)


def test_second_mt_bench_turn_follows_the_first_answer(smollm):
    p = bench_prompts("mt-bench", 1, smollm)[0]
    one = smollm.tokenizer.decode(prompt_ids(smollm, p, []))
    two = smollm.tokenizer.decode(prompt_ids(smollm, p, ["MY ANSWER"]))
    assert p.turns[0] in one and p.turns[1] not in one
    assert two.index(p.turns[0]) < two.index("MY ANSWER") < two.index(p.turns[1])
    assert two.rstrip().endswith("assistant")  # ends with the generation prompt


def test_plain_text_prompts_for_models_without_a_template(smollm):
    class NoTemplate:  # the same real tokenizer, used as a base model would be
        tokenizer, has_chat_template = smollm.tokenizer, False

    p = BenchPrompt("x", ["first?", "second?"])
    text = smollm.tokenizer.decode(prompt_ids(NoTemplate, p, ["ans"]))
    assert text.endswith("User: first?\n\nAssistant: ans\n\nUser: second?\n\nAssistant:")
    raw = BenchPrompt("he", ["def f(x):\n"], raw=True)
    assert smollm.tokenizer.decode(prompt_ids(NoTemplate, raw, [])) == "def f(x):\n"


def test_bad_settings_are_refused(smollm, tmp_cache):
    head = untrained_head(smollm)
    with pytest.raises(BenchError, match="dataset='gsm8k'"):
        run_bench(smollm, head, "gsm8k", BenchSettings(n_prompts=1))
    with pytest.raises(BenchError, match="beam"):
        BenchSettings(n_prompts=1, methods=["beam"])
    with pytest.raises(BenchError, match="n_prompts=0"):
        BenchSettings(n_prompts=0)
    with pytest.raises(BenchError, match="must be a BenchSettings"):
        run_bench(smollm, head, "mt-bench", {"n_prompts": 1})
    with pytest.raises(BenchError, match=r"unknown bench settings \['prompts'\]"):
        BenchSettings.from_dict({"prompts": 3})
    with pytest.raises(BenchError, match="lookup_ngram=3 drafts a chain"):
        BenchSettings(n_prompts=1, mode="tree", lookup_ngram=3)
    with pytest.raises(BenchError, match="lookup_ngram=9"):
        BenchSettings(n_prompts=1, lookup_ngram=9)
    assert not (tmp_cache / "results").exists()  # nothing half-written


def test_cli_bench_refuses_bad_tree_before_loading(capsys, tmp_cache):
    code = main(["bench", "--drafter", "untrained", "--mode", "tree", "--depth", "5", "--total-tokens", "3"])
    assert code == 2
    assert "total_tokens=3 is smaller than depth=5" in capsys.readouterr().err
    code = main(["bench", "--drafter", "untrained", "--methods", "hf_generate,warp"])
    assert code == 2 and "warp" in capsys.readouterr().err


def test_cli_bench_with_a_saved_drafter(smollm, tmp_cache, tmp_path, capsys):
    from wavesurf.drafter.head import save_head

    save_head(untrained_head(smollm), tmp_path / "drafter", {"note": "untrained, for the test"})
    code = main(["bench", "--drafter", str(tmp_path / "drafter"), "--dataset", "humaneval", "--n-prompts", "1",
                 "--max-new-tokens", "4", "--methods", "eagle3", "--quiet"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["methods"]) == {"hf_generate", "eagle3"} and out["methods"]["eagle3"]["lossless"] == "1/1"
    assert (tmp_cache / "results" / "bench" / out["key"] / "rows.csv").is_file()
    assert out["settings"]["drafter"] != head_fingerprint(untrained_head(smollm))  # the weights file's sha256


def test_speedup_interval_is_paired_over_prompts_and_covers_the_estimate():
    from wavesurf.bench import speedup_interval

    rng = np.random.default_rng(1)
    hf = rng.uniform(5, 50, size=12)  # prompts differ a lot in speed ...
    rows = [{"prompt_id": f"p{i}", "method": "hf_generate", "tokens_per_second": v} for i, v in enumerate(hf)]
    exact = rows + [{"prompt_id": f"p{i}", "method": "eagle3", "tokens_per_second": 2 * v} for i, v in enumerate(hf)]
    lo, hi = speedup_interval(exact, "eagle3")
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)  # ... but pairing removes that spread
    noisy = rows + [{"prompt_id": f"p{i}", "method": "eagle3", "tokens_per_second": v * rng.uniform(0.8, 1.4)}
                    for i, v in enumerate(hf)]
    lo, hi = speedup_interval(noisy, "eagle3")
    point = sum(r["tokens_per_second"] for r in noisy[12:]) / hf.sum()
    assert lo < point < hi and hi - lo < 0.5
    assert speedup_interval(noisy[:1] + noisy[12:13], "eagle3") is None
