"""The ridge probe (wavesurf.stats.probe) against float64 brute force: explicit data matrices,
explicit ridge solves, explicit held-out errors."""
import itertools

import numpy as np
import pytest

from wavesurf.errors import StatsError
from wavesurf.stats.probe import (ProbeAccumulator, ProbeMoments, ProbeSettings, check_ridge, is_heldout,
                                  probe_layer_sets, probe_sets, score_layer_sets)


def _brute_r2(z, y, held, cols, lam):
    """Ridge on centred training rows (penalty lam on moments divided by n), scored on held-out rows."""
    zt, yt, zh, yh = z[~held][:, cols], y[~held], z[held][:, cols], y[held]
    mz, my = zt.mean(0), yt.mean(0)
    n = len(zt)
    B = np.linalg.solve((zt - mz).T @ (zt - mz) / n + lam * np.eye(len(cols)), (zt - mz).T @ (yt - my) / n)
    pred = (zh - mz) @ B + my
    sse = ((yh - pred) ** 2).sum(0)
    sst = ((yh - yh.mean(0)) ** 2).sum(0)
    return float(np.mean(1 - sse / sst)), float(1 - sse.sum() / sst.sum()), pred


@pytest.fixture(scope="module")
def synthetic():
    rng = np.random.default_rng(0)
    n_layers, r, re, d, n = 4, 3, 2, 5, 400
    P = (n_layers + 1) * r + re
    z = rng.normal(size=(n, P)) @ (np.eye(P) + 0.3 * rng.normal(size=(P, P))) + rng.normal(size=P)
    y = z @ rng.normal(size=(P, d)) * 0.5 + rng.normal(size=(n, d)) * np.array([0.5, 1, 2, 4, 8]) + 3.0
    held = rng.random(n) < 0.3
    m = ProbeMoments(n_layers, r, re, d)
    for part in np.array_split(np.arange(n), 7):  # streamed in pieces
        m.add(z[part], y[part], held[part], sample_cap=50)
    return m, z, y, held


@pytest.mark.parametrize("lam", [1e-3, 0.5])
def test_scores_match_brute_force_ridge_on_every_set(synthetic, lam):
    m, z, y, held = synthetic
    sets = np.array(list(itertools.combinations(range(5), 2)) + [(0, 4), (3, 4)])
    got = score_layer_sets(m, sets, lam)
    for row, r2, raw in zip(sets, got["r2"], got["r2_raw"]):
        want, want_raw, _ = _brute_r2(z, y, held, m.columns(row), lam)
        assert r2 == pytest.approx(want, abs=1e-9) and raw == pytest.approx(want_raw, abs=1e-9)
    single = score_layer_sets(m, [[2]], lam)  # k = 1, and one set given as a row
    assert single["r2"][0] == pytest.approx(_brute_r2(z, y, held, m.columns([2]), lam)[0], abs=1e-9)


def test_fit_predicts_like_brute_force_and_keeps_held_out_sample(synthetic):
    m, z, y, held = synthetic
    cols, B, b0 = m.fit([1, 3], 0.1)
    _, _, pred = _brute_r2(z, y, held, m.columns([1, 3]), 0.1)
    np.testing.assert_allclose(z[held][:, cols] @ B + b0, pred, atol=1e-9)
    assert len(m.sample_z) == 50
    np.testing.assert_allclose(m.sample_z, z[held][:50], rtol=1e-6)


def test_best_set_beats_a_set_without_signal():
    rng = np.random.default_rng(1)
    n_layers, r, d, n = 3, 2, 3, 3000
    z = rng.normal(size=(n, (n_layers + 1) * r + 2))
    y = z[:, 2 * r : 3 * r] @ rng.normal(size=(r, d)) + 0.1 * rng.normal(size=(n, d))  # only layer 2 tells
    m = ProbeMoments(n_layers, r, 2, d)
    m.add(z, y, rng.random(n) < 0.25)
    s = score_layer_sets(m, [[0], [1], [2], [3]], 1e-3)
    assert int(np.argmax(s["r2"])) == 2 and s["r2"][2] > 0.95 and max(np.delete(s["r2"], 2)) < 0.05


def test_bad_input_is_refused(synthetic, smollm):
    m = synthetic[0]
    for bad in (0, -1.0, float("nan"), "1", True):
        with pytest.raises(StatsError, match=r"ridge=.* must be a finite number > 0"):
            check_ridge(bad)
    with pytest.raises(StatsError, match=r"layer ids must lie in 0\.\.4"):
        score_layer_sets(m, [[0, 5]], 0.1)
    with pytest.raises(StatsError, match=r"k=32 is out of range: allowed are 1\.\.31"):
        probe_layer_sets(smollm, k=32)
    with pytest.raises(StatsError, match=r"ridge=0 must be"):
        probe_layer_sets(smollm, k=3, ridge=0)
    with pytest.raises(StatsError, match=r"dims=600 is out of range: allowed are 1\.\.576"):
        probe_layer_sets(smollm, k=3, dims=600)
    with pytest.raises(StatsError, match=r"heldout_every=1"):
        ProbeSettings(heldout_every=1).check(576)
    with pytest.raises(StatsError, match=r"sample=100 must be an integer >= 500"):
        probe_sets(30, 4, max_sets=10, sample=100)
    with pytest.raises(StatsError, match=r"include set \[1, 2\] must be 3"):
        probe_sets(30, 3, include=[[1, 2]])
    empty = ProbeMoments(2, 1, 1, 2)
    with pytest.raises(StatsError, match="needs training and held-out positions"):
        score_layer_sets(empty, [[0]], 0.1)


