#!/bin/sh
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/tests/assert.sh"
kv="$root/bin/kv"
setup_store

assert_status 2 "$kv"
assert_status 2 "$kv" frobnicate
assert_status 2 "$kv" set "bad key" x
assert_status 2 "$kv" set "" x
assert_status 2 "$kv" set k "$(printf 'a\tb')"
assert_status 2 "$kv" set k "$(printf 'a\nb')"
assert_status 1 "$kv" get missing
assert_status 1 "$kv" del missing
assert_eq 0 "$("$kv" count)" "failed commands leave the store empty"
echo "ok test_errors"
