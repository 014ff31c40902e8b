"""Where an analysis result lives: its cache directory and the files in it (``stats.npz``, tidy
``layers.csv`` / ``cka.csv``, ``meta.json``, the cross-covariance blocks ``cross_<subset>.npy``),
written atomically and checked when read back.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..cache import atomic_directory, entry_dir, verify_directory, write_manifest, write_rows_csv
from ..errors import WavesurfError
from .results import BlockCovariances, LayerStats, SubsetStats

#: the per-layer arrays of a subset, in the order :class:`SubsetStats` takes them
_ARRAYS = ("entropy", "entropy2", "normalized_entropy", "purity", "trace", "cka")


def save_stats(stats: LayerStats, out: Path) -> None:
    """Write a LayerStats into ``out`` atomically (npz, tidy CSVs, meta, cross-covariance blocks)."""
    with atomic_directory(out, overwrite=True) as tmp:
        arrays: dict[str, np.ndarray] = {}
        subs = [stats.main] + ([stats.control] if stats.control else [])
        for sub in subs:
            for name in _ARRAYS:
                arrays[f"{sub.name}.{name}"] = getattr(sub, name)
            arrays[f"{sub.name}.layer_ids"] = np.asarray(sub.layer_ids)
            arrays[f"{sub.name}.compartments"] = np.asarray(sub.compartments, dtype=np.int64).reshape(-1, 2)
            if sub.cross is not None:
                np.save(tmp / f"cross_{sub.name}.npy", sub.cross.blocks)
            for rname, arr in (sub.replicates or {}).items():
                arrays[f"{sub.name}.rep.{rname}"] = arr
        np.savez(tmp / "stats.npz", **arrays)
        meta = {**stats.meta, "subsets": {s.name: s.n_tokens for s in subs},
                "interval_notes": {s.name: s.interval_note for s in subs}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        write_rows_csv(tmp / "layers.csv", stats.layer_rows())
        write_rows_csv(tmp / "cka.csv", stats.cka_rows())
        write_manifest(tmp, {"kind": "analyze", "key": stats.key}, hash_files=False)


def load_stats(path: Path) -> LayerStats:
    """The LayerStats saved in ``path`` (refused, naming the problem, when the files are damaged)."""
    path = Path(path)
    problem = verify_directory(path)
    if problem is not None:
        raise WavesurfError(f"statistics in {path} are damaged ({problem}); delete the directory to recompute")
    meta = json.loads((path / "meta.json").read_text())
    data = np.load(path / "stats.npz")
    subs = []
    for name, n in meta["subsets"].items():
        ids = [int(i) for i in data[f"{name}.layer_ids"]]
        cross_path = path / f"cross_{name}.npy"
        cross = BlockCovariances(np.load(cross_path, mmap_mode="r"), ids, n) if cross_path.exists() else None
        prefix = f"{name}.rep."
        reps = {k[len(prefix):]: data[k] for k in data.files if k.startswith(prefix)} or None
        subs.append(SubsetStats(name, int(n), ids, *(data[f"{name}.{a}"] for a in _ARRAYS[:-1]),
                                cka=data[f"{name}.cka"],
                                compartments=[tuple(map(int, r)) for r in data[f"{name}.compartments"]], cross=cross,
                                replicates=reps, interval_note=meta.get("interval_notes", {}).get(name)))
    return LayerStats(meta["key"], meta, subs[0], subs[1] if len(subs) > 1 else None, path)


def result_dir(model_name: str, key: str) -> Path:
    """The cache directory of the analysis of ``model_name`` under ``key``."""
    return entry_dir("results/analyze", model_name, key)
