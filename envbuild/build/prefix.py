"""What a toolkit layer may hold: files under its prefix only (checked on its upper dir)."""

from __future__ import annotations

import os
from pathlib import Path

from envbuild.errors import BuildError


def check_toolkit_prefix(name: str, upper: Path, prefix: str) -> None:
    """A toolkit layer may only hold files under its prefix (and the directories leading to it);
    deleting or changing anything else would break the envs it is stacked into."""
    prefix = "/" + prefix.strip("/")
    offending: list[str] = []
    todo = ["/"]  # iterative: a build step's 4096-deep tree costs no recursion
    while todo:
        rel_dir = todo.pop()
        base = rel_dir.rstrip("/")
        with os.scandir(f"{upper}{base}") as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        if rel_dir != "/" and not (rel_dir == prefix or rel_dir.startswith(prefix + "/")
                                   or prefix.startswith(rel_dir + "/")) and not entries:
            offending.append(rel_dir)  # an empty directory outside the prefix
        for n, is_dir in entries:
            path = f"{base}/{n}"
            if is_dir:
                todo.append(path)
            elif not (path == prefix or path.startswith(prefix + "/")):
                offending.append(path)  # files, symlinks (to dirs too) and devices
        # Directories are copied up as ancestors of what changed inside them: report the
        # files they hold, not the directories themselves.
    if offending:
        shown = ", ".join(sorted(offending)[:20])
        more = f" and {len(offending) - 20} more" if len(offending) > 20 else ""
        raise BuildError(f"toolkit {name} wrote outside its prefix {prefix}: {shown}{more}",
                         hint="clean up in the same step (apt lists, caches, /root) or widen prefix")
