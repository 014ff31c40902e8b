"""The layer sets the speed table trains: the default rule, each selection method's pick from
statistics without and with token-entropy filtering, and the controls.

All vLLM ids, k layers unless a control says otherwise:

* ``default`` — the EAGLE-3 rule ``[2, N//2, N-3]``;
* each selection method (``entropy``, ``aggregate``, ``cka``, ``combined``), from statistics
  without and with token-entropy filtering (``+filter``);
* controls: ``last-k`` (the top k ids), ``even-k`` (k ids evenly spaced over 1..N),
  ``last-1`` (the single top layer, EAGLE-1 style), and ``random-i`` sets drawn with a seed (the
  null every selected set is ranked in).

Identical sets are trained once and reported under every name that chose them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import WavesurfError
from ..models import default_layer_ids
from ..select import check_k, select_layers

SELECTION_METHODS = ("entropy", "aggregate", "cka", "combined")


@dataclass
class LayerSet:
    name: str
    group: str  # "default", "selected", "selected+filter" or "control"
    layer_ids: list[int]
    reason: str
    aliases: list[str] = field(default_factory=list)  # other names that chose the same ids

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evenly_spaced(n_layers: int, k: int) -> list[int]:
    """k ids spread evenly over 1..N, ending at N: ``round(N * (i + 1) / k)``."""
    return sorted({max(1, round(n_layers * (i + 1) / k)) for i in range(k)})


def random_sets(n_layers: int, k: int, n: int, seed: int, avoid: Sequence[Sequence[int]] = ()) -> list[list[int]]:
    """``n`` distinct random k-subsets of 1..N (seeded), none equal to a set in ``avoid``."""
    from math import comb

    if n > comb(n_layers, k) - len(avoid):
        raise WavesurfError(f"cannot draw {n} distinct random {k}-layer sets from {n_layers} layers")
    rng = np.random.default_rng(seed)
    seen = {tuple(sorted(a)) for a in avoid}
    out: list[list[int]] = []
    while len(out) < n:
        ids = tuple(sorted(int(i) for i in rng.choice(np.arange(1, n_layers + 1), size=k, replace=False)))
        if ids not in seen:
            seen.add(ids)
            out.append(list(ids))
    return out


def layer_sets(
    stats: Any,
    filtered_stats: Any | None = None,
    *,
    k: int = 3,
    methods: Sequence[str] = SELECTION_METHODS,
    n_random: int = 2,
    seed: int = 0,
) -> list[LayerSet]:
    """The layer sets of the speed table, from unfiltered ``stats`` and (optionally) statistics
    computed with a token-entropy filter. Duplicated id lists are merged (``aliases``)."""
    n = stats.n_layers
    k = check_k(k, n)
    methods = list(methods)
    candidates: list[LayerSet] = [
        LayerSet("default", "default", default_layer_ids(n), f"EAGLE-3 rule [2, N//2, N-3] for N={n}")
    ]
    for flt, st in (("", stats), ("+filter", filtered_stats)):
        if st is None:
            continue
        for method in methods:
            sel = select_layers(st, k=k, method=method)
            group = "selected" + flt
            filt = st.meta.get("filter", {}).get("filter", "?")
            candidates.append(LayerSet(method + flt, group, list(sel.layer_ids),
                                       f"{sel.reason} (filter {filt})" if flt else sel.reason))
    candidates += [
        LayerSet(f"last-{k}", "control", list(range(n - k + 1, n + 1)), f"the top {k} layer ids"),
        LayerSet(f"even-{k}", "control", evenly_spaced(n, k), f"{k} ids evenly spaced over 1..N"),
        LayerSet("last-1", "control", [n], "the single top layer (EAGLE-1 style)"),
    ]
    for i, ids in enumerate(random_sets(n, k, n_random, seed, [c.layer_ids for c in candidates])):
        candidates.append(LayerSet(f"random-{i + 1}", "control", ids, f"random {k}-subset of 1..N (seed {seed})"))
    merged: dict[tuple[int, ...], LayerSet] = {}
    for c in candidates:
        key = tuple(c.layer_ids)
        if key in merged:
            merged[key].aliases.append(c.name)
        else:
            merged[key] = c
    return list(merged.values())


# ---------------------------------------------------------------------------------------------
# running the experiment
def is_random_set(layer_set: LayerSet) -> bool:
    """Whether a layer set is one of the random sets of the null (``random-<i>``)."""
    return layer_set.name.startswith("random-")
