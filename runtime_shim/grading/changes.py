"""Which of an agent's changes are graded: the change-set filter (pure).

An agent's changes (its sandbox's overlay upper dir, or the snapshot layers it made) are
hostile input: the agent chose every name, mode and byte, knowing they will be graded. The
grader keeps only what a solution is made of and drops the rest, listing each drop with its
reason (``Dropped``), so that **whatever the agent did outside its solution cannot change the
verdict** — the verdict of a change set with a hack equals the verdict of the same change set
without it:

- only entries under the task's ``editable`` paths are kept (and the directories above them,
  without their opaque markers: an agent that deleted and remade ``/workspace`` does not hide
  the env's files there). Everything else is dropped: ``/bin``, ``/usr``, ``/etc``, the
  interpreter and its ``site-packages``, ``/tmp``, caches, the JUnit report path;
- under them, regular files, hardlinks to kept files, directories, deletions (whiteouts) and
  symlinks whose target stays inside the editable paths. Devices and FIFOs never reach here
  (pack-diff's policy drops them, and strips setuid/setgid bits);
- even under them, what configures the test run or the interpreter rather than the code is
  dropped: ``conftest.py``, ``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``
  (unless the task's ``allow`` names the path), ``sitecustomize.py``, ``usercustomize.py``,
  ``*.pth``, compiled caches (``__pycache__``, ``*.pyc``: rebuilt from the graded source),
  anything in a ``.git`` directory (hooks, config, refs: the grading sandbox keeps the env's),
  the hidden test files (and an ``__init__.py`` beside them), the files of the tests the task
  names (``must_pass``, ``keep_passing``), and their deletion;
- a file over ``max_file_bytes`` and files past ``max_total_bytes`` or ``max_entries`` are
  dropped (a huge change set costs the grader its time, not its verdict).

Paths are layer paths (``workspace/pkg/mod.py``, no leading slash) and the task's absolute
paths are compared after stripping their ``/``. Symlink targets are resolved lexically (the
grader never follows a link on any disk).
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from envbuild.layers import Entry
from runtime_shim.node.tasklock import TaskSpec

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
#: test-runner settings: dropped unless the task's ``allow`` names the path
TEST_SETTINGS = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg",
                           "pyproject.toml", "noxfile.py"})
#: run by the interpreter at start-up, before any test
STARTUP_FILES = frozenset({"sitecustomize.py", "usercustomize.py"})
#: the grader lists at most this many drops one by one (the rest are counted)
MAX_LISTED = 500


@dataclasses.dataclass(frozen=True)
class ChangeLimits:
    """Caps of what a change set keeps (defaults: generous for source code)."""

    max_file_bytes: int = 16 << 20
    max_total_bytes: int = 256 << 20
    max_entries: int = 100_000


@dataclasses.dataclass
class Dropped:
    """What the filter dropped: ``listed`` (``{path, reason}``, at most ``MAX_LISTED``) and
    ``more`` (how many drops were not listed)."""

    listed: list[dict[str, str]] = dataclasses.field(default_factory=list)
    more: int = 0
    kept: int = 0
    kept_bytes: int = 0

    def add(self, path: str, reason: str) -> None:
        if len(self.listed) < MAX_LISTED:
            self.listed.append({"path": "/" + path, "reason": reason})
        else:
            self.more += 1

    def add_policy(self, decisions: Iterable[dict[str, str]]) -> None:
        """What pack-diff's policy did to the kept entries (a device or FIFO dropped, setuid
        bits stripped, an attribute dropped), listed like the filter's own drops."""
        for d in decisions:
            if d["action"] != "sparse":
                self.add(d["path"].lstrip("/"), f"{d['action']} by the snapshot policy: "
                                                f"{d['reason']}")

    def to_json(self) -> dict[str, Any]:
        return {"listed": self.listed, "more": self.more, "kept": self.kept,
                "kept_bytes": self.kept_bytes}


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _above(path: str, roots: Iterable[str]) -> bool:
    return any(r.startswith(path + "/") for r in roots)


