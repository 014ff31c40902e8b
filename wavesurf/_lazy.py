"""Module-level ``__getattr__`` for packages whose public names are imported on first use (so that
``wavesurf --help`` does not load torch)."""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any


def lazy_getattr(package: str, public: dict[str, str], namespace: dict[str, Any], name: str) -> Any:
    """``name`` from the submodule ``public`` maps it to (cached in ``namespace``), or the submodule
    ``package.name`` itself; AttributeError otherwise."""
    if name in public:
        value = getattr(importlib.import_module(f".{public[name]}", package), name)
        namespace[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f".{name}", package)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
