"""Grouped-jackknife intervals: exact leave-one-group-out sums against brute force, and coverage of
the nominal 95% intervals on synthetic data whose true values are known."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from wavesurf.errors import StatsError
from wavesurf.stats.cka import MinibatchCKA, grouped_unbiased_hsic
from wavesurf.stats.entropy import renyi_entropy
from wavesurf.stats.resampling import (GroupAssigner, GroupedLayerMoments, check_groups, conversation_key,
                                       jackknife, t_quantile)


def test_t_quantile_matches_tables():
    # two-sided 95% critical values from any t table
    for df, want in ((1, 12.7062), (4, 2.7764), (9, 2.2622), (30, 2.0423)):
        assert t_quantile(0.975, df) == pytest.approx(want, abs=2e-4)
    assert t_quantile(0.025, 9) == pytest.approx(-2.2622, abs=2e-4)
    # the far tail at df=1 (Cauchy: tan(pi (p - 1/2))), where the integrated density used to drift
    for p in (0.999, 0.9999, 0.99999):
        assert t_quantile(p, 1) == pytest.approx(np.tan(np.pi * (p - 0.5)), rel=1e-8)
    assert t_quantile(0.5, 3) == 0.0


@pytest.mark.parametrize("bad", [1, -1, 2.5, "x", None])
def test_bad_group_counts_are_refused_by_name(bad):
    with pytest.raises(StatsError, match="resample_groups"):
        check_groups(bad)


def test_more_groups_than_sequences_is_refused():
    assert check_groups(0) == 0 and check_groups(5, n_sequences=5) == 5
    with pytest.raises(StatsError, match="more than the 4 sequences"):
        check_groups(5, n_sequences=4)


def test_groups_follow_the_conversation_and_are_balanced():
    assert conversation_key("abc_3") == "abc" and conversation_key("abc") == "abc"
    order = [f"conv{i}_0" for i in range(23)] + ["conv3_1"]
    a = GroupAssigner(5, order)
    assert a.group("conv3_0") == a.group("conv3_1") == 3
    counts = np.bincount([a.group(e) for e in order[:23]], minlength=5)
    assert counts.max() - counts.min() <= 1
    # without a corpus order, first appearance decides; a batch gets one group per row
    b = GroupAssigner(5)
    g = b.row_groups(["x_0", "y_0", "x_1"], (3, 4))
    assert g.shape == (3, 4) and g[:, 0].tolist() == [0, 1, 0]
    with pytest.raises(StatsError, match="2 example ids for a batch of 3"):
        b.row_groups(["x_0", "y_0"], (3, 4))


def test_grouped_moments_leave_one_out_equals_numpy():
    rng = np.random.default_rng(0)
    n, d, G = 300, 6, 4
    a = rng.normal(size=(n, d)) * 3 + 50  # large mean: the shift must keep precision
    b = rng.normal(size=(n, d))
    g = rng.integers(0, G, size=n)
    acc = GroupedLayerMoments([0, 1], d, G)
    for chunk in np.array_split(np.arange(n), 3):
        acc.update([torch.tensor(a[chunk]), torch.tensor(b[chunk])], torch.tensor(g[chunk]))
    assert list(acc.group_sizes) == list(np.bincount(g, minlength=G))
    for grp in range(G):
        keep = g != grp
        np.testing.assert_allclose(acc.covariance(0, drop_group=grp).numpy(), np.cov(a[keep].T), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(acc.covariance(1, drop_group=grp).numpy(), np.cov(b[keep].T), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(acc.covariance(0).numpy(), np.cov(a.T), rtol=1e-10)
    # merge of two halves, and a state-dict round trip, give the same sums
    h1, h2 = GroupedLayerMoments([0, 1], d, G), GroupedLayerMoments([0, 1], d, G)
    h1.update([torch.tensor(a[:100]), torch.tensor(b[:100])], torch.tensor(g[:100]))
    h2.update([torch.tensor(a[100:] - 7), torch.tensor(b[100:])], torch.tensor(g[100:]))  # other shift
    h2._shift[0] += 7
    h1.merge(GroupedLayerMoments.from_state_dict(h2.state_dict()))
    np.testing.assert_allclose(h1.covariance(0, drop_group=2).numpy(), np.cov(a[g != 2].T), rtol=1e-9, atol=1e-9)


def test_grouped_moments_refuse_bad_group_ids():
    acc = GroupedLayerMoments([0], 3, 2)
    with pytest.raises(StatsError, match="group ids must be in 0..1"):
        acc.update([torch.zeros(4, 3)], torch.tensor([0, 1, 2, 0]))
    assert acc.n == 0


def test_grouped_hsic_equals_unbiased_hsic_without_each_group():
    rng = np.random.default_rng(1)
    n, G = 40, 5
    xs = [torch.tensor(rng.normal(size=(n, 7))), torch.tensor(rng.normal(size=(n, 3)))]
    xs.append(xs[0][:, :4] + 0.3 * torch.tensor(rng.normal(size=(n, 4))))
    groups = torch.tensor(rng.integers(0, G, size=n))
    H, H_wo = grouped_unbiased_hsic(xs, groups, G)

    def ref(rows):
        mb = MinibatchCKA([0, 1, 2], gram_dtype=torch.float64)
        mb.update(rows)
        return mb.hsic()

    np.testing.assert_allclose(H.numpy(), ref(xs), rtol=1e-9, atol=1e-12)
    for g in range(G):
        keep = groups != g
        np.testing.assert_allclose(H_wo[g].numpy(), ref([x[keep] for x in xs]), rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# coverage on synthetic sequences: rows of a sequence share a random offset, so tokens are not
# independent and only a sequence-level resampling gets the spread right.
D, T_SEQ = 3, 20
_rng0 = np.random.default_rng(123)
_B = np.diag([1.0, 0.6, 0.3])  # between-sequence covariance
_W = np.diag([1.0, 0.7, 0.2])  # within-sequence covariance
_MIX = _rng0.normal(size=(D, D))


def _sample(rng, n_seq):
    offs = rng.normal(size=(n_seq, 1, D)) @ np.sqrt(_B)
    x = offs + rng.normal(size=(n_seq, T_SEQ, D)) @ np.sqrt(_W)
    y = x @ _MIX + rng.normal(size=(n_seq, T_SEQ, D))  # a second "layer", linearly related
    return x.reshape(-1, D), y.reshape(-1, D)


def _true_values():
    sxx = _B + _W
    syy = _MIX.T @ sxx @ _MIX + np.eye(D)
    sxy = sxx @ _MIX
    ent = renyi_entropy(np.linalg.eigvalsh(sxx), 1.0)
    cka = np.sum(sxy**2) / (np.linalg.norm(sxx) * np.linalg.norm(syy))
    return ent, cka


def _intervals(rng, n_seq, G, token_groups=False):
    x, y = _sample(rng, n_seq)
    seq = np.repeat(np.arange(n_seq), T_SEQ)
    g = rng.integers(0, G, size=len(seq)) if token_groups else seq % G
    gt = torch.tensor(g)
    acc = GroupedLayerMoments([0], D, G)
    acc.update([torch.tensor(x)], gt)
    ent = renyi_entropy(np.linalg.eigvalsh(acc.covariance(0).numpy()), 1.0)
    reps = [renyi_entropy(np.linalg.eigvalsh(acc.covariance(0, drop_group=k).numpy()), 1.0) for k in range(G)]
    ent_jk = jackknife(ent, reps)
    mb = MinibatchCKA([0, 1], n_groups=G, gram_dtype=torch.float64)
    perm = rng.permutation(len(seq))
    for chunk in np.array_split(perm, len(perm) // 200):
        mb.update([torch.tensor(x[chunk]), torch.tensor(y[chunk])], groups=gt[chunk])
    cka_jk = jackknife(mb.result()[0, 1], mb.replicates()[:, 0, 1])
    return ent_jk, cka_jk


def _coverage(reps, token_groups=False, n_seq=150, G=10):
    rng = np.random.default_rng(7)
    ent_true, cka_true = _true_values()
    hits = np.zeros(2)
    for _ in range(reps):
        e, c = _intervals(rng, n_seq, G, token_groups)
        hits += [e.low <= ent_true <= e.high, c.low <= cka_true <= c.high]
    return hits / reps


def test_nominal_95_intervals_cover_the_true_values():
    ent_cov, cka_cov = _coverage(300)
    assert 0.90 <= ent_cov <= 0.99, ent_cov
    assert 0.90 <= cka_cov <= 0.99, cka_cov


def test_token_level_groups_would_undercover():
    # the same test fails for an estimator that ignores the sequence structure
    ent_cov, cka_cov = _coverage(150, token_groups=True)
    assert ent_cov < 0.85 and cka_cov < 0.85, (ent_cov, cka_cov)


def test_intervals_shrink_with_more_tokens():
    rng = np.random.default_rng(3)
    small = np.mean([_intervals(rng, 60, 10)[0].se for _ in range(20)])
    large = np.mean([_intervals(rng, 960, 10)[0].se for _ in range(20)])
    assert large < small / 2.5  # 16x the sequences: ~4x narrower
