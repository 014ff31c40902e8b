"""Progress that reaches the terminal from inside a notebook.

``wavesurf reproduce`` runs each notebook in a Jupyter kernel, whose progress bars land in the
notebook's own output, out of the user's sight: during the main job's 40-minute notebook 04b the
terminal would show only papermill's cell counter. So every long loop of the library draws its bar
through :func:`progress_bar`, and long multi-step work announces its step with :func:`phase`.
Where the environment variable :data:`ENV` names a file (``reproduce`` sets it for the kernel it
starts), both also write their latest state there as one small JSON object (at most every
:data:`MIN_INTERVAL_S` seconds, replaced atomically), which ``reproduce`` polls and prints with the
time left (:func:`describe`). Without the variable they are plain ``tqdm`` bars and no-ops.

The file holds ``{"phase": {label, index, total, started, time}, "bar": {desc, n, total, unit,
rate, elapsed, time}}``; nothing else reads it, and a reader that finds it half-written or absent
shows nothing.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

#: environment variable naming the progress file (set by ``wavesurf reproduce`` for its kernels)
ENV = "WAVESURF_PROGRESS_FILE"
#: the least time between two writes of the file by one process
MIN_INTERVAL_S = 2.0

_state: dict[str, Any] = {}
_last_write = [0.0]


def _target() -> Path | None:
    path = os.environ.get(ENV)
    return Path(path) if path else None


def _due(force: bool = False) -> bool:
    """Whether a write would happen now (a file is named and the last write is old enough)."""
    return _target() is not None and (force or time.time() - _last_write[0] >= MIN_INTERVAL_S)


def _write(force: bool = False) -> None:
    """Write the state to the progress file (throttled; errors ignored: progress never breaks a run)."""
    if not _due(force):
        return
    path = _target()
    _last_write[0] = time.time()
    try:
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_state))
        os.replace(tmp, path)
    except OSError:
        pass


def phase(label: str, index: int, total: int) -> None:
    """Announce step ``index`` (1-based) of ``total`` of a long piece of work, e.g. ("train and
    score heads", 12, 33); the reader estimates the time left from the steps done so far."""
    now = time.time()
    first = _state.get("phase", {})
    started = first.get("started", now) if first.get("label") == label and index > 1 else now
    _state["phase"] = {"label": label, "index": int(index), "total": int(total), "started": started, "time": now}
    _state.pop("bar", None)
    _write(force=True)


def progress_bar(*args: Any, **kwargs: Any) -> Any:
    """A ``tqdm.auto`` bar (same keyword arguments) that also reports to the progress file."""
    from tqdm.auto import tqdm

    class ReportingBar(tqdm):  # type: ignore[misc, valid-type]
        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            self._report()
            return out

        def close(self) -> None:
            self._report(force=True)
            super().close()

        def _report(self, force: bool = False) -> None:
            # nothing to do without a file, for a bar the caller disabled, or before the next write is
            # due: a bar updates every step, so its state is built only when it is written
            if getattr(self, "disable", True) or not _due(force):
                return
            fmt = self.format_dict
            elapsed = fmt.get("elapsed")
            rate = fmt.get("rate") or (self.n / elapsed if elapsed else None)
            _state["bar"] = {"desc": self.desc or "", "n": float(self.n), "total": self.total, "unit": self.unit,
                             "rate": rate, "elapsed": elapsed, "time": time.time()}
            _write(force)

    return ReportingBar(*args, **kwargs)


def read(path: Path) -> dict[str, Any] | None:
    """The progress file's state, or None where it is absent or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _fmt(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def remaining_seconds(state: dict[str, Any], now: float | None = None) -> float | None:
    """Seconds left in the announced phase: the mean time of its finished steps times the steps
    not yet finished, less what the current step's bar says is done; None before one step finished."""
    now = time.time() if now is None else now
    ph = state.get("phase")
    if not ph or ph["index"] < 2:
        return None
    per_step = (ph["time"] - ph["started"]) / (ph["index"] - 1)
    left = per_step * (ph["total"] - ph["index"] + 1) - (now - ph["time"])
    return max(0.0, left)


def describe(state: dict[str, Any] | None, now: float | None = None) -> str:
    """One line for the terminal: the phase (step i of n, time left) and the current bar."""
    if not state:
        return ""
    now = time.time() if now is None else now
    parts = []
    ph = state.get("phase")
    if ph:
        left = remaining_seconds(state, now)
        parts.append(f"{ph['label']} {ph['index']}/{ph['total']}" + (f", ~{_fmt(left)} left" if left is not None else ""))
    bar = state.get("bar")
    if bar:
        total, n, rate = bar.get("total"), bar.get("n", 0), bar.get("rate")
        text = f"{bar.get('desc') or 'working'}: {n:,.0f}" + (f"/{total:,.0f}" if total else "") + f" {bar.get('unit') or ''}"
        if total and rate:
            text += f" ({_fmt((total - n) / rate)} left)"
        parts.append(text.strip())
    return "; ".join(parts)


__all__ = ["ENV", "describe", "phase", "progress_bar", "read", "remaining_seconds"]
