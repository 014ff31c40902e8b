"""The real ``speculators`` package (vllm-project/speculators, PyPI) loads our ``speculators``
export on CPU and drafts the same tokens as our head.

speculators pins ``transformers<=5.19`` and we run a newer one, so the test installs it with
``pip --target`` into a directory of its own (no dependencies: torch, pydantic and the rest come
from this environment) and runs it in a subprocess with that directory first on ``PYTHONPATH``.
The directory is kept in the wavesurf cache and reused.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from wavesurf.drafter.export import export_drafter
from wavesurf.drafter.head import DraftConfig, DraftHead, init_head

#: speculators and what importing its eagle3 model needs beyond this environment, without their
#: dependencies (torch, numpy, pydantic, ... come from here); openai is installed with its own
PACKAGES = ["speculators==0.9.0", "transformers==5.19.0", "hs-connectors==0.9.0", "datasets<=5.1.0", "loguru==0.7.3",
            "pydantic-settings", "dill", "multiprocess", "xxhash", "pandas", "pyarrow"]
WITH_DEPS = ["openai"]
STEPS = 3

RUNNER = textwrap.dedent("""
    import json, sys, warnings
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    export_dir, inputs_path, out_path = sys.argv[1:4]
    config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(export_dir, config=config).float().eval()
    from safetensors import safe_open
    with safe_open(export_dir + "/model.safetensors", "pt") as f:
        written = set(f.keys())
    state = model.state_dict()
    info = {"missing_keys": [k for k in state if k not in written],
            "unexpected_keys": [k for k in written if k not in state],
            "nan_keys": [k for k, v in state.items() if v.is_floating_point() and bool(v.isnan().any())]}
    inputs = torch.load(inputs_path)
    with torch.no_grad():
        drafts = model(hidden_states=inputs["features"], input_ids=inputs["input_ids"],
                       document_ids=torch.zeros_like(inputs["input_ids"]), ttt_steps=inputs["steps"])
    d2t = model.d2t if model.d2t is not None else torch.zeros(model.draft_vocab_size, dtype=torch.long)
    tokens = [(d + d2t[d]).tolist() for d in drafts]
    json.dump({"tokens": tokens, "missing": sorted(info["missing_keys"]), "fc_in": model.fc.in_features,
               "fc_norm": model.fc_norm is not None,
               "unexpected": sorted(info["unexpected_keys"]), "nan": sorted(info["nan_keys"]),
               "layer_ids": list(model.target_layer_ids)}, open(out_path, "w"))
""")


@pytest.fixture(scope="session")
def speculators_path():
    from wavesurf.cache import cache_root

    where = cache_root() / "test-envs" / ("-".join(p.replace("==", "") for p in PACKAGES[:2]))
    if not (where / ".complete").is_file():
        tmp = where.with_name(where.name + ".partial")
        for extra, packages in ((["--no-deps"], PACKAGES), ([], WITH_DEPS)):
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *extra, "--target", str(tmp),
                                   "--upgrade", *packages], capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"speculators could not be installed here (pip exit {proc.returncode}): "
                            f"{proc.stderr[-400:]}")
        if where.exists():
            import shutil

            shutil.rmtree(where)
        tmp.rename(where)
        (where / ".complete").write_text(" ".join(PACKAGES))
    return where


@pytest.mark.parametrize("ids,input_norm", [([3, 15, 27], "none"), ([2, 9, 15, 27], "none"), ([3, 15, 27], "rms")],
                         ids=["k3", "k4", "fc_norm"])
def test_speculators_loads_our_export_and_drafts_the_same_tokens(smollm, speculators_path, tmp_path, ids, input_norm):
    """k = 4 (fc sized by the id count) and a per-stream normalised head (fc_norm) included."""
    from dataclasses import replace

    from wavesurf.assets import ensure_dequantized
    from wavesurf.drafter.acceptance import head_hits

    config = replace(DraftConfig.for_target(smollm, ids, 4096), input_norm=input_norm)
    head = init_head(DraftHead(config), seed=5)
    head.set_vocab(torch.randperm(smollm.vocab_size, generator=torch.Generator().manual_seed(2))[:4096].sort().values)
    head.eval()
    # speculators reads the verifier's config (number of layers) from name_or_path: the local checkpoint
    out = export_drafter(head, "speculators", tmp_path / "export", include_embedding=smollm,
                         verifier=str(ensure_dequantized("smollm2-135m")), dtype="float32",
                         speculative_tokens=STEPS)

    # real target features of a real prompt
    text = "Speculative decoding drafts tokens with a small head and verifies them with the target model."
    input_ids = smollm.tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        hs = smollm.model(input_ids, output_hidden_states=True).hidden_states
    features = torch.cat([hs[i] for i in ids], dim=-1)  # vLLM id i < N is HF hidden_states[i]
    t = input_ids.shape[1]
    # ours: step j at position t sees the embedding of x_{t+1+j}; speculators' step 0 reads input_ids
    # as given and shifts them by one per later step, so it gets the ids shifted by one
    shifted = torch.cat([input_ids[:, 1:], input_ids.new_zeros(1, 1)], dim=1)
    torch.save({"features": features, "input_ids": shifted, "steps": STEPS}, tmp_path / "inputs.pt")

    env = {**os.environ, "PYTHONPATH": str(speculators_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(out), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "drafts.json")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads((tmp_path / "drafts.json").read_text())
    assert theirs["layer_ids"] == ids
    assert theirs["fc_in"] == len(ids) * smollm.hidden_size and theirs["fc_norm"] == (input_norm == "rms")
    assert not theirs["unexpected"], theirs["unexpected"]
    unused = {"verifier_lm_head.weight", "verifier_norm.weight"}  # speculators' training-only weights
    assert set(theirs["missing"]) <= unused and set(theirs["nan"]) <= unused, theirs

    # our teacher-forced unroll, with "target argmax" set to speculators' drafts: a hit is agreement
    for j in range(STEPS):
        n = t - 1 - j
        drafts = torch.tensor(theirs["tokens"][j])[0]
        argmax = torch.zeros(1, t, dtype=torch.long)
        argmax[0, 1 + j: 1 + j + n] = drafts[:n]
        batch = {"input_ids": input_ids, "attention_mask": torch.ones(1, t, dtype=torch.bool),
                 "features": features, "target_argmax": argmax}
        hits = head_hits(head, batch, smollm.model.get_input_embeddings(), STEPS)
        assert bool(hits[0, :n, j].all()), f"step {j}: {int(hits[0, :n, j].sum())}/{n} positions agree"
