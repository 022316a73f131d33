"""envbuild.build."""
