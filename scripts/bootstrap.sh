#!/usr/bin/env bash
# Create or update the core venv (.venv): align + its four runtime deps + the test extras.
# Idempotent: does nothing when pyproject.toml and constraints.txt are unchanged since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "align needs Python >= 3.10, found " + sys.version.split()[0])'
stamp=.venv/.align-stamp
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c 'import align, torch' 2>/dev/null; then
    exit 0
fi
echo "[bootstrap] building .venv (torch CPU build pinned by constraints.txt; first run takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[test]'
echo "$want" > "$stamp"
