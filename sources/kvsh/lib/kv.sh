# kv.sh: functions behind bin/kv. Source it; every function reads KV_FILE (default ./.kv).

TAB=$(printf '\t')

kv_usage() {
  echo "usage: kv set KEY VALUE | get KEY | del KEY | list | count" >&2
  exit 2
}

kv_file() { printf '%s\n' "${KV_FILE:-./.kv}"; }

kv_check_key() {
  case $1 in
    ''|*[!A-Za-z0-9_.-]*) echo "kv: invalid key: '$1'" >&2; return 2 ;;
  esac
}

kv_check_value() {
  case $1 in
    *"$TAB"*) echo "kv: value must not contain a tab" >&2; return 2 ;;
  esac
  # A newline inside the value would split the record.
  if [ "$(printf '%s' "$1" | wc -l)" -ne 0 ]; then
    echo "kv: value must not contain a newline" >&2; return 2
  fi
}

# Print every line of the store except the one for key $1.
_kv_without() {
  f=$(kv_file)
  [ -f "$f" ] || return 0
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in "$1$TAB"*) ;; *) printf '%s\n' "$line" ;; esac
  done < "$f"
}

# Replace the store atomically with stdin.
_kv_replace() {
  f=$(kv_file)
  tmp=$(mktemp "$f.XXXXXX")
  cat > "$tmp"
  mv "$tmp" "$f"
}

kv_set() {
  kv_check_key "$1" || return
  kv_check_value "$2" || return
  { _kv_without "$1"; printf '%s\t%s\n' "$1" "$2"; } | _kv_replace
}

kv_get() {
  kv_check_key "$1" || return
  f=$(kv_file)
  [ -f "$f" ] || return 1
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in "$1$TAB"*) printf '%s\n' "${line#*"$TAB"}"; return 0 ;; esac
  done < "$f"
  return 1
}

kv_del() {
  kv_check_key "$1" || return
  kv_get "$1" > /dev/null || return 1
  _kv_without "$1" | _kv_replace
}

kv_list() {
  f=$(kv_file)
  [ -f "$f" ] || return 0
  LC_ALL=C sort "$f"
}

kv_count() {
  f=$(kv_file)
  if [ -f "$f" ]; then grep -c . "$f" || true; else echo 0; fi
}
