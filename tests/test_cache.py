import json

import pytest

from wavesurf.cache import atomic_directory, entry_lock, params_key, read_manifest, verify_directory, write_manifest


def test_atomic_directory_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 10)
            raise RuntimeError("interrupted")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_refuses_existing_then_overwrites(tmp_path):
    final = tmp_path / "entry"
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(FileExistsError, match="--overwrite"):
        with atomic_directory(final):
            pass
    assert (final / "a").read_text() == "1"
    with atomic_directory(final, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["b"]


def test_manifest_detects_size_and_hash_damage(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"abcdef")
    write_manifest(tmp_path, {"model": "m"})
    assert read_manifest(tmp_path)["model"] == "m"
    assert verify_directory(tmp_path, deep=True) is None
    (tmp_path / "w.bin").write_bytes(b"abcdeX")  # same size, other bytes
    assert verify_directory(tmp_path) is None
    assert "sha256" in verify_directory(tmp_path, deep=True)
    (tmp_path / "w.bin").write_bytes(b"abc")
    assert "bytes" in verify_directory(tmp_path)
    (tmp_path / "wavesurf-manifest.json").write_text("{not json")
    assert verify_directory(tmp_path) == "no readable manifest"


def test_params_key_changes_with_any_parameter():
    base = {"model": "m", "tokens": 100, "filter": None}
    assert params_key(base) == params_key(json.loads(json.dumps(base)))
    assert params_key(base) != params_key({**base, "tokens": 101})
    assert params_key(base) != params_key({**base, "filter": "q0.5"})


def test_overwrite_sets_the_old_entry_aside_and_leaves_nothing_behind(tmp_path):
    """A reader that opened the old entry keeps reading it; the new one takes its place whole."""
    final = tmp_path / "entry"
    with atomic_directory(final) as tmp:
        (tmp / "a.txt").write_text("old")
    reader = open(final / "a.txt")
    with atomic_directory(final, overwrite=True) as tmp:
        (tmp / "a.txt").write_text("new")
    assert reader.read() == "old"
    reader.close()
    assert (final / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_entry_lock_excludes_another_process(tmp_path):
    """While one process holds an entry's lock, another cannot take it; after release it can."""
    import subprocess
    import sys

    final = tmp_path / "models" / "m"
    probe = ("import fcntl, sys; fh = open(sys.argv[1], 'a')\n"
             "try:\n    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB); print('took')\n"
             "except BlockingIOError:\n    print('blocked')")
    lock = final.parent / ".m.lock"
    with entry_lock(final):
        assert lock.is_file()
        held = subprocess.run([sys.executable, "-c", probe, str(lock)], capture_output=True, text=True)
    free = subprocess.run([sys.executable, "-c", probe, str(lock)], capture_output=True, text=True)
    assert (held.stdout.strip(), free.stdout.strip()) == ("blocked", "took")
