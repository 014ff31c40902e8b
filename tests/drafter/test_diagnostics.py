"""Does a head use its layers: floor-miss accuracy, stream contributions and ablations, the
embedding-only control; checked against the acceptance scorer and float64 references."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from wavesurf.drafter.diagnostics import ablate_stream, floor_miss_accuracy, stream_contributions
from wavesurf.drafter.head import DraftConfig, DraftHead, init_head

IDS = [2, 15, 27]


@pytest.fixture(scope="module")
def head(smollm):
    h = init_head(DraftHead(DraftConfig.for_target(smollm, IDS, 4096)), seed=7)
    h.set_vocab(torch.arange(4096))
    return h.eval()


@pytest.fixture(scope="module")
def table(smollm, tiny_store):
    from wavesurf.data import ROLE_ASSISTANT, Encoded
    from wavesurf.drafter.acceptance import count_bigrams

    rows = [b["input_ids"][r][b["attention_mask"][r].bool()].numpy()
            for b in tiny_store.batches(IDS, 1024) for r in range(b["input_ids"].shape[0])]
    encoded = [Encoded(str(i), ids, np.full(len(ids), ROLE_ASSISTANT, dtype=np.int8)) for i, ids in enumerate(rows)]
    return count_bigrams(encoded, smollm.vocab_size)


def test_floor_misses_agree_with_the_acceptance_scorer(smollm, tiny_store, head, table, tmp_cache):
    """The head's step-0 hits (rescued + floor hits it keeps) and the floor's equal what
    offline_acceptance and bigram_acceptance count on the same continuations."""
    from wavesurf.drafter.acceptance import bigram_acceptance, offline_acceptance

    fm = floor_miss_accuracy(smollm, head, table, tiny_store)
    acc = offline_acceptance(smollm, head, tiny_store, max_draft_len=1, progress=False, use_cache=False)
    floor = bigram_acceptance(smollm, table, tiny_store, max_draft_len=1, progress=False, use_cache=False)
    assert int(fm.floor_hits.sum()) == int(floor.step_hits[0])
    assert int(fm.rescued.sum() + fm.floor_hits.sum() - fm.lost.sum()) == int(acc.step_hits[0])
    assert int(fm.misses.sum() + fm.floor_hits.sum()) == int(acc.step_total[0])
    if len(fm.sequence_ids) < 2:  # ShareGPT's human answers: few positions survive the greedy cut
        assert "fewer than 2 sequences" in fm.interval()["note"]


def test_rescue_interval_resamples_sequences():
    from wavesurf.drafter.diagnostics import FloorMisses

    rng = np.random.default_rng(0)
    misses = rng.integers(20, 60, size=40)
    rescued = rng.binomial(misses, 0.3)
    fm = FloorMisses("x", [str(i) for i in range(40)], misses, rescued, misses * 2, misses // 5)
    iv = fm.interval(n_boot=2000)
    assert iv["rescue_lo"] < fm.rescue_rate < iv["rescue_hi"] and 0.2 < iv["rescue_lo"] and iv["rescue_hi"] < 0.4
    assert fm.rescue_rate == pytest.approx(rescued.sum() / misses.sum()) and iv["loss_rate"] == pytest.approx(0.1, abs=0.02)


def test_stream_contributions_match_a_float64_reference(tiny_store, head):
    rows = stream_contributions(head, tiny_store, max_tokens=10**9, batch_tokens=512)
    feats = np.concatenate([b["features"][b["attention_mask"].bool()].double().numpy()
                            for b in tiny_store.batches(IDS, 512)])
    w = head.fc.weight.detach().double().numpy()
    d = head.config.target_hidden_size
    parts = [feats[:, i * d:(i + 1) * d] @ w[:, i * d:(i + 1) * d].T for i in range(3)]
    rms = np.array([np.sqrt((p ** 2).mean()) for p in parts])
    assert [r["positions"] for r in rows] == [len(feats)] * 3
    assert np.allclose([r["contribution_rms"] for r in rows], rms, rtol=1e-4)
    assert np.allclose([r["stream_rms"] for r in rows],
                       [np.sqrt((feats[:, i * d:(i + 1) * d] ** 2).mean()) for i in range(3)], rtol=1e-4)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert rows[2]["stream_rms"] > rows[0]["stream_rms"]  # raw residual streams grow with depth


def test_ablation_removes_exactly_one_stream(tiny_store, head):
    batch = next(iter(tiny_store.batches(IDS, 512)))
    x = batch["features"].float()
    full = head.fuse(x)
    d = head.config.target_hidden_size
    for i, lid in enumerate(IDS):
        cut = ablate_stream(head, lid)
        keep = x.clone()
        keep[..., i * d:(i + 1) * d] = 0
        assert torch.allclose(cut.fuse(x), head.fuse(keep), atol=1e-5)
        assert not torch.allclose(cut.fuse(x), full)
    assert torch.equal(head.fc.weight, head.fc.weight)  # the original is untouched
    with pytest.raises(Exception, match=r"layer 3 is not read by this head \(it reads \[2, 15, 27\]\)"):
        ablate_stream(head, 3)


def test_embedding_only_control(smollm, tiny_store, tmp_cache):
    """The control's fuse is zero whatever the streams hold; its config and training key differ from
    the head's only when set, so heads trained before it keep their identity."""
    from wavesurf.drafter.export import export_drafter
    from wavesurf.drafter.train import TrainSettings

    plain = DraftConfig.for_target(smollm, IDS, 256)
    assert "embedding_only" not in plain.to_dict() and "embedding_only" not in TrainSettings().fingerprint()
    control = DraftHead(replace(plain, embedding_only=True))
    x = torch.randn(2, 5, 3 * smollm.hidden_size)
    assert torch.equal(control.fuse(x), torch.zeros(2, 5, smollm.hidden_size))
    assert DraftConfig.from_dict(control.config.to_dict()).embedding_only is True
    assert TrainSettings(embedding_only=True).fingerprint()["embedding_only"] is True
    with pytest.raises(Exception, match="embedding-only control.*not exported"):
        export_drafter(control, "vllm", tmp_cache / "x")
    with pytest.raises(Exception, match="embedding_only='yes' must be True or False"):
        TrainSettings(embedding_only="yes").check()
    with pytest.raises(Exception, match="reads no stream"):
        stream_contributions(control, tiny_store)


