#!/usr/bin/env bash
# The test command (tiers: docs/testing.md). Lint and type-check first, then the tests.
#   bash scripts/test.sh          the whole suite, after scripts/setup.sh (apt, CRIU, .venv; root).
#                                 CI (.ci/run) runs exactly this.
#   bash scripts/test.sh --fast   the fast tier (`-m fast`) for the edit-test loop: any user, no
#                                 root, no apt, no network once .venv exists (`setup.sh --fast`
#                                 makes it from PyPI the first time).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`,
# `bash scripts/test.sh --fast -x -k walk`.
set -euo pipefail
cd "$(dirname "$0")/.."
select=()
if [ "${1:-}" = --fast ]; then
  shift
  bash scripts/setup.sh --fast
  select=(-m fast)
else
  bash scripts/setup.sh
fi
# Lint and type-check (pyproject.toml [tool.ruff], [tool.mypy]): either failing fails the run
# before the tests. The mypy cache is per user: another user's is not writable.
.venv/bin/python -m ruff check .
.venv/bin/python -m mypy --cache-dir "${TMPDIR:-/tmp}/envbuild-mypy-cache-$(id -u)"
exec .venv/bin/python -m pytest "${select[@]}" "$@"
