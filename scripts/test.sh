#!/usr/bin/env bash
# The test command: set up (apt + .venv), lint, type-check, then run the whole suite. CI runs exactly this.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lint and type-check first (pyproject.toml [tool.ruff], [tool.mypy]: the public SDK): either
# failing fails the run before the tests.
.venv/bin/python -m ruff check .
.venv/bin/python -m mypy --cache-dir "${TMPDIR:-/tmp}/envbuild-mypy-cache"
exec .venv/bin/python -m pytest "$@"
