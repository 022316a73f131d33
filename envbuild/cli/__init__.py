"""envbuild.cli."""
