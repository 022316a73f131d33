"""``textstats`` command line: ``python3 -m textstats [--top N] [--json] FILE...``."""

from __future__ import annotations

import argparse
import json
import sys

from textstats.core import Stats, analyze, merge, top_words


def _read(name: str) -> str:
    if name == "-":
        return sys.stdin.read()
    with open(name, encoding="utf-8", errors="replace") as f:
        return f.read()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="textstats", description="Line, word and character counts.")
    p.add_argument("files", nargs="*", default=["-"], help="files to read ('-' is stdin)")
    p.add_argument("--top", type=int, default=0, metavar="N", help="also list the N most frequent words")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.top < 0:
        print("textstats: --top must be >= 0", file=sys.stderr)
        return 2
    texts: dict[str, str] = {}
    for name in args.files:
        try:
            texts[name] = _read(name)
        except OSError as e:
            print(f"textstats: {name}: {e.strerror}", file=sys.stderr)
            return 1
    per_file = {name: analyze(text) for name, text in texts.items()}
    total: Stats = merge(per_file.values())
    top = top_words("\n".join(texts.values()), args.top) if args.top else []

    if args.json:
        out = {"files": {n: s.as_dict() for n, s in per_file.items()}, "total": total.as_dict()}
        if args.top:
            out["top"] = [[w, c] for w, c in top]
        print(json.dumps(out, sort_keys=True))
        return 0
    for name, s in per_file.items():
        print(f"{s.lines:7d} {s.words:7d} {s.chars:7d} {name}")
    if len(per_file) > 1:
        print(f"{total.lines:7d} {total.words:7d} {total.chars:7d} total")
    for word, count in top:
        print(f"{count:7d} {word}")
    return 0
