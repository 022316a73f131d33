#!/bin/sh
# Run every tests/test_*.sh with `sh` (or $SHELL_UNDER_TEST, e.g. "busybox sh"); exit 1 if any failed.
here=$(cd "$(dirname "$0")" && pwd)
sh=${SHELL_UNDER_TEST:-sh}
passed=0 failed=0
for t in "$here"/test_*.sh; do
  if $sh "$t"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAILED: $t" >&2; fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
