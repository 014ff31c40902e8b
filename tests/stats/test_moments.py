"""LayerMoments: streaming float64 moments equal brute-force numpy on hard data (large means, huge dims)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.stats.synthetic import hard_layers as _hard_layers
from wavesurf.errors import StatsError
from wavesurf.stats import LayerMoments

LAYERS = [0, 3, 7]
D = 24


def hard_layers(n, layer_ids=LAYERS, seed=0):
    return _hard_layers(n, layer_ids, D, seed, noise_step=0.2, anisotropic=False)


def brute_cov(x: np.ndarray, y: np.ndarray | None = None) -> np.ndarray:
    """Two-pass centred float64 covariance (ddof=1), the reference."""
    y = x if y is None else y
    xc, yc = x - x.mean(0), y - y.mean(0)
    return xc.T @ yc / (x.shape[0] - 1)


def scaled_err(C: np.ndarray, R: np.ndarray, Rii: np.ndarray, Rjj: np.ndarray) -> float:
    """Max |C - R| relative to each entry's natural scale sqrt(var_i var_j)."""
    return float(np.max(np.abs(C - R) / np.sqrt(np.outer(np.diag(Rii), np.diag(Rjj)))))


def feed(acc: LayerMoments, data: dict[int, np.ndarray], sizes, seed: int = 1, dtype=torch.float64):
    """Feed rows in batches of the given sizes, alternating [B,T,d]+mask and [n,d] forms.

    Returns the indices of the rows that were selected, in order."""
    rng = np.random.default_rng(seed)
    kept = []
    start = 0
    for b, size in enumerate(sizes):
        idx = np.arange(start, start + size)
        start += size
        if b % 2 == 0:  # [B, T, d] with a mask
            T = 4 if size % 4 == 0 else 1
            mask = rng.random(size) < 0.7
            states = {lid: torch.tensor(x[idx], dtype=dtype).reshape(size // T, T, -1) for lid, x in data.items()}
            acc.update(states, mask=torch.tensor(mask).reshape(size // T, T))
            kept.append(idx[mask])
        else:  # list form, all rows
            acc.update([torch.tensor(data[lid][idx], dtype=dtype) for lid in acc.layer_ids])
            kept.append(idx)
    return np.concatenate(kept)


SIZES = [400, 1000, 300, 1600, 700]


@pytest.mark.parametrize("panels", [None, 1, 2])
def test_streaming_covariance_matches_bruteforce(panels):
    data = hard_layers(sum(SIZES))
    acc = LayerMoments(LAYERS, D, pairs=True, gemm_panels=panels)
    kept = feed(acc, data, SIZES)
    assert acc.n == len(kept)
    ref = {lid: x[kept] for lid, x in data.items()}
    refcov = {lid: brute_cov(ref[lid]) for lid in LAYERS}
    for a in LAYERS:
        np.testing.assert_allclose(acc.mean(a).numpy(), ref[a].mean(0), rtol=1e-12)
        for b in LAYERS:
            C = acc.covariance(a, b).numpy()
            R = brute_cov(ref[a], ref[b])
            assert scaled_err(C, R, refcov[a], refcov[b]) < 1e-8, (a, b)
    C = acc.covariance(7).numpy()
    np.testing.assert_array_equal(C, C.T)


def test_naive_unshifted_accumulation_would_fail_the_same_check():
    """The data is hard enough: the textbook S/n - m m^T formula in float64 misses 1e-8."""
    data = hard_layers(sum(SIZES))
    x = data[7]
    n = x.shape[0]
    naive = (x.T @ x - n * np.outer(x.mean(0), x.mean(0))) / (n - 1)
    R = brute_cov(x)
    assert scaled_err(naive, R, R, R) > 1e-8


def test_empty_selection_is_ignored_and_float32_inputs():
    data = hard_layers(1200)
    data32 = {k: v.astype(np.float32).astype(np.float64) for k, v in data.items()}
    acc = LayerMoments(LAYERS, D)
    acc.update({lid: torch.tensor(x[:10], dtype=torch.float32) for lid, x in data.items()},
               mask=torch.zeros(10, dtype=torch.bool))
    assert acc.n == 0 and acc.n_batches == 1
    acc.update({lid: torch.tensor(x, dtype=torch.float32) for lid, x in data.items()})
    R = brute_cov(data32[3], data32[7])
    assert scaled_err(acc.covariance(3, 7).numpy(), R, brute_cov(data32[3]), brute_cov(data32[7])) < 1e-8


def test_pairs_false_matches_bruteforce_and_refuses_cross_covariance():
    data = hard_layers(sum(SIZES), seed=3)
    acc = LayerMoments(LAYERS, D, pairs=False)
    kept = feed(acc, data, SIZES)
    for lid in LAYERS:
        R = brute_cov(data[lid][kept])
        assert scaled_err(acc.covariance(lid).numpy(), R, R, R) < 1e-8
    assert acc.covariance(3, 3).shape == (D, D)
    with pytest.raises(StatsError, match="pairs=True"):
        acc.covariance(0, 3)


@pytest.mark.parametrize("pairs", [True, False])
def test_merge_equals_single_accumulator(pairs):
    data = hard_layers(sum(SIZES), seed=5)
    data = {k: v + (50.0 * (np.arange(len(v)) >= 1400))[:, None] for k, v in data.items()}  # halves differ
    meta = {"model": "m"}
    single = LayerMoments(LAYERS, D, pairs=pairs, meta=meta)
    kept = feed(single, data, SIZES)
    # two workers see the same batches split in halves (different first batches, hence shifts)
    a = LayerMoments(LAYERS, D, pairs=pairs, meta=meta)
    b = LayerMoments(LAYERS, D, pairs=pairs, meta=meta)
    ka = feed(a, {k: v[:1400] for k, v in data.items()}, SIZES[:2])
    kb = feed(b, {k: v[1400:] for k, v in data.items()}, SIZES[2:], seed=9)
    merged = LayerMoments(LAYERS, D, pairs=pairs, meta=meta)
    merged.merge(a)  # into an empty accumulator
    merged += b
    rows = np.concatenate([ka, kb + 1400])
    assert merged.n == len(rows) and merged.n_batches == len(SIZES)
    for i in LAYERS:
        for j in (LAYERS if pairs else [i]):
            R = brute_cov(data[i][rows], data[j][rows])
            Ri, Rj = brute_cov(data[i][rows]), brute_cov(data[j][rows])
            assert scaled_err(merged.covariance(i, j).numpy(), R, Ri, Rj) < 1e-8
        np.testing.assert_allclose(merged.mean(i).numpy(), data[i][rows].mean(0), rtol=1e-12)
    # same rows (masks drawn with the same seeds) -> merged equals the single pass
    single2 = LayerMoments(LAYERS, D, pairs=pairs, meta=meta)
    feed(single2, {k: v[:1400] for k, v in data.items()}, SIZES[:2])
    feed(single2, {k: v[1400:] for k, v in data.items()}, SIZES[2:], seed=9)
    for i in LAYERS:
        R = single2.covariance(i).numpy()
        assert scaled_err(merged.covariance(i).numpy(), R, R, R) < 1e-10
    assert single.n == len(kept)


def test_merge_refuses_mismatches_and_lists_keys():
    base = LayerMoments([1, 2], 8, meta={"model": "a", "roles": "all"})
    with pytest.raises(StatsError, match=r"layer_ids"):
        base.merge(LayerMoments([1, 3], 8, meta={"model": "a", "roles": "all"}))
    with pytest.raises(StatsError, match=r"dim \(8 vs 4\)"):
        base.merge(LayerMoments([1, 2], 4, meta={"model": "a", "roles": "all"}))
    with pytest.raises(StatsError, match="pairs"):
        base.merge(LayerMoments([1, 2], 8, pairs=False, meta={"model": "a", "roles": "all"}))
    with pytest.raises(StatsError, match="l2_normalize"):
        base.merge(LayerMoments([1, 2], 8, l2_normalize=True, meta={"model": "a", "roles": "all"}))
    with pytest.raises(StatsError, match=r"meta\['model'\].*meta\['roles'\]"):
        base.merge(LayerMoments([1, 2], 8, meta={"model": "b"}))


def test_l2_normalize_matches_bruteforce():
    data = hard_layers(sum(SIZES), seed=7)
    acc = LayerMoments(LAYERS, D, l2_normalize=True)
    kept = feed(acc, data, SIZES)
    for a in LAYERS:
        xa = data[a][kept]
        xa = xa / np.linalg.norm(xa, axis=1, keepdims=True)
        for b in LAYERS:
            xb = data[b][kept]
            xb = xb / np.linalg.norm(xb, axis=1, keepdims=True)
            R = brute_cov(xa, xb)
            assert scaled_err(acc.covariance(a, b).numpy(), R, brute_cov(xa), brute_cov(xb)) < 1e-8
        np.testing.assert_allclose(acc.mean(a).numpy(), xa.mean(0), rtol=1e-12)


def test_nonfinite_values_name_layer_and_batch():
    data = hard_layers(300, layer_ids=[2, 7], seed=11)
    acc = LayerMoments([2, 7], D)
    acc.update({k: torch.tensor(v[:100]) for k, v in data.items()})
    acc.update({k: torch.tensor(v[100:200]) for k, v in data.items()})
    bad = {k: torch.tensor(v[200:]) for k, v in data.items()}
    bad[7][5, 3] = float("nan")
    bad[7][9, 0] = float("inf")
    with pytest.raises(StatsError, match="layer 7 in batch 3 has 2 non-finite values"):
        acc.update(bad)
    assert acc.n == 200  # nothing accumulated from the bad batch
    # non-finite values in rows the mask drops are fine
    mask = torch.ones(100, dtype=torch.bool)
    mask[[5, 9]] = False
    acc.update(bad, mask=mask)
    assert acc.n == 298


def test_bad_inputs():
    acc = LayerMoments([1, 2], 8)
    with pytest.raises(StatsError, match="lack layer ids"):
        acc.update({1: torch.zeros(4, 8)})
    with pytest.raises(StatsError, match="expected dim=8"):
        acc.update({1: torch.zeros(4, 8), 2: torch.zeros(4, 5)})
    with pytest.raises(StatsError, match="mask shape"):
        acc.update({1: torch.zeros(4, 8), 2: torch.zeros(4, 8)}, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(StatsError, match="not accumulated"):
        acc.covariance(5)
    with pytest.raises(StatsError, match="rows"):
        acc.covariance(1)  # nothing accumulated yet
    with pytest.raises(StatsError, match="duplicates"):
        LayerMoments([1, 1], 8)


def test_state_dict_roundtrip_npz(tmp_path):
    data = hard_layers(900, seed=13)
    acc = LayerMoments(LAYERS, D, meta={"model": "x", "filter": None})
    feed(acc, data, [300, 600])
    path = tmp_path / "m.npz"
    acc.save_npz(str(path))
    back = LayerMoments.load_npz(str(path))
    assert back.config() == acc.config() and back.n == acc.n and back.n_batches == acc.n_batches
    for a in LAYERS:
        for b in LAYERS:
            np.testing.assert_array_equal(back.covariance(a, b).numpy(), acc.covariance(a, b).numpy())
    # a restored accumulator keeps accumulating and merging
    back.merge(acc)
    assert back.n == 2 * acc.n
    n = acc.n  # every row twice: scatter doubles, ddof=1 divides by 2n-1
    expect = acc.covariance(0, 7).numpy() * 2 * (n - 1) / (2 * n - 1)
    R = acc.covariance(0).numpy(), acc.covariance(7).numpy()
    assert scaled_err(back.covariance(0, 7).numpy(), expect, *R) < 1e-10


def test_masked_group_ids_follow_gather_layer_rows_order():
    # the group id of every selected row must sit beside that row, as gather_layer_rows orders them
    from wavesurf.stats.moments import gather_layer_rows, masked_group_ids

    gen = torch.Generator().manual_seed(0)
    states = {3: torch.arange(2 * 5, dtype=torch.float32).reshape(2, 5, 1)}
    groups = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]) * 10 + torch.arange(5)
    mask = torch.rand(2, 5, generator=gen) > 0.4
    rows = gather_layer_rows(states, [3], mask)[0][:, 0]
    ids = masked_group_ids(groups, mask)
    assert ids.tolist() == [int(g) for g in groups[mask]]
    # row value b*5+t pairs with id b*10+t
    assert [int(r) // 5 * 10 + int(r) % 5 for r in rows] == ids.tolist()
    assert masked_group_ids(groups).tolist() == groups.reshape(-1).tolist()
    assert masked_group_ids(groups, mask, "cpu").device.type == "cpu"