def test_probe_sets_all_or_a_seeded_sample():
    sets, over = probe_sets(30, 3)
    assert over == "all" and sets.shape == (4495, 3)
    a, over = probe_sets(30, 4, max_sets=1000, sample=500, include=[[2, 15, 27, 30]])
    b, _ = probe_sets(30, 4, max_sets=1000, sample=500, include=[[2, 15, 27, 30]])
    assert over == "sampled" and np.array_equal(a, b) and len(a) in (500, 501)
    assert [2, 15, 27, 30] in a.tolist() and len({tuple(r) for r in a.tolist()}) == len(a)


def test_accumulator_on_a_real_capture_matches_explicit_features(small_batches):
    """Features built by hand from the captured batches (stream at t, embedding and h_N at t+1,
    conversations held out by hash) give the same R² as the streamed moments."""
    settings = ProbeSettings(dims=4, embedding_dims=6, pilot_tokens=300, heldout_every=3, top1_positions=64)
    acc = ProbeAccumulator(30, 576, settings)
    for b in small_batches:
        acc.update(b)
    m = acc.result()
    zs, ys, hs = [], [], []
    for b in small_batches:
        rows, ts = np.nonzero((b.stat_mask("all")[:, :-1] & b.attention_mask[:, 1:]).numpy())
        feats = [(b.layer(i).double().numpy()[rows, ts] - acc.bases[i].mean) @ acc.bases[i].proj for i in range(31)]
        feats.append((b.layer(0).double().numpy()[rows, ts + 1] - acc.bases[-1].mean) @ acc.bases[-1].proj)
        zs.append(np.concatenate(feats, axis=1))
        ys.append(b.layer(30).double().numpy()[rows, ts + 1])
        hs += [is_heldout(b.example_ids[r], 3) for r in rows]
    z, y, held = np.concatenate(zs), np.concatenate(ys), np.array(hs)
    assert (m.n == [(~held).sum(), held.sum()]).all() and held.any() and (~held).any()
    got = score_layer_sets(m, [[2, 15, 27], [28, 29, 30]], 0.05)
    for k, ids in enumerate([[2, 15, 27], [28, 29, 30]]):
        want, want_raw, _ = _brute_r2(z, y, held, m.columns(ids), 0.05)
        assert got["r2"][k] == pytest.approx(want, abs=1e-7) and got["r2_raw"][k] == pytest.approx(want_raw, abs=1e-7)


def test_top_eigen_matches_a_full_decomposition():
    import torch

    from wavesurf.stats.probe import _top_eigen

    rng = np.random.default_rng(2)
    d = 80
    v = np.linalg.qr(rng.normal(size=(d, d)))[0]
    cov = (v * (0.8 ** np.arange(d))) @ v.T  # a decaying spectrum, like a residual stream's
    eig, vec = _top_eigen(torch.from_numpy(cov), 10)
    want = np.linalg.eigvalsh(cov)[::-1][:10]
    np.testing.assert_allclose(eig, want, rtol=1e-8)
    np.testing.assert_allclose(np.abs((vec * v[:, :10]).sum(0)), 1.0, atol=1e-6)  # same directions up to sign


def test_cache_entries_round_trip_and_refuse_damage(synthetic, tmp_path):
    from wavesurf.stats.probe import ProbeResult, load_moments, load_result, save_moments, save_result

    m = synthetic[0]
    m.key = "k1"
    save_moments(m, tmp_path / "m")
    back = load_moments(tmp_path / "m")
    sets = [[0, 1], [2, 4]]
    np.testing.assert_array_equal(score_layer_sets(back, sets, 0.1)["r2"], score_layer_sets(m, sets, 0.1)["r2"])
    r = ProbeResult("k2", 4, 2, 0.1, np.array(sets), np.array([0.2, 0.5]), np.array([0.3, 0.4]), "all", {(2, 4): 0.25})
    save_result(r, tmp_path / "r")
    again = load_result(tmp_path / "r")
    assert again.best(2) == [[2, 4], [0, 1]] and again.top1 == {(2, 4): 0.25} and again.rank([0, 1]) == 2
    assert (tmp_path / "r" / "probe.csv").read_text().splitlines()[1].startswith("1,2 4,0.5,0.4,0.25")
    (tmp_path / "r" / "probe.npz").write_bytes(b"x")
    with pytest.raises(StatsError, match="damaged"):
        load_result(tmp_path / "r")
    with pytest.raises(StatsError, match=r"layer set \[1, 3\] was not probed"):
        r.score([3, 1])
