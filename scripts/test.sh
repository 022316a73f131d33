#!/usr/bin/env bash
# The test command: set up (apt + .venv), lint, then run the whole suite. CI runs exactly this.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lint first (rules in pyproject.toml [tool.ruff]): a lint error fails the run before the tests.
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest "$@"
