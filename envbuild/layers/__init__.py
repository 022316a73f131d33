"""envbuild.layers."""
