"""The server's records of its sandboxes, kept on disk so that a sandbox outlives the server
process: a restarted ``envbuild serve`` over the same node dir re-attaches them.

**Format** (``RECORD_VERSION``): one JSON file per E2B sandbox, ``<dir>/<e2b id>.json``,
mode 0600 in a 0700 directory (by default ``<node dir>/serve``), written atomically:
``version``, ``id``, ``template``, ``metadata``, ``env_vars``, ``started_at``, ``end_at``,
``token`` and ``traffic_token`` (the access tokens: kept as they are, not hashed, because
E2B's ``connect`` and ``get`` hand them back to an API-key holder), ``cpus``, ``memory_mb``,
``disk_mb``, and where the sandbox is: ``sandbox`` (the runtime_shim id of the running one;
behind ``--fleet`` its fleet id ``SDK-ID@NODE``, ``<node dir>/serve-fleet``) or
``checkpoint`` (the lock of a paused one) with ``memory`` (whether that lock holds a memory
image), and ``lifecycle`` (``envbuild.serve.lifecycle``; absent in a record of an older
server: kill at the timeout). ``kill`` removes the record.

**A record is hostile input** (anyone who can write the directory could have planted it):
``load`` opens each file without following a link, refuses one that is not a regular file of
this user, reads at most ``MAX_RECORD`` bytes, checks every field's type, shape and size and
that the name is the id; a record that fails is logged and skipped, never acted on. At most
``limit`` records are loaded. One server at a time owns a directory (``flock`` on
``<dir>/lock``); a second one is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

from envbuild.atomic import write_atomic
from envbuild.errors import SettingsError
from envbuild.oci import is_digest
from envbuild.serve.lifecycle import Lifecycle

_log = logging.getLogger(__name__)

RECORD_VERSION = 1
#: A record holds at most a 64 KiB create body's metadata and env vars, twice over.
MAX_RECORD = 256 << 10
ID_RE = re.compile(r"i[0-9a-f]{19}")
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{32,64}")
#: a runtime_shim id, or a fleet id (``SDK-ID@NODE``: ``envbuild.serve.fleet``)
_SANDBOX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}(@[0-9a-f]{12})?")
_MAX_TEMPLATE = 1024


@dataclasses.dataclass
class Record:
    """What the server must know of a sandbox to serve it again after a restart."""

    id: str
    template: str
    metadata: dict[str, str]
    env_vars: dict[str, str]
    started_at: float
    end_at: float
    token: str
    traffic_token: str
    cpus: int = 1
    memory_mb: int = 0
    disk_mb: int = 0
    sandbox: str | None = None  # runtime_shim's id while it runs
    checkpoint: str | None = None  # the lock it was paused into
    memory: bool = True  # whether ``checkpoint`` holds a memory image
    lifecycle: Lifecycle = dataclasses.field(default_factory=Lifecycle)

    def to_json(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: Any) -> Record:
        """A checked record; ``ValueError`` naming the first field that is wrong."""
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise ValueError(f"not a version-{RECORD_VERSION} record")
        _check(data, "id", str, ID_RE)
        _check(data, "token", str, _TOKEN_RE)
        _check(data, "traffic_token", str, _TOKEN_RE)
        template = data.get("template")
        if not isinstance(template, str) or not 0 < len(template) <= _MAX_TEMPLATE:
            raise ValueError("template")
        for name in ("metadata", "env_vars"):
            value = data.get(name)
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                raise ValueError(name)
        for name in ("started_at", "end_at"):
            if isinstance(data.get(name), bool) or not isinstance(data.get(name), int | float):
                raise ValueError(name)
        for name in ("cpus", "memory_mb", "disk_mb"):
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 40:
                raise ValueError(name)
        if data.get("sandbox") is not None:
            _check(data, "sandbox", str, _SANDBOX_RE)
        if data.get("checkpoint") is not None and not is_digest(data["checkpoint"]):
            raise ValueError("checkpoint")
        if (data.get("sandbox") is None) == (data.get("checkpoint") is None):
            raise ValueError("exactly one of sandbox and checkpoint")
        if not isinstance(data.get("memory"), bool):
            raise ValueError("memory")
        lifecycle = Lifecycle.from_json(data["lifecycle"]) if "lifecycle" in data else Lifecycle()
        fields = {f.name for f in dataclasses.fields(cls)} - {"lifecycle"}
        return cls(**{k: v for k, v in data.items() if k in fields}, lifecycle=lifecycle)


def _check(data: dict[str, Any], name: str, kind: type, pattern: re.Pattern[str]) -> None:
    value = data.get(name)
    if not isinstance(value, kind) or not pattern.fullmatch(str(value)):
        raise ValueError(name)


class RecordDir:
    """The records of one server (see the module docstring). ``claim`` before anything else."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None

    def claim(self) -> None:
        """Make the directory (0700) if needed and take it for this server, or raise
        ``SettingsError`` if it is not a private directory or another server holds it."""
        with contextlib.suppress(FileExistsError):
            self.path.mkdir(mode=0o700, parents=True)
        st = os.lstat(self.path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise SettingsError(f"records dir {self.path} is not a private directory of this "
                                "user", hint="it must be a directory, mode 0700, not a link")
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise SettingsError(f"another envbuild serve uses {self.path}",
                                    hint="one server per node dir; stop the other first") \
                    from None
            raise
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def write(self, record: Record) -> None:
        write_atomic(self.path / f"{record.id}.json", json.dumps(record.to_json()), mode=0o600,
                     fsync=True)

    def remove(self, sandbox_id: str) -> None:
        if ID_RE.fullmatch(sandbox_id):
            with contextlib.suppress(FileNotFoundError):
                (self.path / f"{sandbox_id}.json").unlink()

    def load(self, limit: int) -> list[Record]:
        """The valid records, at most ``limit`` (by name); each bad one is logged, skipped."""
        found: list[Record] = []
        for name in sorted(os.listdir(self.path)):
            if not name.endswith(".json"):
                continue
            if len(found) >= limit:
                _log.warning("records dir %s: more than %d records, the rest ignored",
                             self.path, limit)
                break
            try:
                record = Record.from_json(json.loads(self._read(name)))
                if f"{record.id}.json" != name:
                    raise ValueError("id is not the file's name")
            except (OSError, ValueError, RecursionError) as e:
                _log.warning("sandbox record %s skipped: %s", name[:80], e)
                continue
            found.append(record)
        return found

    def _read(self, name: str) -> bytes:
        fd = os.open(self.path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ValueError("not a regular file of this user")
            data = os.read(fd, MAX_RECORD + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_RECORD:
            raise ValueError(f"over {MAX_RECORD} bytes")
        return data
