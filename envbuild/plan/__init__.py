"""envbuild.plan."""
