#!/usr/bin/env bash
# Installs everything envbuild needs on a fresh Debian 12 machine (run as root or with sudo):
# the apt tools it drives, CRIU, and a virtualenv in .venv with envbuild, its test extra,
# Ray (the fleet extra) and mini-swe-agent (the harness extra). Idempotent and quick when
# everything is already there.
#
# `--fast`: only what the fast test tier needs (`scripts/test.sh --fast`, docs/testing.md), for
# any user, no root: no apt, no CRIU; .venv with envbuild and its test extra (from PyPI, or the
# index pip is configured with) when it is missing or older than pyproject.toml, else nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  "") fast=0 ;;
  --fast) fast=1 ;;
  *) echo "usage: scripts/setup.sh [--fast]" >&2; exit 2 ;;
esac

# fuse3 and fuse2fs: a microVM's pack-diff reads its writable disk through fuse2fs (a FUSE
# filesystem, runtime_shim/backends/vm/erofs.py); lazy layers use no FUSE.
APT_PACKAGES=(
  python3 python3-venv python3-dev gcc libc6-dev git tar zstd attr
  runc busybox-static debootstrap skopeo umoci fuse3 erofs-utils docker-registry apache2-utils
  podman containerd docker.io
  linux-image-cloud-amd64 qemu-system-x86 e2fsprogs fuse2fs lz4 btrfs-progs
  slirp4netns iptables iproute2 util-linux criu less
)

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_tools() {
  local missing=() pkg
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing apt packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # CRIU for checkpoints with memory: Debian 12's 3.17 cannot run on kernels >= 6.13, so a newer
  # one is built from Debian's own source package (scripts/build-criu.sh; quick once installed)
  as_root bash scripts/build-criu.sh || echo "setup: warning: no working CRIU (checkpoint tests will fail)"
}

# A stamp per install: .envbuild-installed for the full one ([test,fleet,harness,serve]), which also serves
# the fast tier; .envbuild-installed-test for the fast one ([test]: no Ray).
fresh() { [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ]; }

install_venv() {  # $1: the extras, $2: the stamp that says they are installed
  local python=${PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    command -v "$python" >/dev/null || {
      echo "setup: no $python on PATH (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || {
      echo "setup: envbuild needs Python >= 3.11; $python is" \
           "$("$python" --version 2>&1 | head -1) (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
    echo "setup: creating .venv with $("$python" --version)"
    "$python" -m venv .venv
  fi
  if ! fresh "$2"; then
    echo "setup: installing envbuild and its $1 dependencies into .venv"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[$1]"
    touch "$2"
  fi
}

if [ "$fast" = 1 ]; then
  fresh .venv/.envbuild-installed || install_venv test .venv/.envbuild-installed-test
else
  install_tools
  install_venv test,fleet,harness,serve .venv/.envbuild-installed
fi
