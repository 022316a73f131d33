#!/usr/bin/env bash
# Installs everything envbuild needs on a fresh Debian 12 machine (run as root or with sudo):
# the apt tools it drives and a virtualenv in .venv with envbuild and its test extra.
# Idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  python3 python3-venv python3-dev gcc libc6-dev git tar zstd attr
  runc busybox-static debootstrap skopeo umoci fuse3 erofs-utils docker-registry apache2-utils
  podman containerd docker.io
  linux-image-cloud-amd64 qemu-system-x86 e2fsprogs fuse2fs lz4
  slirp4netns iptables iproute2 util-linux criu
)

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
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

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.envbuild-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing envbuild and its test dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test,fleet]'
  touch "$stamp"
fi
