# Assertion helpers for the test_*.sh scripts. Each failure prints and exits 1.

fail() { echo "FAIL: $*" >&2; exit 1; }

assert_eq() {  # EXPECTED ACTUAL [MESSAGE]
  [ "$1" = "$2" ] || fail "${3:-values differ}: expected '$1', got '$2'"
}

assert_status() {  # EXPECTED_STATUS COMMAND...
  want=$1; shift
  set +e; "$@" > /dev/null 2>&1; got=$?; set -e
  [ "$got" -eq "$want" ] || fail "'$*' exited $got, expected $want"
}

# A fresh store for each test script.
setup_store() {
  KV_FILE=$(mktemp "${TMPDIR:-/tmp}/kvtest.XXXXXX")
  rm -f "$KV_FILE"
  export KV_FILE
  trap 'rm -f "$KV_FILE" "$KV_FILE".*' EXIT
}
