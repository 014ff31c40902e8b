"""What the speed table can say, in sentences: which layer sets beat the default and by how
much with which interval, what drafting after n-gram lookup adds, where the selected sets fall in
the null of random sets, and, first of all, whether the heads beat their floors at all (without
that the table cannot rank layer sets). Every number comes from the table's rows and ``info``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: the summary row of the default set's head trained reading no target stream (a floor)
CONTROL = "embedding-only"


def classify(diff: dict[str, float]) -> str:
    """``better``/``worse`` only when the interval (``diff_lo``..``diff_hi``: in the summary the
    simultaneous one) excludes 0 *and* every seed agrees. The interval already holds the seeds'
    spread; the agreement of every seed stays as a plain-language guard (it can only make a
    verdict more cautious)."""
    if diff["diff_lo"] > 0 and diff["diff_seed_min"] > 0:
        return "better"
    if diff["diff_hi"] < 0 and diff["diff_seed_max"] < 0:
        return "worse"
    return "within noise"


def _percent(info: dict[str, Any]) -> int:
    """The table's confidence level in percent (95 unless the table says otherwise)."""
    return round(100 * info.get("level", 0.95))


def _count(n: Any, noun: str) -> str:
    """``n noun`` with the noun in the plural unless n is 1."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _interval_name(info: dict[str, Any], family_key: str = "family") -> str:
    """``simultaneous 95%`` for intervals adjusted over a family, else ``95%``."""
    fam = info.get(family_key) or {}
    if fam.get("comparisons", 0) > 1:
        return f"simultaneous {round(100 * fam.get('level', info.get('level', 0.95)))}%"
    return f"{_percent(info)}%"


def seeds_clause(info: dict[str, Any]) -> str:
    """``2 training seeds per set`` and, where some sets have more or fewer, which."""
    text = f"{_count(info.get('seeds', '?'), 'training seed')} per set"
    counts = info.get("seed_counts") or {}
    per = info.get("seeds")
    extra = [f"{k} for the {what}" for what, k in counts.items() if what != "other sets" and k != per]
    return text + (f" ({'; '.join(extra)})" if extra else "")


def _resampling_clause(info: dict[str, Any]) -> str:
    """What the intervals resample, in words (one seed: say that seed variation is not in them)."""
    seeds, fam = info.get("seeds"), info.get("family") or {}
    if isinstance(seeds, int):  # the most any drafter has (the primary comparison's, where more)
        seeds = max([seeds, *(info.get("seed_counts") or {}).values()])
    what = ("intervals resample held-out sequences and training seeds" if isinstance(seeds, int) and seeds >= 2
            else "intervals resample held-out sequences only (1 training seed: seed-to-seed variation is not in them)"
            if seeds == 1 else "")
    if fam.get("comparisons", 0) > 1:
        what += (", " if what else "") + f"simultaneous over the {fam['comparisons']} comparisons with the default (max-T)"
    return f"; {what}" if what else ""


def verdict_sentence(summary: Sequence[dict[str, Any]], info: dict[str, Any]) -> str:
    """One sentence: which sets beat the default by how much with what interval, or that none
    differs beyond its interval (the largest difference given). The intervals are the summary's
    ``diff_lo``/``diff_hi``: simultaneous over the family of comparisons with the default (max-T,
    ``info["family"]``), so "beats" holds for the family at the stated level, not once per set."""
    default = next(r for r in summary if r["group"] == "default")
    others = [r for r in summary if r["group"] not in ("default", "floor")]
    d, kind = info.get("draft_len", 4), _interval_name(info)
    where = (f"offline chain acceptance at draft length {d} on {info.get('heldout_sequences', '?')} held-out "
             f"sequences ({info.get('heldout_positions', '?'):,} tokens), {seeds_clause(info)}"
             f"{_resampling_clause(info)}")
    base = f"the default [{default['layer_ids']}] (τ = {default['tau']:.3f})"
    better = sorted((r for r in others if r["verdict"] == "better"), key=lambda r: -r["diff"])
    fmt = lambda r: f"{r['layer_set']} [{r['layer_ids']}] by {r['diff']:+.3f} τ ({kind} CI {r['diff_lo']:+.3f} to {r['diff_hi']:+.3f})"  # noqa: E731
    worse = sum(1 for r in others if r["verdict"] == "worse")
    lead = _cannot_rank_clause(info, base)
    if better:
        head = f"{len(better)} of {len(others)} layer sets beat {base}: " + "; ".join(fmt(r) for r in better[:3])
    else:
        top = max(others, key=lambda r: r["diff"]) if others else None
        head = f"No layer set beats {base} beyond its {kind} interval" + (
            f"; the largest difference is {fmt(top)}" if top else "")
    prim = info.get("primary")
    if prim:
        what = {"better": "better than", "worse": "worse than"}.get(prim["verdict"], "not different beyond the interval from")
        lead += (f"Primary comparison (named before the run): {prim['layer_set']} [{prim['layer_ids']}] is {what} "
                 f"the default, {prim['diff']:+.3f} τ ({_percent(info)}% CI {prim['diff_lo']:+.3f} to "
                 f"{prim['diff_hi']:+.3f}). Exploratory, over every set: ")
    return f"{lead}{head}; {worse} {'set is' if worse == 1 else 'sets are'} worse ({where})."


def _cannot_rank_clause(info: dict[str, Any], base: str) -> str:
    """The sentence the verdict starts with when the default set's heads do not beat the bigram
    floor or the embedding-only control beyond the interval (empty when they beat both)."""
    rank = info.get("can_rank") or {}
    if not rank or rank.get("ok"):
        return ""
    level = _percent(info)
    names = {"bigram": "the bigram floor", CONTROL: "their embedding-only control (the same head reading no layer)"}
    missed = [f"{names[k]} (τ = {v['tau']:.3f}; margin {v['margin']:+.3f}, {level}% CI {v['margin_lo']:+.3f} to "
              f"{v['margin_hi']:+.3f})" for k, v in rank.items() if isinstance(v, dict) and not v["beaten"]]
    return (f"At this training budget the heads of {base} do not beat " + " or ".join(missed) +
            ", so this table cannot rank layer sets for a reason that has to do with the layers. ")


def lookup_sentence(summary: Sequence[dict[str, Any]], info: dict[str, Any]) -> str:
    """What the heads add after n-gram lookup (paired against lookup alone), and whether any set
    differs from the default there beyond its interval (simultaneous over the sets, as in
    :func:`verdict_sentence`)."""
    over = info.get("head_over_lookup")
    if not over:
        return ""
    level, kind = _percent(info), _interval_name(info, "lookup_family")
    others = [r for r in summary if r["group"] not in ("default", "floor") and "lookup_diff" in r]
    beyond = [r for r in others if r["lookup_diff_lo"] > 0 or r["lookup_diff_hi"] < 0]
    text = (f"After lookup, the default set's head adds {over['diff']:+.3f} τ over lookup alone ({level}% CI "
            f"{over['diff_lo']:+.3f} to {over['diff_hi']:+.3f})")
    if not others:
        return text + "."
    top = max(others, key=lambda r: abs(r["lookup_diff"]))
    fmt = f"{top['layer_set']} ({top['lookup_diff']:+.3f}, {kind} CI {top['lookup_diff_lo']:+.3f} to {top['lookup_diff_hi']:+.3f})"
    if beyond:
        names = ", ".join(f"{r['layer_set']} ({r['lookup_diff']:+.3f})" for r in beyond)
        verb = "set differs" if len(beyond) == 1 else "sets differ"
        return text + (f"; drafting this way, {len(beyond)} of {len(others)} {verb} from the default beyond the "
                       f"{kind} interval: {names}.")
    return text + f"; drafting this way no set differs from the default beyond its {kind} interval (largest: {fmt})."


def not_evidence_note(info: dict[str, Any]) -> str:
    """The lead-in of any sentence that orders layer sets by their heads' τ (the null ranks, the
    criteria's correlations) when the table cannot rank: the default set's heads do not beat the
    bigram floor or the embedding-only control, so differences between sets are not about layers.
    Empty when they beat both (or the table has no such check)."""
    rank = info.get("can_rank") or {}
    if not rank or rank.get("ok"):
        return ""
    return ("Not evidence either way, since the heads do not beat their floors at this budget (the verdict "
            "above): ")


def question_answer(info: dict[str, Any], criteria_text: str) -> str:
    """The paper's question in one passage (the introduction's line): where the selected sets rank
    among random sets, then ``criteria_text`` (which criteria order the trained sets like their
    heads), led once by :func:`not_evidence_note` when the table cannot rank."""
    ranked = _null_ranks(info.get("null") or {}, info)
    return not_evidence_note(info) + " ".join(part for part in (ranked, criteria_text) if part)


def null_sentence(null: dict[str, Any], info: dict[str, Any]) -> str:
    """The selected sets ranked in the null of random layer sets, in one sentence (led by
    :func:`not_evidence_note` when the table cannot rank)."""
    lead = not_evidence_note(info) if null and not null.get("note") else ""  # only ranks are led
    return lead + _null_ranks(null, info)


def _null_ranks(null: dict[str, Any], info: dict[str, Any]) -> str:
    """:func:`null_sentence` without its lead: the ranks, the null's own note, or "" without a null."""
    if not null:
        return ""
    if null.get("note"):
        return f"Selection against random sets: {null['note']}."
    level = _percent(info)
    rows = sorted(null["rows"], key=lambda r: -r["percentile"])
    parts = [f"{r['layer_set']} [{r['layer_ids']}] at {100 * r['percentile']:.0f}% ({level}% CI "
             f"{100 * r['percentile_lo']:.0f}–{100 * r['percentile_hi']:.0f}%)" for r in rows]
    above = [r for r in rows if r["percentile_lo"] > 0.5]
    below = [r for r in rows if r["percentile_hi"] < 0.5]
    tail = (f"; {len(above)} of {len(rows)} rank above the middle of the null beyond the interval" if above else
            "; none ranks above the middle of the null beyond its interval")
    if below:  # worse than a typical random set of the same size: the criterion picked against τ
        tail += (f", and {len(below)} of {len(rows)} rank below it beyond the interval (worse than a typical "
                 "random set of the same size)")
    return (f"Against {null['random_sets']} random layer sets (the null; each selected set's share of random "
            "sets it beats, sequences and seeds resampled): " + "; ".join(parts) + tail + ".")
