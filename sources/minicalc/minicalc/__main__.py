"""``python3 -m minicalc [EXPR...]``: evaluate arguments in order, or stdin lines."""

from __future__ import annotations

import sys

from minicalc.errors import CalcError
from minicalc.evaluator import Interpreter


def _fmt(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    lines = argv or [ln for ln in sys.stdin.read().splitlines() if ln.strip()]
    interp = Interpreter()
    status = 0
    for line in lines:
        try:
            print(_fmt(interp.run(line)))
        except CalcError as e:
            print(f"minicalc: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
