"""Moved to ``envbuild.hints`` (issue 38): ``envbuild.layers`` needs it too and must not import
``envbuild.defs``. This name stays for the definition loader's imports."""

from envbuild.hints import closest as closest
from envbuild.hints import suggest as suggest
