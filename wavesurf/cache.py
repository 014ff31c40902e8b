"""Where wavesurf keeps what it computes once: dequantized models and keyed results.

Every entry is written into a temporary sibling directory and renamed into place only when
complete, so an interrupted run never leaves a half-written entry that looks finished.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

MANIFEST = "wavesurf-manifest.json"


def cache_root() -> Path:
    """The cache directory: ``$WAVESURF_CACHE`` if set, else the user's cache dir + ``wavesurf``."""
    env = os.environ.get("WAVESURF_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("wavesurf"))


def safe_name(name: str) -> str:
    """``name`` with every character other than letters, digits, ``-``, ``_`` and ``.`` made ``_``
    (a model name or HF id as part of a directory name)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def entry_dir(kind: str, model_name: str, key: str) -> Path:
    """The cache directory of one keyed entry: ``<cache>/<kind>/<model>-<key>`` (``kind`` such as
    ``results/analyze`` or ``drafter/features``)."""
    return cache_root() / kind / f"{safe_name(model_name)}-{key}"


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def describe_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """Which parameters of a cached entry differ from the ones asked for, for refusal messages."""
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return "; ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in keys) or "none"


BUILD_FILE = "build.json"


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and a rename: never half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def resume_build(where: Path, params: Mapping[str, Any], record: Mapping[str, Any], what: str,
                 error: type[Exception]) -> dict[str, Any]:
    """Start or resume the build of an entry that is written in parts (chunks, shards): its
    ``build.json`` records ``params`` first, so an interrupted build resumes only with the same
    parameters. Returns the record of the build being resumed, or ``record`` (with ``params``) as
    written now; refuses a directory holding an unfinished ``what`` with other parameters."""
    where.mkdir(parents=True, exist_ok=True)
    build_file = where / BUILD_FILE
    if build_file.is_file():
        old = json.loads(build_file.read_text())
        if old.get("params") != dict(params):
            raise error(f"{where} holds an unfinished {what} with other parameters "
                        f"({describe_differences(old.get('params', {}), params)}); remove it or choose another path")
        return old
    new = {"params": dict(params), **record}
    write_text_atomic(build_file, json.dumps(new, indent=2, sort_keys=True))
    return new


def write_rows_csv(path: Path, rows: Sequence[Mapping[str, Any]], float_format: str = ".10g") -> Path:
    """Tidy CSV; the header is every key in order of first appearance (a row without a column gets
    an empty cell); floats (numpy ones too) with ``float_format``; lists (of layer ids) space-joined."""
    import numpy as np

    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (format(float(v), float_format) if isinstance(v, float | np.floating)
                                 else " ".join(map(str, v)) if isinstance(v, list | tuple) else v)
                             for k, v in row.items()})
    return Path(path)


def params_key(params: Mapping[str, Any]) -> str:
    """A short stable key for a parameter dict (sorted JSON, sha256): changes iff a parameter does."""
    blob = json.dumps(params, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``final``; on success rename it to ``final``.

    On any exception (Ctrl-C included) the temporary directory is deleted and ``final`` is
    untouched, so nothing partial is ever found at ``final``.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists; remove it or pass overwrite=True (--overwrite)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the finished entry follows the umask
    try:
        yield tmp
        old = None
        if final.exists():  # moved aside, not deleted in place: a reader of it never sees it half gone
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def entry_lock(final: Path) -> Iterator[None]:
    """Hold an exclusive lock on cache entry ``final`` (a ``.lock`` file beside it) while it is
    checked and built, so processes sharing a cache (test workers, ``torchrun`` ranks) build it
    once: the others wait, then find it built. POSIX ``flock``; elsewhere no lock is taken."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_manifest(directory: Path, info: Mapping[str, Any], hash_files: bool = True) -> dict:
    """Record size (and sha256) of every file in ``directory`` plus ``info``; written last."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = path.relative_to(directory).as_posix()
        entry: dict[str, Any] = {"bytes": path.stat().st_size}
        if hash_files:
            entry["sha256"] = file_sha256(path)
        files[rel] = entry
    manifest = {**info, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def read_manifest(directory: Path) -> dict | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def verify_directory(directory: Path, deep: bool = False) -> str | None:
    """Return ``None`` if every file listed in the manifest is present with its recorded size
    (and hash when ``deep``); otherwise a short reason why the entry is damaged."""
    manifest = read_manifest(directory)
    if manifest is None:
        return "no readable manifest"
    for rel, entry in manifest.get("files", {}).items():
        path = Path(directory) / rel
        if not path.is_file():
            return f"missing file {rel}"
        if path.stat().st_size != entry["bytes"]:
            return f"{rel} has {path.stat().st_size} bytes, manifest says {entry['bytes']}"
        if deep and "sha256" in entry and file_sha256(path) != entry["sha256"]:
            return f"{rel} does not match its sha256"
    return None
