#!/bin/sh
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/tests/assert.sh"
kv="$root/bin/kv"
setup_store

"$kv" set b 2
"$kv" set a.x 1
"$kv" set c-3 "three"
expected=$(printf 'a.x\t1\nb\t2\nc-3\tthree')
assert_eq "$expected" "$("$kv" list)" "list is sorted"

# A key that is a prefix of another must not match it.
"$kv" set ab prefix
assert_eq 2 "$("$kv" get b)"
"$kv" del a.x
assert_eq prefix "$("$kv" get ab)"
echo "ok test_list"
