#!/usr/bin/env bash
# Builds CRIU from Debian's own source package into /usr/local/sbin/criu when the CRIU of
# Debian 12 (3.17.1) cannot run on this kernel: Linux >= 6.13 split the vDSO data mapping
# ([vvar] + [vvar_vclock]) and CRIU 3.17 fails in `criu check` with
#   Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds
# (fixed in CRIU 4.1); kernel >= 6.16 refuses SO_PASSCRED on inet sockets, which CRIU < 4.2
# dumps for every socket (fixed in 4.2). The source comes from Debian unstable's source
# archive through apt, with a private sources list (nothing of the system's apt config
# changes). Idempotent: does nothing when a working CRIU is already installed.
set -euo pipefail

TARGET=${CRIU_TARGET:-/usr/local/sbin/criu}  # CRIU_TARGET: for trying the script
works() { [ -x "$1" ] && "$1" check >/dev/null 2>&1 && "$1" --version | grep -Eq 'Version: (4\.([2-9]|[1-9][0-9])|[5-9])'; }
if works "$TARGET"; then exit 0; fi

work=$(mktemp -d /tmp/envbuild-criu.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial"
echo "deb-src http://deb.debian.org/debian sid main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists")
echo "build-criu: fetching CRIU's source from Debian unstable"
apt-get "${apt_opts[@]}" update -qq
(cd "$work" && apt-get "${apt_opts[@]}" source --download-only criu >/dev/null 2>&1 || true)
orig=$(ls "$work"/criu_*.orig.tar.* 2>/dev/null | head -1)
if [ -z "$orig" ]; then
  echo "build-criu: no CRIU source found in Debian's archive" >&2
  exit 1
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf \
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev libaio-dev pkg-config gcc make >/dev/null
tar -C "$work" -xf "$orig"
src=$(ls -d "$work"/criu-*/ | head -1)
echo "build-criu: building $(basename "$src") (a few minutes)"
make -C "$src" -j"$(nproc)" criu >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
install -m 0755 "$src/criu/criu" "$TARGET"
works "$TARGET" || { echo "build-criu: the built CRIU fails 'criu check'" >&2; "$TARGET" check >&2 || true; exit 1; }
echo "build-criu: installed $("$TARGET" --version | head -1) at $TARGET"
