#!/usr/bin/env bash
# Download the sdists the SWE example's instances unpack (sdists.txt: NAME==VERSION SHA256)
# into sdists/ with pip (from PyPI, source distributions only), and check each sha256.
# Idempotent: a file already there with the right digest is kept.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pip="${PIP:-$here/../../../.venv/bin/pip}"
[ -x "$pip" ] || pip="$(command -v pip3)"
mkdir -p "$here/sdists"
grep -v '^#' "$here/sdists.txt" | while read -r spec sha; do
  name="${spec%%==*}"; version="${spec##*==}"
  file="$here/sdists/$name-$version.tar.gz"
  if ! { [ -f "$file" ] && echo "$sha  $file" | sha256sum -c --quiet - 2>/dev/null; }; then
    tmp="$(mktemp -d)"
    "$pip" download -q --no-deps --no-binary :all: -d "$tmp" "$spec"
    mv "$tmp"/*.tar.gz "$file"
    rm -rf "$tmp"
  fi
  echo "$sha  $file" | sha256sum -c --quiet -
  echo "ok $name $version"
done
