#!/usr/bin/env bash
# Lint: `ruff check` over the Python code, with the rules of pyproject.toml's [tool.ruff].
# Installs the pinned ruff into the venv when it is missing or another version (idempotent:
# a second run installs nothing). Environment: RESHARD_VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${RESHARD_VENV:-$ROOT/.venv}
RUFF_VERSION=0.17.6
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if [ "$("$VENV/bin/ruff" --version 2>/dev/null || true)" != "ruff $RUFF_VERSION" ]; then
  echo "lint: installing ruff $RUFF_VERSION into $VENV"
  "$VENV/bin/pip" install -q "ruff==$RUFF_VERSION"
fi
echo "== ruff check (python/ tests/ bench/ scripts/ recipes/)"
"$VENV/bin/ruff" check python/ tests/ bench/ scripts/ recipes/
