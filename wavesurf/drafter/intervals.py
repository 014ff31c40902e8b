"""Intervals for offline acceptance τ that resample what is random in the experiment: the held-out
sequences *and* the training seeds; and simultaneous (family-wise) intervals for a family of
comparisons with one reference set.

Why two levels. A head's τ varies for two reasons: which conversations were held out (sequences)
and which training run produced the head (seed: initialisation and data order). A bootstrap over
sequences with every head fixed answers "how would *these* heads do on other conversations"; the
speed table asks "would another training run of this layer set beat another run of the default",
so its intervals resample the unit of each noise: sequences and seeds.

The replicates. Replicate ``b`` draws sequence weights ``w_b`` (multinomial) and seed counts
``pi_b`` (multinomial over the ``K`` seeds), both shared by every set compared: sequence
difficulty cancels in a difference (pairing by sequence), and seed ``k`` of one set is paired with
seed ``k`` of another (the speed table trains every set with the same seeds; pairing exchangeable
pairs is valid whether or not they are correlated). With ``m_b`` the seed average of the per-seed
ratio estimates ``τ_k(w_b)``, the replicate is::

    θ*_b = m_b + sqrt(K / (K - 1)) * (Σ_k pi_bk τ_k(w_b) / K - m_b)

The factor undoes the bootstrap's ``(K-1)/K`` shrinkage of a variance over ``K`` seeds, so the
replicates' variance estimates ``V_seq + s²_seed / K`` (sequence part + between-seed variance of the
mean) without bias; with 2 seeds that shrinkage would otherwise halve the seed part. The replicates
carry the joint behaviour of the family (shared reference, shared sequences) into max-T below.

Few seeds. Intervals are ``θ̂ ± t_ν · SE`` with ``SE² = V_seed + V_seq``: ``V_seq`` the variance
of the sequence-only replicates (seeds fixed), ``V_seed`` the between-seed variance of full-sample τ
over ``K``. With 2 seeds a drafter's own between-seed variance has 1 degree of freedom, and since
every comparison shares the reference's two seeds, a family of comparisons then misses the truth
several times as often as it claims (measured in ``tests/drafter/test_intervals.py``). So by default
the between-seed variance is **pooled** over every drafter whose score changes with the seed
(training noise taken to be alike across layer sets, as the error term of an ANOVA), with
``G'(K - 1)`` degrees of freedom, and a difference of two trained heads gets ``2 σ²_seed / K``
(seeds taken as independent; a positive correlation from pairing only makes this conservative).
``ν`` is the Welch–Satterthwaite combination of the two parts' degrees of freedom (seed part,
``S - 1``). The between-seed variance of full-sample τ also carries the seed x sequence interaction
once more than needed, which makes the intervals slightly conservative (no resampling scheme is
exactly unbiased for a crossed design; McCullagh 2000, *Bernoulli* 6:285).

Uneven seeds. Drafters may have different numbers of seeds ``K_g`` (the long profile trains the
default and the primary set with 3, the other sets with 2, the random sets of the null with 1):
drafter g has the first ``K_g`` seeds, missing ones are NaN rows. Drafters with the same ``K_g``
share one seed resampling; the pool weights each drafter's variance by its ``K_g - 1`` degrees of
freedom; a trained head with one seed takes the pooled variance (its replicates get a normal seed
draw of that variance, so max-T sees it: measured family-wise error 4.6-5.0% at nominal 5% in
``tests/drafter/test_intervals.py``'s design, against 6.2% without the draw).

With one seed for every drafter there is no seed variance to estimate: the interval is the percentile interval over
sequences alone (what :func:`~wavesurf.drafter.acceptance.bootstrap_tau` always gave), labelled
``sequences only`` in :func:`basis`.

Simultaneous intervals (max-T). For a family of ``m`` differences against one reference, each
replicate's differences are studentized, ``T*_gb = (Δ*_gb - Δ̂_g) / SE*_g`` (``SE*``: the
replicates' standard deviation), and the family level's
quantile ``c`` of ``max_g |T*_gb|`` is the common critical value (Westfall & Young 1993; Romano &
Wolf 2005): it knows the comparisons share the reference and the sequences, so it is less
conservative than Bonferroni and still holds the family-wise error. With few seeds the bootstrap's
tails are too light, so ``c`` is read as a per-comparison level ``α'`` (the replicates' mean
exceedance of ``c``, kept between ``α/m`` and ``α``) and each comparison gets
``max(c, t_ν(1 - α'/2))`` standard errors; with many seeds and sequences that is ``c`` itself.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AcceptanceError, is_int
from ..tdist import t_critical


def check_level(level: Any, name: str = "level") -> float:
    """A confidence level strictly between 0 and 1 (refused otherwise)."""
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise AcceptanceError(f"{name}={level!r} must be a number in (0, 1), e.g. 0.95")
    return float(level)


def basis(n_seeds: int, n_sequences: int) -> str:
    """What an interval rests on, in words (a CSV field: an interval is never silently seed-free)."""
    if n_seeds >= 2:
        return f"{n_seeds} seeds x {n_sequences} sequences"
    return f"sequences only ({n_sequences} sequences; 1 seed, seed variance not estimated)"


def satterthwaite(v_seed: Any, v_seq: Any, df_seed: float, df_seq: float) -> np.ndarray:
    """Welch–Satterthwaite degrees of freedom of ``v_seed + v_seq`` whose parts have ``df_seed``
    and ``df_seq`` degrees of freedom (a part that is 0 adds none; ``inf`` where both are 0);
    ``df_seed`` may differ per element (drafters with different numbers of seeds)."""
    v_seed, v_seq, df_seed = np.asarray(v_seed, float), np.asarray(v_seq, float), np.asarray(df_seed, float)
    num = (v_seed + v_seq) ** 2
    den = np.where(df_seed > 0, v_seed ** 2 / np.where(df_seed > 0, df_seed, 1.0), 0.0) + v_seq ** 2 / df_seq
    with np.errstate(invalid="ignore", divide="ignore"):
        nu = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.inf)
    return np.maximum(nu, 1.0)


# ---------------------------------------------------------------------------------------------
# the intervals
@dataclass
class TauIntervals:
    """Intervals of ``G`` drafters' τ (one row per drafter, keys below) from one set of replicates.

    Per row: ``tau`` (mean over seeds of the per-seed τ), ``tau_lo``/``tau_hi`` (two-level t
    interval, or the sequence percentile interval with 1 seed), ``tau_se``, ``tau_df``,
    ``tau_seed_std``, ``tau_seq_lo``/``tau_seq_hi`` (sequence-only percentile interval, seeds
    fixed). With a reference, per row also ``diff`` (row - reference, seeds paired),
    ``diff_lo``/``diff_hi`` (per-comparison interval), ``diff_seq_lo``/``diff_seq_hi`` (sequence
    only), ``diff_se`` with its parts ``diff_se_seed``
    and ``diff_se_seq``, ``diff_df``, ``diff_seed_min``/``diff_seed_max`` (the per-seed
    differences); for members of the family also ``diff_fw_lo``/``diff_fw_hi`` (simultaneous) and
    ``diff_fw_crit`` (the critical value used, in SEs). ``family``: the family's size, level,
    max-T critical value ``crit`` and the per-comparison level ``alpha_per_comparison`` it implies.
    """

    rows: list[dict[str, float]]
    seeds: int
    sequences: int
    level: float
    seed_df: int = 0  # degrees of freedom of the between-seed variance (pooled over drafters, or K - 1)
    pooled_seed_std: float = 0.0  # between-seed standard deviation of one head's tau (pooled where pooling)
    seeds_per_drafter: list[int] = field(default_factory=list)  # K_g (``seeds`` is the largest)
    family: dict[str, Any] = field(default_factory=dict)

    @property
    def basis(self) -> str:
        """What the intervals rest on: one count of seeds, or the range where drafters differ."""
        counts = sorted(set(self.seeds_per_drafter or [self.seeds]))
        if len(counts) == 1:
            return basis(self.seeds, self.sequences)
        return f"{counts[0]}-{counts[-1]} seeds x {self.sequences} sequences"

    def row_basis(self, g: int) -> str:
        """What drafter ``g``'s interval rests on."""
        k = self.seeds_per_drafter[g] if self.seeds_per_drafter else self.seeds
        if k == 1 and self.seed_df > 0 and max(self.seeds_per_drafter or [1]) > 1:
            return f"1 seed x {self.sequences} sequences, seed variance pooled from the other drafters"
        return basis(k, self.sequences)


