"""A git workspace's ``.git`` (``source: {git: …, dotgit: true}``): the pinned commit and
nothing else an agent could read a later fix from.

What the layer gets below ``dest/.git`` (every byte a function of the commit's objects):

- ``HEAD`` (``ref: refs/heads/main``) and ``refs/heads/main`` (the commit): no remote, no
  other branch, no tag, no reflog (``logs/``), no hooks, no ``packed-refs``, no FETCH_HEAD;
- ``config``: ``repositoryformatversion``, ``filemode``, ``bare`` (and ``objectformat`` for a
  SHA-256 repository), nothing from the host's or the source's config;
- ``objects/pack/pack-<hash>.{pack,idx}``: exactly the objects reachable from the commit
  (its tree and blobs; the fetch is ``--depth=1`` into a scratch repository and only
  ``rev-list --objects COMMIT`` is packed, so no object of another commit, not even an
  unreachable one, can be read from the files), written with fixed settings (one thread, no
  deltas, no reused data from the fetched pack, compression 9, no reverse index);
- ``shallow`` (the commit) when the commit has parents, so ``git log`` stops there;
- ``index``: the commit's tree as ``git read-tree`` writes it, with zero stat data: git
  treats such entries as unknown and compares contents on the first ``git status`` or
  ``git diff`` (the state right after ``read-tree``), so the index does not depend on the
  build's inodes, times or owners, and the working tree reads clean.

The working tree is still the ``git archive`` of the commit, with ``export-subst`` and
``export-ignore`` turned off (``info/attributes`` of the scratch repository): what a checkout
holds, so ``git status`` is clean.
"""

from __future__ import annotations

import io
import os
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

#: The branch HEAD points at in a shipped ``.git``.
BRANCH = "main"

#: Overrides the tree's ``.gitattributes`` for ``git archive``: the working tree must equal a
#: checkout (``export-subst`` would rewrite files, ``export-ignore`` drop them).
ARCHIVE_ATTRIBUTES = "* -export-subst -export-ignore\n"

#: Settings of ``git pack-objects`` that fix the pack's bytes for given objects.
PACK_ARGS = ("pack-objects", "-q", "--revs", "--threads=1", "--window=0", "--depth=0",
             "--no-reuse-delta", "--no-reuse-object", "--compression=9")

#: Config of every git run here: nothing from the host (system, global) may change the bytes.
NO_HOST_CONFIG = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
                  "HOME": os.devnull, "XDG_CONFIG_HOME": os.devnull}


def config_text(commit: str) -> str:
    """The shipped ``config``: the minimum git needs; a 64-digit id means SHA-256 objects."""
    if len(commit) == 64:
        return ("[core]\n\trepositoryformatversion = 1\n\tfilemode = true\n\tbare = false\n"
                "[extensions]\n\tobjectformat = sha256\n")
    return "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"


def has_parents(commit_text: str) -> bool:
    """The raw commit (``git cat-file commit``) names a parent: the history is cut there."""
    header = commit_text.split("\n\n", 1)[0]
    return any(line.startswith("parent ") for line in header.splitlines())


def commit_time(commit_text: str) -> int:
    """The committer time of a raw commit (what ``git archive`` gives its members)."""
    header = commit_text.split("\n\n", 1)[0]
    for line in header.splitlines():
        if line.startswith("committer "):
            return int(line.rsplit(" ", 2)[-2])
    return 0


def small_files(commit: str, commit_text: str) -> dict[str, bytes]:
    """The files of the shipped ``.git`` besides its objects and index."""
    files = {"HEAD": f"ref: refs/heads/{BRANCH}\n".encode(),
             f"refs/heads/{BRANCH}": f"{commit}\n".encode(),
             "config": config_text(commit).encode()}
    if has_parents(commit_text):
        files["shallow"] = f"{commit}\n".encode()
    return files


def write_dotgit_tar(dotgit: Path, out: Path, mtime: int) -> None:
    """``dotgit``'s tree as a tar of ``.git/…`` members, sorted, owned by 0:0, directories
    0755, files 0644, every member at ``mtime``: the bytes depend on the contents only."""
    entries: list[tuple[str, Path]] = []
    todo = [dotgit]
    while todo:
        d = todo.pop()
        for e in sorted(d.iterdir()):
            entries.append((e.relative_to(dotgit).as_posix(), e))
            if e.is_dir() and not e.is_symlink():
                todo.append(e)
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_info(".git", tarfile.DIRTYPE, 0o755, 0, mtime))
        for rel, p in sorted(entries):
            if p.is_dir():
                tar.addfile(_info(f".git/{rel}", tarfile.DIRTYPE, 0o755, 0, mtime))
            else:
                data = p.read_bytes()
                tar.addfile(_info(f".git/{rel}", tarfile.REGTYPE, 0o644, len(data), mtime),
                            io.BytesIO(data))


def _info(name: str, kind: bytes, mode: int, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime = kind, mode, size, mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


Run = Callable[..., str]


def build_dotgit(run: Run, scratch_repo: Path, commit: str, out_dir: Path, env: dict[str, str],
                 cancelled: threading.Event | None = None) -> tuple[Path, int]:
    """Write the ``.git`` of ``commit`` (fetched into the bare ``scratch_repo``) to
    ``out_dir/dotgit``; return that path and the commit's time (for the members' mtime).
    ``run`` is ``importers.run_tool``."""
    env = {**env, **NO_HOST_CONFIG}
    dotgit = out_dir / "dotgit"
    (dotgit / "objects" / "pack").mkdir(parents=True)
    (dotgit / "refs" / "heads").mkdir(parents=True)
    raw = run(["git", "-C", str(scratch_repo), "cat-file", "commit", "--end-of-options", commit],
              f"git cat-file {commit[:12]}", env=env)
    for rel, data in small_files(commit, raw).items():
        (dotgit / rel).write_bytes(data)
    revs = out_dir / "revs"
    revs.write_text(f"{commit}\n")
    with open(revs, "rb") as stdin:
        run(["git", "-C", str(scratch_repo), "-c", "pack.writeReverseIndex=false",
             "-c", "pack.indexVersion=2", *PACK_ARGS, str(dotgit / "objects" / "pack" / "pack")],
            f"git pack-objects {commit[:12]}", env=env, stdin=stdin, cancelled=cancelled)
    run(["git", "--git-dir", str(dotgit), "-c", "index.version=2", "-c", "index.skipHash=false",
         "read-tree", "--end-of-options", commit], f"git read-tree {commit[:12]}",
        env={**env, "GIT_INDEX_FILE": str(dotgit / "index")})
    return dotgit, commit_time(raw)
