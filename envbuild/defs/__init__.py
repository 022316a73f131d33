"""envbuild.defs."""
