"""Shared fixtures: the real embedded models, loaded once per test session.

Tests run offline on the packaged assets with small token budgets; nothing is mocked.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# pytest-xdist workers (`-n 2` in the README's test command) share the machine's cores: each gets
# its share of torch threads (inherited by the notebook kernels and CLI subprocesses it starts)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("WAVESURF_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    import torch

    torch.set_num_threads(int(os.environ["WAVESURF_THREADS"]))

#: Scheduling under `-n 2 --dist loadfile`: xdist hands out whole files, by default the files with
#: the most tests first (`loadscope-reorder`), which started the longest test, the smoke notebooks
#: (~350 s on one core, cold), two thirds into the run. Here the files go in the order below, so
#: that work the notebooks put in the shared cache is found there rather than built twice at once:
#: the notebooks first (notebook 01 computes the small analysis the statistics tests share), then the
#: drafter tests, which do not read it, then the rest; the speed table's test last, when notebook 04b
#: has cached the smoke profile's answers, feature stores and seed-0 heads it reads.
FIRST = ("test_notebooks_smoke_profile_through_papermill_and_nbval",)
LAST_FILES = ("test_speed_table.py",)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's option (xdist/plugin.py, 3.8.0)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    def rank(item):
        if item.name.startswith(FIRST):
            return 0
        if item.path.name in LAST_FILES:
            return 3
        return 1 if item.path.parent.name == "drafter" else 2

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def smollm():
    from wavesurf.models import configure_torch, load_target

    configure_torch()
    return load_target("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def gemma():
    from wavesurf.models import load_target

    return load_target("gemma3-270m", device="cpu")


@pytest.fixture(scope="session")
def sharegpt():
    from wavesurf.data import load_corpus

    return load_corpus("sharegpt")


@pytest.fixture(scope="session")
def real_cache():
    """The cache root of the session (before any test points WAVESURF_CACHE elsewhere)."""
    from wavesurf.cache import cache_root

    return cache_root()


@pytest.fixture
def isolated_cache(smollm, real_cache, monkeypatch, tmp_path):
    """WAVESURF_CACHE -> a fresh directory (set after the model is loaded) for results written by
    the test (vocab counts, stores, bench rows); its ``models`` links to the real model cache, so a
    CLI call does not dequantize again."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(real_cache / "models", target_is_directory=True)
    monkeypatch.setenv("WAVESURF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tmp_cache(isolated_cache, real_cache):
    """:func:`isolated_cache` whose draft-vocabulary counts (``drafter/vocab``) link to the real
    cache too: they depend on the corpus and tokenizer only (written atomically, so workers may
    share them), and counting ShareGPT's training split again cost ~12 s per training test on one
    core. Tests of the vocabulary cache itself use ``isolated_cache``."""
    shared = real_cache / "drafter" / "vocab"
    shared.mkdir(parents=True, exist_ok=True)
    (isolated_cache / "drafter").mkdir()
    (isolated_cache / "drafter" / "vocab").symlink_to(shared, target_is_directory=True)
    return isolated_cache


# A small real capture of ShareGPT's statistics split, shared by the statistics and selection tests.
SMALL = {"dataset": "sharegpt", "split": "stats", "max_tokens": 1500, "max_len": 128, "batch_tokens": 1024,
         "resample_groups": 4}


@pytest.fixture(scope="session")
def small_batches(smollm):
    from wavesurf.capture import capture
    from wavesurf.data import load_corpus

    corpus = load_corpus(SMALL["dataset"], split=SMALL["split"])
    return list(capture(smollm, corpus, SMALL["max_tokens"], max_len=SMALL["max_len"],
                        batch_tokens=SMALL["batch_tokens"], progress=False))


@pytest.fixture(scope="session")
def interval_stats(small_batches):
    """A filtered run with its random control and resampling intervals (4 groups of conversations)."""
    from wavesurf.stats.analysis import AnalysisSettings, analyze_batches

    return analyze_batches(small_batches, 30, 576, AnalysisSettings(filter="q0.2", estimator="minibatch", minibatch_size=64,
                                                                    pilot_tokens=256, resample_groups=4))


@pytest.fixture(scope="session")
def small_stats(smollm):
    """The cached analysis the CLI tests reuse (same settings => same cache key)."""
    from wavesurf.stats.analysis import analyze

    return analyze(smollm, progress=False, **SMALL)


# Small random-weight HF causal LMs saved to a directory with SmolLM2's tokenizer: the "any HF
# model from a local directory" path, cheap enough to run end to end.
def _tiny_config(arch: str, vocab_size: int):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "gemma3":
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=64, query_pre_attn_scalar=16)
    raise ValueError(f"no tiny config for {arch!r}")


@pytest.fixture(scope="session")
def tiny_model_dir(smollm, tmp_path_factory):
    """``tiny_model_dir(arch)`` -> a directory with a 6-layer, d=64 random-weight model of ``arch``
    (llama, qwen2, gemma3); written once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    made: dict = {}

    def make(arch: str):
        if arch not in made:
            where = tmp_path_factory.mktemp("models") / f"tiny-{arch}"
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_tiny_config(arch, smollm.vocab_size))
            model.save_pretrained(where)
            smollm.tokenizer.save_pretrained(where)
            made[arch] = (where, type(model).__name__)
        return made[arch]

    return make
