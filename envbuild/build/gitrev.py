"""The definition tree as it was at a git revision, without touching the working tree.

``envbuild plan --changed-since REV`` and ``envbuild explain --against REV`` compare keys at REV
with keys now. Path sources often live outside ``envdefs/`` (``sources/``), so the *whole*
repository is materialised at REV in a temporary directory and the defs dir is loaded from the
same relative path inside it.

How: ``git read-tree REV`` into a temporary index file (``GIT_INDEX_FILE``), then
``git checkout-index --prefix=TMP/``. This is a real checkout — files get the modes a fresh clone
would get under the current umask, and smudge/eol filters apply — so an unchanged file hashes
the same as in the working tree. (``git archive`` writes modes with its own ``tar.umask``, 0664,
which would make every path source look changed.) The repository's own index, working tree and
``.git/worktrees`` are never touched.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

from envbuild.build.pin import Pinner, git_env, snapshot
from envbuild.defs.parsecache import ParseCache
from envbuild.errors import EnvbuildError, PlanError, Problem, SourceError
from envbuild.plan.changes import Changes, Explanation, diff_keys, explain
from envbuild.plan.graph import did_you_mean
from envbuild.plan.keys import KeySet
from envbuild.plan.planner import BuildPlan, Lookup, make_plan


def _git(argv: list[str], cwd: str, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True,
                              env={**git_env(), **(env or {})}, check=False)
    except FileNotFoundError:
        raise SourceError("git is not installed", hint="apt-get install git") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise SourceError(f"git {argv[0]} exited {done.returncode}", context=tail)
    return done.stdout


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.is_dir():
        path = path.parent
    return path


@contextlib.contextmanager
def checkout(path: Path, rev: str) -> Iterator[tuple[Path, Path]]:
    """Yield (root of a temporary checkout of ``rev``, where ``path`` is inside it).

    ``path`` must be inside a git work tree; where it is at ``rev`` may not exist.
    """
    here = _existing_ancestor(path)
    try:
        top = _git(["rev-parse", "--show-toplevel"], str(here)).strip()
    except SourceError as e:
        raise SourceError(f"{path} is not inside a git repository",
                          hint="--changed-since/--against need the definitions in git") from e
    rel = os.path.relpath(os.path.realpath(path.absolute()), os.path.realpath(top))
    try:
        commit = _git(["rev-parse", "--verify", "--quiet", "--end-of-options",
                       f"{rev}^{{commit}}"], top).strip()
    except SourceError:
        raise SourceError(f"unknown git revision {rev!r}",
                          hint="give a commit, branch or tag, e.g. HEAD~1 or origin/main") from None
    with tempfile.TemporaryDirectory(prefix="envbuild-rev-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        tree = os.path.join(tmp, "tree")
        _git(["read-tree", "--end-of-options", commit], top, env)
        _git(["checkout-index", "--all", "--force", f"--prefix={tree}/"], top, env)
        yield Path(tree), Path(tree) / rel


def keys_at_revision(defs_dir: Path, rev: str, pinner: Pinner | None = None,
                     parse_cache: ParseCache | None = None) -> KeySet:
    """Every key of ``defs_dir`` as it was at git revision ``rev``.

    A defs dir that did not exist at ``rev`` has no keys: everything is new.
    """
    with checkout(defs_dir, rev) as (root, then):
        if not then.is_dir():
            empty = MappingProxyType({})
            return KeySet(layers=empty, inputs=empty, env_locks=empty, env_inputs=empty)
        try:
            return snapshot(then, pinner, parse_cache).keys
        except EnvbuildError as e:
            # Report against the revision, not the temporary directory it was checked out to.
            lines = [ln.replace(f"{root}{os.sep}", f"{rev}:") for ln in e.render_lines()]
            raise SourceError(f"the definitions at {rev} cannot be keyed",
                              context="\n".join(lines),
                              hint="compare against a revision whose definitions are valid") from e


# ---------------------------------------------------------------------- what the CLI calls


def plan_changes(defs_dir: Path, targets: list[str] | None, rev: str | None,
                 lookup: Lookup | None = None, pinner: Pinner | None = None,
                 parse_cache: ParseCache | None = None) -> tuple[BuildPlan, Changes | None]:
    """Plan ``targets`` of ``defs_dir`` now and, given ``rev``, what changed since then.

    With targets, the changes are limited to the planned layers and envs. ``parse_cache``:
    only files it does not know are parsed, in either tree (the two share all but the
    changed files), and it is saved at the end (``envbuild.defs.parsecache``).
    """
    pinner = pinner or Pinner()
    now = snapshot(defs_dir, pinner, parse_cache)
    plan = make_plan(now.graph, now.pinned, lookup, targets, keys=now.keys)
    if rev is None:
        if parse_cache is not None:
            parse_cache.save()
        return plan, None
    changes = diff_keys(keys_at_revision(defs_dir, rev, pinner, parse_cache), now.keys)
    if parse_cache is not None:
        parse_cache.save()
    if targets is not None:
        layers = {s.name for s in plan.layers}
        envs = {e.name for e in plan.envs}
        changes = Changes(rebuild=tuple(n for n in changes.rebuild if n in layers),
                          relock=tuple(n for n in changes.relock if n in envs))
    return plan, changes


def explain_at(defs_dir: Path, name: str, rev: str | None = None) -> Explanation:
    """Explain ``name`` (a definition name, or a layer key) now and, given ``rev``, since then."""
    pinner = Pinner()
    now = snapshot(defs_dir, pinner)
    by_name = now.defs.by_name
    if name not in by_name and name.startswith("sha256:"):
        named = sorted(n for n, k in now.keys.layers.items() if k.startswith(name))
        name = named[0] if named else name
    if name not in by_name:
        raise PlanError(Problem("<command line>", 0, 0, f"no definition or key {name!r}",
                                hint=did_you_mean(name, by_name)))
    old = keys_at_revision(defs_dir, rev, pinner) if rev is not None else None
    return explain(name, by_name[name].kind, now.keys, old)