@dataclasses.dataclass(frozen=True)
class ChangeRules:
    """The task's rules as layer paths (``ChangeRules.of(spec, hidden_files)``)."""

    editable: tuple[str, ...]
    allow: frozenset[str]
    hidden: frozenset[str]          # the hidden layer's non-directory paths
    hidden_dirs: frozenset[str]     # directories holding hidden files
    named_tests: frozenset[str]     # the files of the tests the task names
    junit: str | None
    limits: ChangeLimits = ChangeLimits()

    @classmethod
    def of(cls, spec: TaskSpec, hidden_files: Iterable[str],
           limits: ChangeLimits | None = None) -> ChangeRules:
        hidden = frozenset(p.strip("/") for p in hidden_files)
        named = {posixpath.normpath(posixpath.join(spec.workdir, t.split("::")[0])).strip("/")
                 for t in (*spec.must_pass, *spec.keep_passing)}
        return cls(editable=tuple(p.strip("/") for p in spec.editable),
                   allow=frozenset(p.strip("/") for p in spec.allow), hidden=hidden,
                   hidden_dirs=frozenset(posixpath.dirname(p) for p in hidden),
                   named_tests=frozenset(named),
                   junit=spec.junit.strip("/") if spec.junit else None,
                   limits=limits or ChangeLimits())

    def verdict_on(self, e: Entry) -> str | None:
        """Why ``e`` is dropped, or None to keep it (sizes aside: ``SizeBudget``)."""
        parent, _, name = e.path.rpartition("/")
        if name == OPAQUE_MARKER:
            return None if _under(parent, self.editable) else \
                "opaque directory outside the editable paths"
        deleted = name.startswith(WHITEOUT_PREFIX)
        target = posixpath.join(parent, name[len(WHITEOUT_PREFIX):]) if deleted else e.path
        if e.type == "dir" and not deleted:
            if _under(target, self.editable) or _above(target, self.editable):
                return self._named(target, parent, directory=True)
            return "outside the editable paths"
        if not _under(target, self.editable):
            return "outside the editable paths"
        reason = self._named(target, posixpath.dirname(target), directory=False)
        if reason is not None:
            return ("deletes " if deleted else "") + reason
        if e.type == "symlink" and not deleted:
            return self._link(target, e.linkname)
        return None

    def _named(self, path: str, parent: str, *, directory: bool) -> str | None:
        """A reason to drop ``path`` for its name or place, whatever its content."""
        name = posixpath.basename(path)
        parts = path.split("/")
        if ".git" in parts:
            return "git metadata (hooks, config, refs and objects stay the env's)"
        if "__pycache__" in parts or name.endswith((".pyc", ".pyo")):
            return "compiled cache (rebuilt from the graded source)"
        if directory:
            return None
        if path == self.junit:
            return "the grade's JUnit report path"
        if path in self.hidden:
            return "a hidden test path"
        if path in self.named_tests:
            return "a test file the task grades by"
        if name == "__init__.py" and parent in self.hidden_dirs:
            return "changes how the hidden tests import"
        if name in TEST_SETTINGS and path not in self.allow:
            return f"test settings ({name})"
        if name in STARTUP_FILES:
            return f"interpreter start-up file ({name})"
        if name.endswith(".pth"):
            return "path configuration file (.pth), run at interpreter start-up"
        return None

    def _link(self, path: str, target: str) -> str | None:
        resolved = posixpath.normpath(target if target.startswith("/")
                                      else posixpath.join("/" + posixpath.dirname(path), target))
        if _under(resolved.lstrip("/"), self.editable) and not resolved.startswith("//"):
            return None
        return f"symlink leaving the editable paths (-> {target[:200]})"


class SizeBudget:
    """Counts what is kept against ``ChangeLimits``; ``over(e)`` is why ``e`` no longer fits."""

    def __init__(self, limits: ChangeLimits, dropped: Dropped) -> None:
        self.limits, self.dropped = limits, dropped

    def over(self, e: Entry) -> str | None:
        lim, d = self.limits, self.dropped
        if d.kept >= lim.max_entries:
            return f"change set over {lim.max_entries} entries"
        if e.type == "file":
            if e.size > lim.max_file_bytes:
                return f"file of {e.size} bytes, over the {lim.max_file_bytes}-byte limit"
            if d.kept_bytes + e.size > lim.max_total_bytes:
                return f"change set over {lim.max_total_bytes} bytes"
            d.kept_bytes += e.size
        d.kept += 1
        return None


Members = Iterator[tuple[Entry, Any]]


def change_filter(rules: ChangeRules, dropped: Dropped) -> Callable[[Members], Members]:
    """An ``entry_filter`` (``envbuild.layers.pack_tree``) keeping what ``rules`` keep and
    recording every drop in ``dropped``; hardlinks to dropped members are dropped too."""
    budget = SizeBudget(rules.limits, dropped)

    def apply(entries: Members) -> Members:
        gone: set[str] = set()
        for e, src in entries:
            reason = rules.verdict_on(e)
            if reason is None and e.type == "hardlink" and e.linkname in gone:
                reason = f"hardlink to dropped {e.linkname}"
            reason = reason or budget.over(e)
            if reason is not None:
                gone.add(e.path)
                if e.type != "dir" or "opaque" in reason:  # a dir outside says nothing more
                    dropped.add(e.path, reason)
                continue
            yield e, src

    return apply
