"""The version of envbuild: one copy (the package, the CLI, pyproject and error reports read it)."""

__version__ = "0.1.0"