def seed_counts(c: np.ndarray) -> np.ndarray:
    """Seeds per drafter of a ``[G, K, S]`` array whose missing seeds are NaN rows (a drafter with
    fewer seeds than another has its first ``K_g`` seeds, the same seed values as the others'
    first ``K_g``: seeds are paired by index). Refuses a gap (seed k missing but k + 1 present)."""
    present = ~np.isnan(c).any(axis=2)  # [G, K]
    counts = present.sum(axis=1)
    for g, k in enumerate(counts):
        if k < 1 or not present[g, :k].all():
            raise AcceptanceError(f"drafter {g} has seeds {np.flatnonzero(present[g]).tolist()} of "
                                  f"{c.shape[1]}: each drafter needs its first K_g >= 1 seeds, without gaps "
                                  "(seeds are paired by index)")
    return counts


def _replicates(c: np.ndarray, n: np.ndarray, counts: np.ndarray, n_boot: int,
                seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The two-level replicates of the module docstring for ``c``/``n`` [G, K, S] (missing seeds
    NaN; ``counts``: :func:`seed_counts` of ``c``): sequence-only replicates [B, G] (seeds fixed), full replicates
    [B, G] (sequences and seeds), and the full-sample per-seed tau [G, K] (NaN where missing).
    Drafters with the same number of seeds share one seed resampling (seed k paired with seed k);
    drafters with different numbers are resampled independently."""
    G, K, S = c.shape
    present = np.arange(K)[None, :] < counts[:, None]  # [G, K]
    c0, n0 = np.nan_to_num(c), np.nan_to_num(n)
    rng = np.random.default_rng(seed)
    w = rng.multinomial(S, np.full(S, 1.0 / S), size=n_boot).astype(np.float64)  # [B, S]
    num = (w @ c0.reshape(G * K, S).T).reshape(n_boot, G, K)
    den = (w @ n0.reshape(G * K, S).T).reshape(n_boot, G, K)
    tau_bgk = np.where(present, num / np.maximum(den, 1.0), 0.0)  # per-seed tau on each replicate (0 if missing)
    seq_rep = tau_bgk.sum(axis=2) / counts  # [B, G]: sequences resampled, seeds fixed (and averaged)
    rep = seq_rep.copy()
    for k in sorted(set(int(x) for x in counts)):
        if k < 2:
            continue
        gs = np.flatnonzero(counts == k)
        pi = rng.multinomial(k, np.full(k, 1.0 / k), size=n_boot) / k  # [B, k], shared by these drafters
        drawn = np.einsum("bk,bgk->bg", pi, tau_bgk[:, gs, :k])
        rep[:, gs] = seq_rep[:, gs] + math.sqrt(k / (k - 1)) * (drawn - seq_rep[:, gs])
    csum, nsum = c0.sum(axis=2), n0.sum(axis=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_seed = np.where(present & (nsum > 0), csum / np.where(nsum > 0, nsum, 1.0), np.nan)  # [G, K]
    return seq_rep, rep, per_seed


def tau_replicates(committed: Any, cycles: Any, *, n_boot: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The two-level replicates of τ (sequences and seeds resampled together, the module docstring)
    of ``G`` drafters, ``committed``/``cycles`` ``[G, K, S]``: replicates ``[n_boot, G]`` (one
    resampling shared by every drafter, so they stay paired) and the full-sample τ per seed ``[G, K]``."""
    c, n = np.asarray(committed, dtype=np.float64), np.asarray(cycles, dtype=np.float64)
    if c.ndim != 3 or c.shape != n.shape:
        raise AcceptanceError(f"committed and cycles must both be [drafters, seeds, sequences], got {c.shape} and {n.shape}")
    if c.shape[2] < 2:
        raise AcceptanceError(f"intervals need at least 2 held-out sequences, got {c.shape[2]}")
    _, rep, per_seed = _replicates(c, n, seed_counts(c), n_boot, seed)
    return rep, per_seed


def null_percentiles(committed: Any, cycles: Any, subjects: Sequence[int], null: Sequence[int], *,
                     level: float = 0.95, n_boot: int = 2000, seed: int = 0) -> list[dict[str, float]]:
    """Where each drafter of ``subjects`` falls among the drafters of ``null`` (random layer sets):
    the fraction of null drafters whose τ is below its τ (ties count half), on the full sample and
    on each two-level replicate (sequences and seeds resampled together, as :func:`tau_intervals`),
    whose percentiles give the interval. Ranking against a null of random sets replaces pairing two
    maxima picked on the same data, whose winner's curse favours the larger pool."""
    level = check_level(level)
    c, n = np.asarray(committed, dtype=np.float64), np.asarray(cycles, dtype=np.float64)
    null, subjects = [int(g) for g in null], [int(g) for g in subjects]
    if len(null) < 2:
        raise AcceptanceError(f"a null needs at least 2 random layer sets, got {len(null)}")
    if c.shape[2] < 2:
        raise AcceptanceError(f"intervals need at least 2 held-out sequences, got {c.shape[2]}")
    _, rep, per_seed = _replicates(c, n, seed_counts(c), n_boot, seed)
    point = np.nanmean(per_seed, axis=1)

    def share(mine: np.ndarray, others: np.ndarray) -> np.ndarray:
        return ((others < mine[..., None]).sum(-1) + 0.5 * (others == mine[..., None]).sum(-1)) / others.shape[-1]

    a = (1 - level) / 2
    out = []
    for g in subjects:
        boot = share(rep[:, g], rep[:, null])
        lo, hi = np.quantile(boot, [a, 1 - a])
        out.append({"percentile": float(share(point[[g]], point[None, null])[0]), "percentile_lo": float(lo),
                    "percentile_hi": float(hi), "null_sets": len(null),
                    "above_all": float(np.mean(boot == 1.0))})
    return out


def tau_intervals(committed: Any, cycles: Any, *, reference: int | None = None, family: Sequence[int] = (),
                  level: float = 0.95, family_level: float | None = None, n_boot: int = 2000, seed: int = 0,
                  pool_seeds: bool = True) -> TauIntervals:
    """Two-level bootstrap intervals of τ for ``G`` drafters scored on the same ``S`` held-out
    sequences, ``K`` training seeds each: ``committed``/``cycles`` int ``[G, K, S]`` (tokens and
    target forwards per sequence at one draft length). ``reference``: index of the drafter every
    difference is taken against (None: no differences); ``family``: indices whose differences get
    simultaneous intervals at ``family_level`` (default ``level``) by max-T.

    ``pool_seeds``: the between-seed variance of τ is one number for every drafter whose scores
    change with the seed (a trained head; a floor repeated per seed has none), estimated from all
    of them with ``G'(K - 1)`` degrees of freedom, as the pooled error of an ANOVA. With 2 seeds a
    per-comparison estimate has 1 degree of freedom and a family of comparisons with one shared
    reference cannot hold its error rate (``tests/drafter/test_intervals.py`` measures both);
    ``False`` estimates it per drafter (from the paired per-seed differences for a difference).
    See the module docstring for why sequences and seeds are both resampled."""
    level = check_level(level)
    family_level = level if family_level is None else check_level(family_level, "family_level")
    if not is_int(n_boot, 100):
        raise AcceptanceError(f"n_boot={n_boot!r} must be an integer >= 100")
    c = np.asarray(committed, dtype=np.float64)
    n = np.asarray(cycles, dtype=np.float64)
    if c.ndim != 3 or c.shape != n.shape:
        raise AcceptanceError(f"committed and cycles must both be [drafters, seeds, sequences], got "
                              f"{c.shape} and {n.shape}")
    G, K, S = c.shape
    if G < 1 or K < 1:
        raise AcceptanceError(f"intervals need at least one drafter and one seed, got shape {c.shape}")
    if S < 2:
        raise AcceptanceError(f"intervals need at least 2 held-out sequences, got {S}")
    family = [int(g) for g in family]
    if family and reference is None:
        raise AcceptanceError("a family of comparisons needs a reference drafter")
    if reference is not None and not 0 <= reference < G:
        raise AcceptanceError(f"reference={reference} is not one of the {G} drafters")
    if any(not 0 <= g < G or g == reference for g in family) or len(set(family)) != len(family):
        raise AcceptanceError(f"family={family} must list distinct drafters 0..{G - 1} other than the reference")

    counts = seed_counts(c)
    seq_rep, rep, per_seed = _replicates(c, n, counts, n_boot, seed)
    point = np.nanmean(per_seed, axis=1)

    # between-seed variance: 0 for a drafter whose scores do not change with the seed (a floor,
    # passed repeated per seed); a trained head with one seed has one, unobserved (taken from the pool)
    fixed = np.array([counts[g] >= 2 and all(np.array_equal(c[g, k], c[g, 0]) and np.array_equal(n[g, k], n[g, 0])
                                              for k in range(counts[g])) for g in range(G)])
    observed = (counts >= 2) & ~fixed
    s2 = np.array([np.var(per_seed[g, :counts[g]], ddof=1) if counts[g] >= 2 else 0.0 for g in range(G)])
    pooled = pool_seeds and observed.sum() >= 2
    df_seed = int((counts[observed] - 1).sum()) if pooled else 0
    if pooled:  # the ANOVA error term: each drafter's variance weighted by its degrees of freedom
        sigma2 = np.where(fixed, 0.0, float(((counts[observed] - 1) * s2[observed]).sum() / df_seed))
    else:
        sigma2 = np.where(observed, s2, 0.0)
    # a trained drafter whose seed variance is neither its own nor pooled gets the sequence
    # percentile interval, labelled "sequences only" (what bootstrap_tau gave before seeds counted)
    estimated = np.ones(G, dtype=bool) if pooled else fixed | observed
    lone = np.flatnonzero((counts == 1) & ~fixed & estimated)
    if len(lone):  # a one-seed head's seed draw: normal with the pooled variance, so max-T sees its seed noise
        z = np.random.default_rng([seed, 2]).standard_normal((n_boot, len(lone)))
        rep[:, lone] += np.sqrt(sigma2[lone]) * z
    alpha = 1 - level

    def interval(est: np.ndarray, seq_b: np.ndarray, v_seed: np.ndarray, df_part: np.ndarray,
                 has_seed: np.ndarray) -> tuple[np.ndarray, ...]:
        v_seq = seq_b.var(axis=0, ddof=1)
        se = np.sqrt(v_seed + v_seq)
        df = satterthwaite(v_seed, v_seq, df_part, S - 1)
        seq_lo, seq_hi = np.quantile(seq_b, alpha / 2, axis=0), np.quantile(seq_b, 1 - alpha / 2, axis=0)
        half = t_critical(np.full(len(est), alpha), df) * se
        lo = np.where(has_seed, est - half, seq_lo)
        hi = np.where(has_seed, est + half, seq_hi)
        return lo, hi, se, df, v_seq, seq_lo, seq_hi

    own_df = np.where(pooled, df_seed, counts - 1)
    lo, hi, se, df, _, seq_lo, seq_hi = interval(point, seq_rep, sigma2 / counts, own_df, estimated)
    rows: list[dict[str, float]] = [
        {"tau": float(point[g]), "tau_lo": float(lo[g]), "tau_hi": float(hi[g]), "tau_se": float(se[g]),
         "tau_df": float(df[g]), "tau_seq_lo": float(seq_lo[g]), "tau_seq_hi": float(seq_hi[g]),
         "tau_seed_std": float(math.sqrt(s2[g])), "seeds": int(counts[g])}
        for g in range(G)]
    out = TauIntervals(rows, int(counts.max()), S, level, seed_df=df_seed if pooled else K - 1,
                       pooled_seed_std=float(math.sqrt(sigma2.max())), seeds_per_drafter=[int(k) for k in counts])
    if reference is None:
        return out

    common = np.minimum(counts, counts[reference])  # seeds both drafters have, paired by index
    d_seed = [per_seed[g, :common[g]] - per_seed[reference, :common[g]] for g in range(G)]
    d_point = point - point[reference]
    d_seq, d_rep = seq_rep - seq_rep[:, [reference]], rep - rep[:, [reference]]
    same = np.array([np.array_equal(c[g], c[reference], equal_nan=True)
                     and np.array_equal(n[g], n[reference], equal_nan=True) for g in range(G)])
    if pooled:  # two independent training runs (a positive pairing correlation only makes this conservative)
        dv_seed = sigma2 / counts + sigma2[reference] / counts[reference]
        d_df = np.full(G, df_seed)
    else:  # each drafter's own: the paired per-seed differences where both have the same seeds
        paired = (counts == counts[reference]) & (counts >= 2)
        dv_seed = np.array([np.var(d_seed[g], ddof=1) / counts[g] if paired[g]
                            else sigma2[g] / counts[g] + sigma2[reference] / counts[reference] for g in range(G)])
        d_df = np.where(paired, counts - 1, np.minimum(np.maximum(counts - 1, 0),
                                                        np.maximum(counts[reference] - 1, 0)))
    dv_seed = np.where(same, 0.0, dv_seed)
    d_has = (estimated & estimated[reference]) | same
    dlo, dhi, dse, ddf, dv_seq, dseq_lo, dseq_hi = interval(d_point, d_seq, dv_seed, d_df, d_has)
    for g, r in enumerate(rows):
        r.update(diff=float(d_point[g]), diff_lo=float(dlo[g]), diff_hi=float(dhi[g]), diff_se=float(dse[g]),
                 diff_seq_lo=float(dseq_lo[g]), diff_seq_hi=float(dseq_hi[g]),
                 diff_se_seed=float(math.sqrt(dv_seed[g])), diff_se_seq=float(math.sqrt(dv_seq[g])),
                 diff_df=float(ddf[g]), diff_seed_min=float(d_seed[g].min()), diff_seed_max=float(d_seed[g].max()))
    if family:
        fam = np.array(family)
        crit, alpha_pc, per = max_t(d_rep[:, fam], d_point[fam], ddf[fam], family_level)
        for g, cg in zip(fam, per):
            rows[g].update(diff_fw_lo=float(d_point[g] - cg * dse[g]), diff_fw_hi=float(d_point[g] + cg * dse[g]),
                           diff_fw_crit=float(cg))
        out.family = {"comparisons": len(fam), "level": family_level, "method": "max-T", "crit": float(crit),
                      "alpha_per_comparison": float(alpha_pc)}
    return out


def max_t(replicates: np.ndarray, estimate: np.ndarray, df: np.ndarray,
          family_level: float) -> tuple[float, float, np.ndarray]:
    """Max-T critical values of a family of ``m`` estimates from shared bootstrap ``replicates``
    ``[B, m]``: each replicate studentized by the replicates' own standard deviation, the
    ``family_level`` quantile ``c`` of ``max_g |(θ*_g - θ̂_g) / SE*_g|``, the per-comparison level
    ``α'`` at which ``c`` operates (the family's mean share of replicates beyond ``c``, kept
    between Bonferroni's ``α/m`` and ``α``) and each estimate's critical value
    ``max(c, t_{df_g}(1 - α'/2))`` (the t restores the tails a bootstrap over few seeds lacks).
    Estimates whose replicates do not vary (a drafter compared with itself) stay out of the maximum."""
    family_level = check_level(family_level, "family_level")
    se = replicates.std(axis=0, ddof=1)
    live = se > 0
    if not live.any():
        return 0.0, 1 - family_level, np.zeros(len(se))
    t = np.abs(replicates[:, live] - estimate[live]) / se[live]
    crit = float(np.quantile(t.max(axis=1), family_level))
    alpha = 1 - family_level
    alpha_pc = float(np.clip((t > crit).mean(), alpha / int(live.sum()), alpha))
    per = np.zeros(len(se))
    per[live] = np.maximum(crit, t_critical(np.full(int(live.sum()), alpha_pc), df[live]))
    return crit, alpha_pc, per


__all__ = ["TauIntervals", "basis", "check_level", "max_t", "satterthwaite", "seed_counts", "t_critical", "tau_intervals",
           "tau_replicates"]
