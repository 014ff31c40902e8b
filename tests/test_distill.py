"""The target's own answers as a corpus, on the real SmolLM2 with tiny budgets."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from wavesurf import distill
from wavesurf.data import ROLE_ASSISTANT, ROLE_TEMPLATE, check_corpus_target, encode, load_corpus
from wavesurf.distill import DistillError, distill_corpus, generate_batch, prompt_ids
from wavesurf.errors import BudgetError, DatasetError

#: a small, quick generation: 2 conversations per chunk, so 150 tokens take a few chunks
SMALL = {"max_tokens": 150, "max_len": 256, "max_new_tokens": 16, "batch_size": 4, "chunk_examples": 2,
         "progress": False}


@pytest.fixture(scope="module")
def gen_cache(smollm, tmp_path_factory):
    """A module-wide WAVESURF_CACHE whose ``models`` links the real model cache (no new dequantization)."""
    from wavesurf.cache import cache_root

    root = tmp_path_factory.mktemp("distill_cache")
    (root / "models").symlink_to(cache_root() / "models", target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WAVESURF_CACHE", str(root))
        mp.setattr(distill, "DEFAULT_MAX_NEW_TOKENS", SMALL["max_new_tokens"])  # so the test corpus is "default"
        mp.setattr(distill, "DEFAULT_MAX_LEN", SMALL["max_len"])
        yield root


@pytest.fixture(scope="module")
def distilled(smollm, gen_cache):
    """ShareGPT heldout answered by SmolLM2, generated with an interruption after the first chunk."""
    with pytest.raises(DatasetError, match="wavesurf distill --model smollm2-135m --dataset sharegpt --split heldout"):
        load_corpus("sharegpt@smollm2-135m", split="heldout")  # nothing generated yet

    def stop(index, tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill_corpus(smollm, "sharegpt", "heldout", on_chunk=stop, **SMALL)
    (entry,) = (gen_cache / "corpora").iterdir()
    assert [p.name for p in entry.iterdir() if p.name.startswith("chunk_")] == ["chunk_00000.jsonl"]
    with pytest.raises(DatasetError, match="default settings"):  # unfinished: not readable
        load_corpus("sharegpt@smollm2-135m", split="heldout")
    return distill_corpus(smollm, "sharegpt", "heldout", **SMALL)


def _first_user_prompts(target, n, max_tokens=160):
    out = []
    for e in load_corpus("sharegpt", split="heldout").examples:
        users = [m for m in e.messages if m["role"] == "user"]
        if users:
            ids = prompt_ids(target, [users[0]])
            if len(ids) <= max_tokens:
                out.append(ids)
        if len(out) == n:
            return out
    raise AssertionError("not enough short prompts")


def _hf_greedy(target, ids, n, eos):
    import torch

    out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=n, eos_token_id=sorted(eos), pad_token_id=2)
    new = out[0, len(ids):].tolist()
    cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return new[:cut]


def test_bad_settings_fail_before_model_work(smollm, gen_cache):
    before = sorted(p.name for p in gen_cache.iterdir())
    cases = [({"temperature": -0.5}, DistillError, r"temperature=-0\.5 must be a finite number >= 0"),
             ({"max_new_tokens": 0}, DistillError, r"max_new_tokens=0 must be an integer >= 1"),
             ({"max_tokens": 1.5}, BudgetError, r"max_tokens=1\.5 must be a positive integer"),
             ({"max_tokens": "100"}, BudgetError, r"max_tokens='100'"),
             ({"batch_size": 0}, DistillError, "batch_size=0"),
             ({"split": None}, DatasetError, "needs a split"),
             ({"dataset": "sharegpt@smollm2-135m"}, DatasetError, "not of a generated one"),
             ({"max_turns": 0}, DistillError, r"max_turns=0 must be a positive integer")]
    for override, exc, message in cases:
        with pytest.raises(exc, match=message):
            distill_corpus(smollm, **{"dataset": "sharegpt", "split": "heldout", **SMALL, **override})
    # more than the prompts could ever give: refused from the prompt count, before generating
    with pytest.raises(BudgetError, match=r"has 160 user turns, so at most 2,560 tokens"):
        distill_corpus(smollm, "mt-bench", None, **{**SMALL, "max_tokens": 10_000})
    assert sorted(p.name for p in gen_cache.iterdir()) == before


def test_greedy_batch1_equals_hf_generate(smollm):
    from wavesurf.drafter.decode import eos_ids

    eos = eos_ids(smollm)
    assert eos == {smollm.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    (ids,) = _first_user_prompts(smollm, 1)
    (ans,) = generate_batch(smollm, [ids], [24], eos=eos)
    assert ans.ids == _hf_greedy(smollm, ids, 24, eos)


@pytest.fixture(scope="module")
def six_prompts_alone(smollm):
    """Six first-turn prompts and their batch-1 greedy answers (16 tokens): the reference both
    kernel paths of the agreement test are held to, decoded once."""
    from wavesurf.drafter.decode import eos_ids

    eos = eos_ids(smollm)
    prompts = _first_user_prompts(smollm, 6)
    return prompts, [generate_batch(smollm, [p], [16], eos=eos)[0].ids for p in prompts]


@pytest.mark.parametrize("packed", [False, True])
def test_batched_agreement_with_batch1(smollm, six_prompts_alone, packed):
    """Padded batches run other kernels (HF's, or the oneDNN-packed weights); raw batched greedy
    (no re-decode) is compared with batch 1 token for token, and with the near-tie re-decode the
    answers must equal batch 1 exactly."""
    from wavesurf.drafter.decode import eos_ids
    from wavesurf.packed import packing_available

    if packed and not packing_available(smollm.model):
        pytest.skip("this PyTorch has no oneDNN linear")
    eos = eos_ids(smollm)
    prompts, alone = six_prompts_alone
    raw = generate_batch(smollm, prompts, [16] * len(prompts), eos=eos, tie_eps=0, packed=packed)
    same = sum(a.ids == b for a, b in zip(raw, alone))
    gaps = [a.min_gap for a in raw]
    print(f"batched (6 rows, no re-decode, packed={packed}) == batch 1: {same}/6 answers; "
          f"smallest top-2 gap {min(gaps):.2e}")
    # where the batched run kept every gap above the threshold, it must agree with batch 1
    assert all(a.ids == b for a, b in zip(raw, alone) if a.min_gap >= distill.TIE_EPS)
    fixed = generate_batch(smollm, prompts, [16] * len(prompts), eos=eos, packed=packed)
    assert [a.ids for a in fixed] == alone
    with pytest.raises(DistillError, match="packed='yes'"):
        generate_batch(smollm, prompts[:2], [4, 4], eos=eos, packed="yes")


def test_sampling_seeded_and_batch_independent(smollm):
    from wavesurf.drafter.decode import eos_ids

    eos = eos_ids(smollm)
    prompts = _first_user_prompts(smollm, 3)
    seeds = [11, 12, 13]
    together = generate_batch(smollm, prompts, [8] * 3, eos=eos, temperature=0.8, row_seeds=seeds)
    alone = [generate_batch(smollm, [p], [8], eos=eos, temperature=0.8, row_seeds=[s])[0] for p, s in zip(prompts, seeds)]
    assert [a.ids for a in together] == [a.ids for a in alone]
    other = generate_batch(smollm, prompts, [8] * 3, eos=eos, temperature=0.8, row_seeds=[21, 22, 23])
    assert [a.ids for a in other] != [a.ids for a in together]


def test_resumed_equals_uninterrupted(smollm, distilled, tmp_path):
    whole = distill_corpus(smollm, "sharegpt", "heldout", path=tmp_path / "whole", **SMALL)
    assert [(e.id, e.messages, e.meta) for e in whole.examples] == [(e.id, e.messages, e.meta) for e in distilled.examples]
    assert whole.info["tokens"] == distilled.info["tokens"] >= SMALL["max_tokens"]
    # whole conversations in corpus order, the last one crossing the budget
    tokens = [e.meta["tokens"] for e in distilled.examples]
    assert sum(tokens[:-1]) < SMALL["max_tokens"] <= sum(tokens)
    heldout_ids = [e.id for e in load_corpus("sharegpt", split="heldout").examples]
    assert [e.id for e in distilled.examples] == [i for i in heldout_ids if i in {e.id for e in distilled.examples}]
    # a second call is served from the cache
    assert distill_corpus(smollm, "sharegpt", "heldout", **SMALL).info["key"] == distilled.info["key"]


def test_generated_examples_and_roles(smollm, distilled):
    original = {e.id: e for e in load_corpus("sharegpt", split="heldout").examples}
    for ex in distilled.examples:
        m = ex.meta
        assert m["original_id"] == ex.id and m["model"] == "smollm2-135m"
        assert m["turns"] == len(m["answer_tokens"]) == len(m["answer_eos"]) == sum(
            x["role"] == "assistant" for x in ex.messages)
        assert m["tokens"] == sum(m["answer_tokens"]) == sum(len(a) for a in m["answer_token_ids"])
        assert all(n <= SMALL["max_new_tokens"] for n in m["answer_tokens"])
        users = [x["content"] for x in ex.messages if x["role"] == "user"]
        assert users == [x["content"] for x in original[ex.id].messages if x["role"] == "user"][: len(users)]
        for ids, eos in zip(m["answer_token_ids"], m["answer_eos"]):
            assert (ids[-1] == 2) == eos
        # training tokens: the assistant-role tokens are exactly the generated ones, <|im_end|> included
        enc = encode(ex, smollm.tokenizer, True, 4096)
        assert enc.input_ids[enc.roles == ROLE_ASSISTANT].tolist() == [t for a in m["answer_token_ids"] for t in a]
        off = encode(ex, smollm.tokenizer, True, 4096, assistant_eot=False)
        assert off.input_ids[off.roles == ROLE_ASSISTANT].tolist() == [
            t for a, e in zip(m["answer_token_ids"], m["answer_eos"]) for t in (a[:-1] if e else a)]
    assert any(any(e.meta["answer_eos"]) for e in distilled.examples), "no answer ended at <|im_end|>"
    # plain corpora keep the closing token as template unless asked
    ex = next(e for e in original.values() if any(x["role"] == "assistant" for x in e.messages))
    plain, forced = encode(ex, smollm.tokenizer, True, 4096), encode(ex, smollm.tokenizer, True, 4096, assistant_eot=True)
    changed = np.flatnonzero(plain.roles != forced.roles)
    assert len(changed) >= 1 and set(plain.input_ids[changed].tolist()) == {2}
    assert (plain.roles[changed] == ROLE_TEMPLATE).all() and (forced.roles[changed] == ROLE_ASSISTANT).all()


def test_load_by_name(smollm, distilled):
    again = load_corpus("sharegpt@smollm2-135m", split="heldout")
    assert again.info["key"] == distilled.info["key"] and again.info["generated_by"] == "smollm2-135m"
    assert [e.messages for e in again.examples] == [e.messages for e in distilled.examples]
    assert again.name == "sharegpt@smollm2-135m" and again.split == "heldout"
    assert load_corpus(f"sharegpt@smollm2-135m#{distilled.info['key']}", split="heldout").info["key"] == distilled.info["key"]
    with pytest.raises(DatasetError, match="split 'train'.*wavesurf distill --model smollm2-135m --dataset sharegpt --split train"):
        load_corpus("sharegpt@smollm2-135m", split="train")
    with pytest.raises(DatasetError, match="give the ShareGPT split"):
        load_corpus("sharegpt@smollm2-135m")
    with pytest.raises(DatasetError, match="no finished corpus with key 'ffff'"):
        load_corpus("sharegpt@smollm2-135m#ffff", split="heldout")
    check_corpus_target(again, smollm)


def test_feature_store_from_generated_corpus(smollm, distilled, gen_cache):
    from wavesurf.drafter.features import FeatureSettings, build_feature_store

    store = build_feature_store(smollm, FeatureSettings(dataset="sharegpt@smollm2-135m", split="heldout",
                                                        max_tokens=300, max_len=128, batch_tokens=512, layer_ids=[2]),
                                progress=False)
    assert store.params["corpus_info"] == {"generated_by": "smollm2-135m", "source": smollm.source,
                                           "key": distilled.info["key"]}
    assert store.loss_roles == "assistant"
    batch = store.batches([2], batch_tokens=512)[0]
    ids, loss = batch["input_ids"], batch["loss_mask"]
    assert bool((loss & (ids == 2)).any()), "an <|im_end|> that ended an answer is trained"


def test_other_models_corpus_refused(smollm, distilled, gen_cache):
    from wavesurf.cache import read_manifest
    from wavesurf.drafter.features import build_feature_store

    src = distilled.info["path"]
    fake = gen_cache / "corpora" / "gemma3-270m-fake"
    shutil.copytree(src, fake)
    manifest = read_manifest(fake)
    manifest["params"].update(model="gemma3-270m", source="a fake gemma entry")
    (fake / "wavesurf-manifest.json").write_text(json.dumps(manifest))
    try:
        corpus = load_corpus("sharegpt@gemma3-270m", split="heldout")
        with pytest.raises(DatasetError, match="generated by model 'gemma3-270m'.*not by the target 'smollm2-135m'"):
            check_corpus_target(corpus, smollm)
        with pytest.raises(DatasetError, match="generated by model 'gemma3-270m'"):
            build_feature_store(smollm, dataset="sharegpt@gemma3-270m", split="heldout", max_tokens=100,
                                max_len=128, layer_ids=[2], progress=False)
        from wavesurf.capture import capture

        with pytest.raises(DatasetError, match="not by the target 'smollm2-135m'"):
            next(capture(smollm, corpus, 100, progress=False))
    finally:
        shutil.rmtree(fake)


def test_cli_distill(smollm, gen_cache, capsys):
    from wavesurf.cli import main

    assert main(["distill", "--dataset", "mt-bench", "--max-tokens", "30", "--max-new-tokens", "8", "--max-len", "256",
                 "--chunk-examples", "4", "--quiet", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dataset"] == "mt-bench@smollm2-135m" and out["split"] is None and out["tokens"] >= 30
    assert 0 <= out["eos_fraction"] <= 1 and out["tokens_per_second"] > 0
    assert out["use_as"] == f"mt-bench@smollm2-135m#{out['key']}"  # not the default settings
    assert len(load_corpus(out["use_as"])) == out["examples"]
    assert main(["distill", "--temperature", "-1", "--quiet"]) == 2
    assert "temperature=-1.0 must be a finite number >= 0" in capsys.readouterr().err


def test_other_budgets_reuse_chunks(smollm, distilled):
    """Chunks do not depend on the budget: a smaller budget generates nothing, a larger one continues."""
    from pathlib import Path

    n_chunks = len(list(Path(distilled.info["path"]).glob("chunk_*.jsonl")))
    called = []
    small = distill_corpus(smollm, "sharegpt", "heldout", **{**SMALL, "max_tokens": 40},
                           on_chunk=lambda i, t: called.append(i))
    assert called == [] and small.info["key"] != distilled.info["key"]
    assert [e.messages for e in small.examples] == [e.messages for e in distilled.examples[: len(small)]]
    import json

    have = sum(json.loads(line)["meta"]["tokens"] for f in Path(distilled.info["path"]).glob("chunk_*.jsonl")
               for line in f.read_text().splitlines())  # the last chunk may run past the budget
    more = distill_corpus(smollm, "sharegpt", "heldout", **{**SMALL, "max_tokens": have + 40},
                          on_chunk=lambda i, t: called.append(i))
    assert called and called[0] == n_chunks, (called, n_chunks)
    assert [e.meta for e in more.examples[: len(distilled)]] == [e.meta for e in distilled.examples]


def test_batched_answers_are_redecoded_only_in_float32(smollm):
    """float32 re-decodes near ties alone; half precision (GPU) does not: its logits tie exactly."""
    import torch

    assert distill.distill_tie_eps(smollm) == distill.TIE_EPS > 0
    for dtype in (torch.bfloat16, torch.float16):
        half = type("HalfTarget", (), {"model": torch.nn.Linear(2, 2).to(dtype)})()
        assert distill.distill_tie_eps(half) == 0.0


def test_max_turns_answers_only_the_first_turns(smollm, distilled, gen_cache):
    """max_turns=1: one answer per conversation, the same first answers as the corpus of every turn
    (the first round is the same batch of prompts), its own cache entry; and the prompt-count
    check counts only the turns asked for."""
    first = distill_corpus(smollm, "sharegpt", "heldout", **SMALL, max_turns=1)
    assert first.info["key"] != distilled.info["key"]
    assert all(e.meta["turns"] == 1 for e in first.examples)
    assert len(first.examples) >= len(distilled.examples)  # the same budget spreads over more conversations
    every = {e.id: e.meta["answer_token_ids"][0] for e in distilled.examples}
    shared = [e for e in first.examples if e.id in every]
    assert shared and all(e.meta["answer_token_ids"][0] == every[e.id] for e in shared)
    with pytest.raises(BudgetError, match=r"has 80 user turns \(the first 1 of each conversation\)"):
        distill_corpus(smollm, "mt-bench", None, **{**SMALL, "max_tokens": 10_000}, max_turns=1)