def test_floor_misses_are_cached_per_head_table_and_store(smollm, tiny_store, head, table, tmp_cache):
    """A second call reads the first one's entry (the notebooks after 04b read the diagnostics
    again); another head or another table is computed afresh, never served that entry."""
    from wavesurf.drafter.acceptance import BigramTable

    first = floor_miss_accuracy(smollm, head, table, tiny_store, name="a")
    entries = list((tmp_cache / "drafter" / "acceptance").glob("floor_misses-*"))
    assert len(entries) == 1 and (entries[0] / "floor_misses.json").is_file()
    again = floor_miss_accuracy(smollm, head, table, tiny_store, name="b")
    assert again.name == "b" and again.sequence_ids == first.sequence_ids
    for k in ("misses", "rescued", "floor_hits", "lost"):
        assert getattr(again, k).dtype == np.int64 and np.array_equal(getattr(again, k), getattr(first, k))
    never = BigramTable(np.full_like(table.next_token, -1), 0)  # drafts nothing: every position is a miss
    other = floor_miss_accuracy(smollm, head, never, tiny_store)
    assert int(other.floor_hits.sum()) == 0 and int(other.misses.sum()) == int(first.misses.sum() + first.floor_hits.sum())
    other_head = floor_miss_accuracy(smollm, ablate_stream(head, IDS[0]), table, tiny_store)
    assert len(list((tmp_cache / "drafter" / "acceptance").glob("floor_misses-*"))) == 3
    assert np.array_equal(other_head.floor_hits, first.floor_hits)  # the same floor, whatever the head


def test_scoring_with_the_floor_makes_the_floor_miss_entry(smollm, tiny_store, head, table, tmp_cache):
    """offline_acceptances(floor=table) counts the floor misses from its own unroll and caches them;
    floor_miss_accuracy then reads that entry, which equals a count from its own two scans."""
    from wavesurf.drafter.acceptance import offline_acceptances

    offline_acceptances(smollm, head, tiny_store, max_draft_len=3, lookup_ngrams=(0, 3), floor=table, progress=False)
    assert len(list((tmp_cache / "drafter" / "acceptance").glob("floor_misses-*"))) == 1
    cached = floor_miss_accuracy(smollm, head, table, tiny_store, name="x")
    fresh = floor_miss_accuracy(smollm, head, table, tiny_store, use_cache=False)
    assert cached.name == "x" and cached.sequence_ids == fresh.sequence_ids and cached.info == fresh.info
    for k in ("misses", "rescued", "floor_hits", "lost"):
        assert np.array_equal(getattr(cached, k), getattr(fresh, k)), k
    assert int(fresh.misses.sum() + fresh.floor_hits.sum()) > 0  # something was counted
