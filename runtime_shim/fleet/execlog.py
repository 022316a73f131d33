"""Exec logs: the append-only record of what a fleet sandbox ran, kept in the store.

A sandbox made with ``Fleet.create(..., exec_log=True)`` gets a log named by its SDK id. Its
daemon appends one store record per exec or file write, in the order they ran, so any node
(any process with the store) can read it and replay it:

- namespace ``execlog/v1/<log_id>``; record ``meta``: ``{version, log, lock, node_id,
  created}``; records ``00000001``, ``00000002``, …: one entry each, ``{version, seq, op,
  ...}`` where ``op`` is ``"exec"`` (``cmd`` — a string or an argv list —, ``env``, ``cwd``,
  ``user``, ``timeout``, ``stdin``; ``result``: ``{exit_code, stdout, stderr, timed_out,
  output_truncated, duration}``) or ``"write"`` (``path``, ``mode``, ``data``). Bytes are
  base64; an output longer than ``MAX_INLINE`` is cut and marked ``cut`` (such a result is
  never handed back by a fast-forward); written data longer than that is stored as a blob
  (``data_blob``) so a replay writes the same bytes.
- each such blob is also named by a record of namespace ``BLOB_INDEX`` (``execlog/blobs/v1``),
  ``<log_id>.<seq>``: ``{version, log, seq, blob}``, written after the blob and before the
  entry. ``envbuild gc`` (``envbuild.store.gc``) keeps every blob that index names: a log's
  namespace cannot be listed from the store's interface, the index can.

Replay (``replay_ops``) runs the entries in order against a sandbox's ``exec``/``write_file``;
``FastForward`` (``Fleet.fast_forward``) answers a restarted rollout's commands from the log
while they match it, and brings the sandbox to the matched state before the first command that
does not.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envbuild.errors import RuntimeShimError, UnsupportedFormatError
from envbuild.store import Store
from runtime_shim.node.model import ExecResult

LOG_VERSION = 1
NAMESPACE = "execlog/v1"
#: Output or data kept inline in a record (bytes per field).
MAX_INLINE = 1 << 20
#: Record namespace naming every blob an exec log entry holds (read by ``envbuild.store.gc``).
BLOB_INDEX = "execlog/blobs/v1"


def namespace(log_id: str) -> str:
    return f"{NAMESPACE}/{log_id}"


def start(store: Store, log_id: str, *, lock: str, node_id: str) -> None:
    store.put_record(namespace(log_id), "meta", {"version": LOG_VERSION, "log": log_id,
                                                 "lock": lock, "node_id": node_id,
                                                 "created": time.time()})


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def append(store: Store, log_id: str, seq: int, op: str, **fields: Any) -> None:
    """Record entry ``seq`` (1, 2, …) of log ``log_id``: ``op`` "exec" with ``cmd``,
    ``kwargs`` (``Sandbox.exec``'s) and ``result``, or "write" with ``path``, ``data``,
    ``mode``."""
    entry: dict[str, Any] = {"version": LOG_VERSION, "seq": seq, "op": op}
    if op == "exec":
        kwargs: Mapping[str, Any] = fields.get("kwargs") or {}
        cmd = fields["cmd"]
        result: ExecResult = fields["result"]
        entry.update(cmd=cmd if isinstance(cmd, str) else list(cmd),
                     env=dict(kwargs.get("env") or {}), cwd=kwargs.get("cwd"),
                     user=kwargs.get("user"), timeout=kwargs.get("timeout"),
                     stdin=_b64(kwargs.get("stdin")),
                     result={"exit_code": result.exit_code,
                             "stdout": _b64(result.stdout[:MAX_INLINE]),
                             "stderr": _b64(result.stderr[:MAX_INLINE]),
                             "cut": len(result.stdout) > MAX_INLINE
                             or len(result.stderr) > MAX_INLINE,
                             "timed_out": result.timed_out,
                             "output_truncated": result.output_truncated,
                             "duration": result.duration})
    elif op == "write":
        data: bytes = fields["data"]
        entry.update(path=fields["path"], mode=int(fields.get("mode", 0o644)))
        if len(data) > MAX_INLINE:
            from envbuild.store import put_bytes

            entry["data_blob"] = put_bytes(store, data)
            # before the entry: gc keeps what the index names, never a blob an entry names alone
            store.put_record(BLOB_INDEX, f"{log_id}.{seq:08d}",
                             {"version": LOG_VERSION, "log": log_id, "seq": seq,
                              "blob": entry["data_blob"]})
        else:
            entry["data"] = _b64(data)
    else:
        raise RuntimeShimError(f"unknown exec log op {op!r}")
    store.put_record(namespace(log_id), f"{seq:08d}", entry)


@dataclasses.dataclass(frozen=True)
class LogEntry:
    """One recorded op. For "exec": ``cmd``, ``kwargs`` (for ``exec``), ``result`` (None if
    it was cut); for "write": ``path``, ``data``, ``mode``."""

    seq: int
    op: str
    cmd: str | tuple[str, ...] | None = None
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    result: ExecResult | None = None
    path: str | None = None
    data: bytes | None = None
    mode: int = 0o644

    def matches_exec(self, cmd: str | Sequence[str], kwargs: Mapping[str, Any]) -> bool:
        want = cmd if isinstance(cmd, str) else tuple(cmd)
        return self.op == "exec" and self.cmd == want and _norm(self.kwargs) == _norm(kwargs)

    def matches_write(self, path: str, data: bytes, mode: int) -> bool:
        return self.op == "write" and (self.path, self.data, self.mode) == (path, data, mode)


def _norm(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("env", "cwd", "user", "timeout", "stdin")
    out = {k: kwargs.get(k) for k in keys}
    out["env"] = dict(out["env"] or {})
    return out


@dataclasses.dataclass(frozen=True)
class ExecLog:
    log_id: str
    lock: str
    node_id: str
    entries: tuple[LogEntry, ...]


def _names(store: Store, ns: str) -> list[str]:
    return store.list_records(ns)


def length(store: Store, log_id: str) -> int:
    names = _names(store, namespace(log_id))
    return len([n for n in names if n != "meta"])


def read(store: Store, log_id: str) -> ExecLog:
    """The whole log; ``RuntimeShimError`` if there is none by that id, and
    ``UnsupportedFormatError`` for a version this reader does not know."""
    from envbuild.store import read_bytes

    ns = namespace(log_id)
    meta = store.get_record(ns, "meta")
    if meta is None:
        raise RuntimeShimError(f"no exec log {log_id!r} in the store",
                               reference="exec-log-not-found",
                               hint="create sandboxes with exec_log=True; the log id is the "
                                    "sandbox's (FleetSandbox.exec_log)")
    if meta.get("version") != LOG_VERSION:
        raise UnsupportedFormatError(f"exec log {log_id} has version {meta.get('version')!r}",
                                     hint=f"this envbuild reads version {LOG_VERSION}")
    entries = []
    for name in _names(store, ns):
        if name == "meta":
            continue
        rec = store.get_record(ns, name) or {}
        if rec.get("version") != LOG_VERSION:
            raise UnsupportedFormatError(f"exec log {log_id} entry {name} has version "
                                         f"{rec.get('version')!r}")
        if rec["op"] == "exec":
            r = rec["result"]
            result = None if r.get("cut") else ExecResult(
                exit_code=int(r["exit_code"]), stdout=_unb64(r["stdout"]) or b"",
                stderr=_unb64(r["stderr"]) or b"", duration=float(r.get("duration", 0.0)),
                timed_out=bool(r.get("timed_out")),
                output_truncated=bool(r.get("output_truncated")))
            cmd = rec["cmd"]
            kwargs = {"env": rec.get("env") or {}, "cwd": rec.get("cwd"),
                      "user": rec.get("user"), "timeout": rec.get("timeout"),
                      "stdin": _unb64(rec.get("stdin"))}
            entries.append(LogEntry(seq=int(rec["seq"]), op="exec",
                                    cmd=cmd if isinstance(cmd, str) else tuple(cmd),
                                    kwargs=kwargs, result=result))
        else:
            data = (read_bytes(store, rec["data_blob"]) if rec.get("data_blob")
                    else _unb64(rec.get("data")) or b"")
            entries.append(LogEntry(seq=int(rec["seq"]), op="write", path=rec["path"],
                                    data=data, mode=int(rec.get("mode", 0o644))))
    entries.sort(key=lambda e: e.seq)
    return ExecLog(log_id=log_id, lock=meta.get("lock", ""), node_id=meta.get("node_id", ""),
                   entries=tuple(entries))


@dataclasses.dataclass(frozen=True)
class ReplayReport:
    """What a replay did: ``ran`` ops; ``differed``: seqs of execs whose exit code or output
    differ from the recorded ones (a nondeterministic command)."""

    log_id: str
    ran: int
    differed: tuple[int, ...] = ()


def replay_ops(log: ExecLog, exec_fn: Callable[..., ExecResult],
               write_fn: Callable[[str, bytes, int], None], upto: int | None = None
               ) -> ReplayReport:
    """Run ``log``'s first ``upto`` entries (all by default) in order."""
    differed = []
    ran = 0
    for entry in log.entries[:upto]:
        if entry.op == "exec":
            kwargs = {k: v for k, v in entry.kwargs.items() if v not in (None, {})}
            got = exec_fn(entry.cmd, kwargs)
            if entry.result is not None and (got.exit_code, got.stdout, got.stderr) != (
                    entry.result.exit_code, entry.result.stdout, entry.result.stderr):
                differed.append(entry.seq)
        else:
            write_fn(entry.path or "", entry.data or b"", entry.mode)
        ran += 1
    return ReplayReport(log_id=log.log_id, ran=ran, differed=tuple(differed))


__all__ = ["BLOB_INDEX", "LOG_VERSION", "MAX_INLINE", "ExecLog", "LogEntry", "ReplayReport", "append",
           "length", "read", "replay_ops", "start"]
