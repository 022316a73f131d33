#!/usr/bin/env bash
# The main job: set up (apt + .venv), then build every example definition in envdefs/ into the
# local store ./cache (a Debian bookworm base via debootstrap included), lock every env, run
# each workspace's checks, and run a command in a sandbox of an example env.
#
# A second run builds nothing: every layer is a cache hit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
eb() { .venv/bin/envbuild "$@"; }
step() { printf '\n== %s\n' "$*"; }

step "validate the definitions"
eb validate
step "the definition graph"
eb graph
step "build every layer that is missing from ./cache and lock every env"
eb build
step "run every workspace's checks in a sandbox of each env that uses it"
eb check
step "run a command in a fresh sandbox of py-textstats (no network, dropped capabilities)"
eb run py-textstats -- sh -c 'python3 -c "import sys, textstats; print(\"python\", sys.version.split()[0], \"textstats ok\")" && pytest -q -p no:cacheprovider /workspace/tests 2>&1 | tail -1'
