"""Student's t quantiles for arrays and non-integer degrees of freedom, numpy only (no scipy in
the dependencies): the one home of the t distribution that the statistics' jackknife intervals
(:func:`wavesurf.stats.resampling.t_quantile`) and the drafters' two-level intervals
(:mod:`wavesurf.drafter.intervals`) both use."""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

from .errors import AcceptanceError


def _log_betacf(a: np.ndarray, b: np.ndarray, x: np.ndarray, iters: int = 300) -> np.ndarray:
    """log of the continued fraction of the regularised incomplete beta (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = np.ones_like(x)
    d = 1.0 - qab * x / qap
    d = np.where(np.abs(d) < tiny, tiny, d)
    d = 1.0 / d
    h = d.copy()
    for m in range(1, iters + 1):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = np.where(np.abs(d) < tiny, tiny, d)
        c = 1.0 + aa / c
        c = np.where(np.abs(c) < tiny, tiny, c)
        d = 1.0 / d
        h = h * d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = np.where(np.abs(d) < tiny, tiny, d)
        c = 1.0 + aa / c
        c = np.where(np.abs(c) < tiny, tiny, c)
        d = 1.0 / d
        delta = d * c
        h = h * delta
        if np.all(np.abs(delta - 1.0) < 1e-13):
            break
    return np.log(h)


_lgamma = np.vectorize(math.lgamma, otypes=[float])


def _log_betainc(a: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """log of the regularised incomplete beta I_x(a, b), 0 < x < 1 (the continued fraction where it
    converges fast, else through I_x(a, b) = 1 - I_{1-x}(b, a))."""
    out = np.empty_like(x)
    direct = x < (a + 1) / (a + b + 2)
    for sel, (p, q, y) in ((direct, (a, b, x)), (~direct, (b, a, 1 - x))):
        if sel.any():
            p, q, y = p[sel], q[sel], y[sel]
            log_i = (_lgamma(p + q) - _lgamma(p) - _lgamma(q) + p * np.log(y) + q * np.log1p(-y)
                     + _log_betacf(p, q, y) - np.log(p))
            out[sel] = log_i if sel is direct else np.log1p(-np.exp(np.minimum(log_i, -1e-300)))
    return out


def t_critical(alpha: Any, df: Any, error: type[Exception] = AcceptanceError) -> np.ndarray:
    """Two-sided critical values ``t`` with ``P(|T_df| > t) = alpha``, for arrays of ``alpha`` in
    (0, 1) and ``df >= 1`` (non-integer allowed; ``inf``: the normal quantile). Newton steps on the
    log tail ``log I_{df/(df+t²)}(df/2, 1/2)``; numpy only (no scipy in the dependencies). Bad
    input raises ``error`` (the caller's exception class)."""
    alpha, df = np.broadcast_arrays(np.asarray(alpha, dtype=float), np.asarray(df, dtype=float))
    alpha, df = alpha.astype(float).copy(), df.astype(float).copy()
    if np.any(~((alpha > 0) & (alpha < 1))) or np.any(~(df >= 1)):
        raise error(f"t_critical needs 0 < alpha < 1 and df >= 1, got alpha={alpha}, df={df}")
    z = np.array([NormalDist().inv_cdf(1 - a / 2) for a in alpha.ravel()]).reshape(alpha.shape)
    out = z.copy()
    finite = df < 1e7
    if not finite.any():
        return out
    a, nu, zf = alpha[finite], df[finite], z[finite]
    t = np.maximum(zf + (zf ** 3 + zf) / (4 * nu), 1e-3)  # Cornish-Fisher start, then Newton
    log_c = _lgamma((nu + 1) / 2) - _lgamma(nu / 2) - 0.5 * np.log(nu * np.pi)
    target, half = np.log(a), np.full_like(nu, 0.5)
    for _ in range(200):
        log_tail = _log_betainc(nu / 2, half, nu / (nu + t * t))
        log_pdf = log_c - (nu + 1) / 2 * np.log1p(t * t / nu)
        # d log tail / dt = -2 pdf / tail: a Newton step on the log tail, kept within [t/2, 2t]
        step = (log_tail - target) / (2 * np.exp(log_pdf - log_tail))
        t_new = np.clip(t + step, 0.5 * t, 2.0 * t)
        done = np.abs(t_new - t) <= 1e-12 * t
        t = t_new
        if done.all():
            break
    out[finite] = t
    return out


__all__ = ["t_critical"]
