import math

import pytest
import torch

from wavesurf.stats.filtering import FilterError, FilterState, TokenFilter


@pytest.mark.parametrize("spec, kind, value", [
    (None, "none", 0.0), ("none", "none", 0.0), ("q0.5", "quantile", 0.5), ("quantile:0.8", "quantile", 0.8),
    ("1.5nats", "nats", 1.5), ("nats:2", "nats", 2.0), ("0", "nats", 0.0),
])
def test_parse(spec, kind, value):
    f = TokenFilter.parse(spec)
    assert (f.kind, f.value) == (kind, value)


@pytest.mark.parametrize("spec", ["q1.5", "q1", "abc", "-1nats", "q", "nats:x"])
def test_parse_errors_list_allowed(spec):
    with pytest.raises(FilterError) as err:
        TokenFilter.parse(spec)
    assert repr(spec) in str(err.value) and "'q0.5'" in str(err.value)


def test_threshold_filter_and_same_size_random_control():
    H = torch.tensor([[0.1, 2.0, 3.0, 0.5], [4.0, 0.2, 1.0, 0.0]])
    cand = torch.tensor([[False, True, True, True], [True, True, True, False]])
    state = FilterState(TokenFilter.parse("1.0nats"), seed=3)
    kept, control = state.masks(cand, H, batch_index=0)
    assert kept.tolist() == [[False, True, True, False], [True, False, True, False]]
    assert int(control.sum()) == int(kept.sum()) == 4
    assert not (control & ~cand).any()
    again = FilterState(TokenFilter.parse("1.0nats"), seed=3).masks(cand, H, 0)[1]
    assert torch.equal(control, again)  # deterministic for a seed
    others = {tuple(FilterState(TokenFilter.parse("1.0nats"), seed=s).masks(cand, H, 0)[1].flatten().tolist())
              for s in range(12)}
    assert len(others) > 1  # but random across seeds
    assert state.summary()["kept_fraction"] == pytest.approx(4 / 6)


def test_quantile_threshold_from_pilot():
    state = FilterState(TokenFilter.parse("q0.75"))
    assert state.threshold is None
    with pytest.raises(RuntimeError, match="pilot"):
        state.masks(torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4), 0)
    state.set_threshold_from(torch.arange(101, dtype=torch.float32))
    assert state.threshold == pytest.approx(75.0)
    none = FilterState(TokenFilter.parse("none"))
    kept, control = none.masks(torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 3), 0)
    assert kept.all() and control is None and none.threshold == -math.inf


def test_role_counts_of_candidates_and_kept_positions():
    """The roles of kept positions (which roles a filter keeps) equal a brute-force count."""
    from wavesurf.data import ROLE_NAMES
    from wavesurf.stats.filtering import role_shares

    gen = torch.Generator().manual_seed(0)
    H = torch.rand(3, 50, generator=gen) * 4
    cand = torch.rand(3, 50, generator=gen) > 0.2
    roles = torch.randint(0, 4, (3, 50), generator=gen, dtype=torch.int8)
    state = FilterState(TokenFilter.parse("2.0nats"))
    kept, _ = state.masks(cand, H, 0, roles)
    state.masks(cand, H, 1, roles)  # a second batch adds to the counts
    summary = state.summary()
    for which, mask in (("candidate_roles", cand), ("kept_roles", kept)):
        want = {ROLE_NAMES[r]: 2 * int((mask & (roles == r)).sum()) for r in range(4)}
        assert summary[which] == {k: v for k, v in want.items() if v}
    assert sum(summary["kept_roles"].values()) == summary["kept_tokens"]
    shares = role_shares(summary)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert role_shares({"kept_tokens": 3}) is None  # a result cached before roles were counted
