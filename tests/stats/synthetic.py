"""Hard synthetic layers for the brute-force checks: correlated through a shared latent, with
anisotropic spectra, means ~1e3 and 3 dimensions scaled by 1e3 (like residual streams)."""
from __future__ import annotations

import numpy as np
import torch

from wavesurf.stats import LayerMoments


def hard_layers(n: int, layer_ids=(0, 1, 2, 3), d: int = 16, seed: int = 0, noise_step: float = 0.3,
                anisotropic: bool = True) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n, d)) * (np.linspace(0.2, 2.0, d) if anisotropic else 1.0)
    out = {}
    for k, lid in enumerate(layer_ids):
        A = rng.standard_normal((d, d)) / np.sqrt(d)
        x = base @ A + (0.3 + noise_step * k) * rng.standard_normal((n, d))
        x += 1e3 * (1.0 + rng.random(d))
        x[:, :3] *= 1e3
        out[lid] = x
    return out


def fill(data: dict[int, np.ndarray], sizes=(500, 1500, 1000), **kw) -> LayerMoments:
    """A LayerMoments fed ``data`` in batches of ``sizes`` rows."""
    acc = LayerMoments(list(data), next(iter(data.values())).shape[1], **kw)
    start = 0
    for s in sizes:
        acc.update({k: torch.tensor(v[start : start + s]) for k, v in data.items()})
        start += s
    return acc
