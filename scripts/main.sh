#!/usr/bin/env bash
# The main job: set up (apt + .venv), then validate the example definitions, print their graph
# and the build plan. Later issues extend this to build every layer into ./cache and run a
# command in a sandbox; this script always does everything that works today.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
eb() { .venv/bin/envbuild "$@"; }
set -x
eb validate
eb graph
eb plan
