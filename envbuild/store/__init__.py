"""envbuild.store."""
