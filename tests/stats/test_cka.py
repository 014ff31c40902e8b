"""Linear CKA: exact from moments vs brute force, invariances, unbiased minibatch CKA, shuffler."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from tests.stats.synthetic import fill as _fill
from tests.stats.synthetic import hard_layers as _hard_layers
from wavesurf.errors import StatsError
from wavesurf.stats import (
    DEFAULT_MEMORY_BUDGET,
    MinibatchCKA,
    TokenShuffler,
    choose_cka_estimator,
    cka_to_last,
    linear_cka,
    linear_cka_from_moments,
    neighbour_cka,
)
import wavesurf.stats.cka as cka_mod

D = 16


def hard_layers(n, n_layers=4, seed=0):
    return _hard_layers(n, [10 + k for k in range(n_layers)], D, seed, noise_step=0.4)


def fill(data, sizes=(700, 1300, 1000), **kw):
    return _fill(data, sizes, **kw)



def random_rotation(d: int, seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def test_cka_from_moments_matches_bruteforce_all_pairs():
    data = hard_layers(3000)
    acc = fill(data)
    K = linear_cka_from_moments(acc)
    ids = list(data)
    ref = np.array([[linear_cka(data[a], data[b]) for b in ids] for a in ids])
    assert np.max(np.abs(K - ref)) < 1e-9
    np.testing.assert_allclose(np.diag(K), 1.0, atol=1e-14)
    np.testing.assert_array_equal(K, K.T)
    off = K[~np.eye(4, dtype=bool)]
    assert 0.01 < off.min() and off.max() < 0.99  # non-trivial values
    np.testing.assert_allclose(neighbour_cka(K), [K[0, 1], K[1, 2], K[2, 3]])
    np.testing.assert_allclose(cka_to_last(K), K[:, 3])
    with pytest.raises(StatsError, match="pairs=True"):
        linear_cka_from_moments(fill(data, pairs=False))


def test_cka_strips_and_panels_agree(monkeypatch):
    data = hard_layers(1500, n_layers=5, seed=1)
    full = linear_cka_from_moments(fill(data, sizes=(1500,), gemm_panels=1))
    acc = fill(data, sizes=(1500,), gemm_panels=5)
    np.testing.assert_allclose(linear_cka_from_moments(acc), full, atol=1e-12)
    monkeypatch.setattr(cka_mod, "_STRIP_ELEMENTS", 2 * D * 5 * D)  # strips of 2 layers
    np.testing.assert_allclose(linear_cka_from_moments(acc), full, atol=1e-12)


def test_cka_identity_rotation_and_scale_invariance():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4000, D)) * np.linspace(0.1, 3, D) + 5.0
    z = x @ rng.standard_normal((D, D)) + rng.standard_normal((4000, D))
    y = 3.7 * x @ random_rotation(D, 3) - 11.0
    data = {0: x, 1: y, 2: z}
    K = linear_cka_from_moments(fill(data, sizes=(4000,)))
    assert K[0, 1] == pytest.approx(1.0, abs=1e-12)
    assert K[0, 2] == pytest.approx(K[1, 2], abs=1e-12)
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-14)
    assert linear_cka(x, y) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(x, z) == pytest.approx(linear_cka(z, x), abs=1e-14)
    assert linear_cka(x, z) == pytest.approx(K[0, 2], abs=1e-10)
    # Gram form (n < d) agrees with the feature form
    w = rng.standard_normal((30, 50))
    v = w @ rng.standard_normal((50, 60))
    wc, vc = w - w.mean(0), v - v.mean(0)
    feat = np.linalg.norm(vc.T @ wc) ** 2 / (np.linalg.norm(wc.T @ wc) * np.linalg.norm(vc.T @ vc))
    assert linear_cka(w, v) == pytest.approx(feat, rel=1e-10)


# ----------------------------------------------------------------- minibatch CKA
def song_unbiased_hsic(K: np.ndarray, L: np.ndarray) -> float:
    """Song et al. 2012 unbiased HSIC, written out independently."""
    n = K.shape[0]
    K, L = K.copy(), L.copy()
    np.fill_diagonal(K, 0)
    np.fill_diagonal(L, 0)
    one = np.ones(n)
    t1 = np.trace(K @ L)
    t2 = (one @ K @ one) * (one @ L @ one) / ((n - 1) * (n - 2))
    t3 = 2 * (one @ K @ L @ one) / (n - 2)
    return (t1 + t2 - t3) / (n * (n - 3))


def test_minibatch_single_batch_equals_song_formula(monkeypatch):
    rng = np.random.default_rng(4)
    base = rng.standard_normal((50, 12))
    X = {k: base @ rng.standard_normal((12, 12)) + rng.standard_normal((50, 12)) * k + 2.0 for k in (1, 2, 3)}
    ids = list(X)
    mb = MinibatchCKA(ids)
    mb.update({k: torch.tensor(v) for k, v in X.items()})
    H = np.array([[song_unbiased_hsic(X[a] @ X[a].T, X[b] @ X[b].T) for b in ids] for a in ids])
    np.testing.assert_allclose(mb.hsic(), H, rtol=1e-9, atol=1e-12 * np.abs(H).max())
    ref = H / np.sqrt(np.outer(np.diag(H), np.diag(H)))
    np.testing.assert_allclose(mb.result(), ref, rtol=1e-9)
    # chunked Gram rows give the same result
    monkeypatch.setattr(cka_mod, "_GRAM_CHUNK_ELEMENTS", 3 * 50 * 7)
    mb2 = MinibatchCKA(ids)
    mb2.update({k: torch.tensor(v) for k, v in X.items()})
    np.testing.assert_allclose(mb2.result(), mb.result(), rtol=1e-12)


def test_minibatch_close_to_exact_on_large_n():
    data = hard_layers(20000, n_layers=3, seed=5)
    for v in data.values():
        v[:, :3] /= 1e3  # no dominant dims here, so CKA values are mid-range
    exact = linear_cka_from_moments(fill(data, sizes=(20000,)))
    mb = MinibatchCKA(list(data))
    for s in range(0, 20000, 500):
        mb.update({k: torch.tensor(v[s : s + 500]) for k, v in data.items()})
    assert mb.n == 20000 and mb.n_batches == 40
    assert 0.3 < exact[0, 1] < 0.7
    assert np.max(np.abs(mb.result() - exact)) < 0.02


def test_minibatch_unbiased_near_zero_where_biased_is_not():
    rng = np.random.default_rng(6)
    n, d, batches = 64, 256, 30
    mb = MinibatchCKA([0, 1])
    biased = []
    for _ in range(batches):
        x, y = rng.standard_normal((n, d)), rng.standard_normal((n, d))
        biased.append(linear_cka(x, y))
        mb.update([torch.tensor(x), torch.tensor(y)])
    assert np.mean(biased) > 0.5
    assert abs(mb.result()[0, 1]) < 0.05


def test_minibatch_errors_merge_and_state_dict(tmp_path):
    mb = MinibatchCKA([3, 5], meta={"model": "a"})
    with pytest.raises(StatsError, match="at least 4 tokens"):
        mb.update([torch.zeros(3, 8), torch.zeros(3, 8)])
    with pytest.raises(StatsError, match="no minibatches"):
        mb.result()
    bad = torch.randn(10, 8)
    bad[2, 2] = float("nan")
    with pytest.raises(StatsError, match="layer 5 in batch 1 has 1 non-finite"):
        mb.update({3: torch.randn(10, 8), 5: bad})
    data = hard_layers(1200, n_layers=2, seed=7)
    ids = list(data)
    whole, a, b = (MinibatchCKA(ids, meta={"model": "a"}) for _ in range(3))
    for i, s in enumerate(range(0, 1200, 200)):
        batch = {k: torch.tensor(v[s : s + 200]) for k, v in data.items()}
        whole.update(batch)
        (a if i % 2 else b).update(batch)
    a += b
    np.testing.assert_allclose(a.result(), whole.result(), rtol=1e-12)
    with pytest.raises(StatsError, match=r"meta\['model'\]"):
        a.merge(MinibatchCKA(ids, meta={"model": "b"}))
    with pytest.raises(StatsError, match="layer_ids"):
        a.merge(MinibatchCKA([1, 2], meta={"model": "a"}))
    np.savez(tmp_path / "mb.npz", **a.state_dict())
    with np.load(tmp_path / "mb.npz") as z:
        back = MinibatchCKA.from_state_dict({k: z[k] for k in z.files})
    np.testing.assert_array_equal(back.result(), a.result())
    assert back.n == 1200 and back.n_batches == 6


# ----------------------------------------------------------------- shuffler, estimator choice
def test_token_shuffler_tensor_rows():
    rows = torch.arange(1000, dtype=torch.float32)[:, None, None].expand(1000, 3, 2).contiguous()
    def run(seed):
        sh = TokenShuffler(buffer_tokens=256, batch_size=64, seed=seed)
        out = []
        for s in range(0, 1000, 130):
            out += list(sh.add(rows[s : s + 130]))
        out += list(sh.flush())
        return out, sh
    out, sh = run(0)
    assert all(b.shape == (64, 3, 2) for b in out)
    ids = torch.cat([b[:, 0, 0] for b in out]).long()
    assert len(ids) == 15 * 64 and sh.dropped == 1000 - 15 * 64
    assert len(set(ids.tolist())) == len(ids)  # no row twice
    assert not torch.equal(ids, torch.sort(ids).values)  # shuffled
    # rows from far apart in the stream share a batch
    assert (out[0][:, 0, 0].max() - out[0][:, 0, 0].min()) > 128
    out2, _ = run(0)
    assert all(torch.equal(p, q) for p, q in zip(out, out2))
    out3, _ = run(1)
    assert not torch.equal(out[0], out3[0])


def test_token_shuffler_dict_rows_stay_aligned():
    sh = TokenShuffler(buffer_tokens=100, batch_size=32, seed=3)
    got = []
    for s in range(0, 300, 50):
        r = torch.arange(s, s + 50, dtype=torch.float64)[:, None]
        got += list(sh.add({2: r.expand(50, 4) * 1.0, 7: r.expand(50, 6) * -1.0}))
    got += list(sh.flush())
    for b in got:
        assert set(b) == {2, 7} and b[2].shape == (32, 4) and b[7].shape == (32, 6)
        torch.testing.assert_close(b[2][:, 0], -b[7][:, 0])
    with pytest.raises(StatsError, match="buffer_tokens"):
        TokenShuffler(buffer_tokens=8, batch_size=16)


def test_choose_cka_estimator():
    assert DEFAULT_MEMORY_BUDGET == 8 * 2**30
    assert choose_cka_estimator(31, 576) == "exact"  # 2.55 GB x 1.5
    assert choose_cka_estimator(33, 4096) == "minibatch"  # Llama-8B: 146 GB
    need = 1.5 * 8 * (31 * 576) ** 2
    assert choose_cka_estimator(31, 576, int(need)) == "exact"
    assert choose_cka_estimator(31, 576, int(need) - 1) == "minibatch"
    with pytest.raises(StatsError):
        choose_cka_estimator(0, 576)
