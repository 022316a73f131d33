#!/usr/bin/env bash
# The test command: set up (apt + .venv), then run the whole suite. CI runs exactly this.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
