#!/usr/bin/env bash
# The SWE-bench-shaped example (envdefs/examples/swe, issue 17): fetch the projects' sdists from
# PyPI, build every layer missing from ./cache (debian-bookworm is the same key as scripts/main.sh's,
# so after main.sh the debootstrap is skipped and the rest builds in ~5 min here), run each
# project's real test suite in a sandbox of its task env, run the agent in one, then (unless
# COUNTS=0) measure the rebuild counts and bytes against the per-instance image scheme
# (rebuild_counts.py, ~5-10 more minutes; DOCKER=1 adds the same chain built by docker build).
# The base is a Dockerfile base (apt-get in a private dockerd): needs docker.io (setup.sh).
# Not part of main.sh: it roughly triples its time.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SKIP_SETUP:-}" ] || bash scripts/setup.sh
step() { printf '\n== %s\n' "$*"; }
eb() { .venv/bin/envbuild --defs envdefs/examples/swe "$@"; }

step "fetch the sdists (pip download --no-binary :all:, sha256-checked)"
PIP=.venv/bin/pip bash envdefs/examples/swe/fetch-sdists.sh
step "validate and show the example's graph"
eb validate envdefs/examples/swe
eb graph
step "build what is missing from ./cache and lock the six task envs"
eb build --jobs 2
step "run each project's own test suite (pytest) in a sandbox of its task env, two at a time"
eb check --jobs 2
step "run the agent in a fresh sandbox of one task"
eb run task-toolz-1.0.0 -- sh -c 'swe-agent --version && swe-agent survey /workspace'
if [ "${COUNTS:-1}" != 0 ]; then
  step "rebuild counts and bytes: envbuild vs the per-instance image scheme (both built now)"
  # DOCKER=1: also build the per-instance chain as Dockerfiles with docker build (same run)
  .venv/bin/python envdefs/examples/swe/rebuild_counts.py --seed-store cache ${DOCKER:+--docker}
fi
