"""Where the paths a definition names may lead: the source root and the trusted directories.

A definition is hostile input: every path it names on the host (``copy.src``, a workspace's
``path``, ``archive`` and local ``git`` sources, a base's ``rootfs``, ``oci`` layout, ``busybox``
binary and Dockerfile context) must resolve, symlinks followed, inside the *source root* (the
parent of the definitions directory) or inside a directory the one running the build trusts
(``--trust-sources DIR``, ``ENVBUILD_TRUSTED_SOURCES``; ``envbuild.settings.trusted_sources``).

This is a fact about definitions, shared by the loader (which reads a Dockerfile base's
``FROM`` lines, ``envbuild.defs.dockerfile``) and pinning (``envbuild.build.pin``), so it lives
here, below both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from envbuild.settings import TRUSTED_SOURCES_ENV


class Unpinnable(Exception):
    """One source a definition names that cannot be used (outside the source root, unreadable,
    a Dockerfile that cannot be parsed, …); pinning turns it into a ``SourceError`` at the
    definition's line."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


def source_root(defs_root: str | os.PathLike[str]) -> str:
    """The directory every source a definition names must stay in: the parent of the
    definitions directory (symlinks resolved)."""
    return os.path.dirname(os.path.realpath(defs_root))


def source_roots(defs_root: str | os.PathLike[str], trusted: Sequence[str] = ()) -> tuple[str, ...]:
    """The source root of ``defs_root``, then the ``trusted`` directories (symlinks resolved):
    the directories ``confined_path`` accepts."""
    return (source_root(defs_root), *(os.path.realpath(t) for t in trusted))


def within(real: str, root: str) -> bool:
    """Whether the resolved path ``real`` is ``root`` or below it."""
    return real == root or real.startswith(root.rstrip("/") + "/")


def confined_path(roots: tuple[str, ...], base_dir: str, rel: str) -> str:
    """``rel`` (against ``base_dir``) with every symlink resolved, if that is inside one of
    ``roots`` (``source_roots``: the source root first); else ``Unpinnable``. Used for every
    path a definition names on the host."""
    real = os.path.realpath(os.path.join(base_dir, rel))
    if not any(within(real, root) for root in roots):
        raise Unpinnable(f"{rel} resolves to {real}, outside the source root {roots[0]}",
                         "sources must stay inside the repository holding the definitions "
                         "(the parent of the definitions directory); to build a trusted tree "
                         f"that reads {real}, name a directory holding it with --trust-sources "
                         f"DIR or {TRUSTED_SOURCES_ENV}")
    return real
