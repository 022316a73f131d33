#!/bin/sh
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/tests/assert.sh"
kv="$root/bin/kv"
setup_store

assert_eq 0 "$("$kv" count)" "empty store"
"$kv" set colour blue
"$kv" set size "extra large"
assert_eq blue "$("$kv" get colour)"
assert_eq "extra large" "$("$kv" get size)" "values keep spaces"
assert_eq 2 "$("$kv" count)"

"$kv" set colour red
assert_eq red "$("$kv" get colour)" "set overwrites"
assert_eq 2 "$("$kv" count)" "overwrite does not add a line"

"$kv" del colour
assert_status 1 "$kv" get colour
assert_eq 1 "$("$kv" count)"
echo "ok test_basic"
