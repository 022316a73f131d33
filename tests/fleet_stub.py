"""Real fleet daemons whose node start is a stub, for tests of the control and data planes
without Ray or runc (``runtime_shim.fleet.calls.LocalCalls``): a stub sandbox runs no command
(an exec echoes its command line; a started command echoes its stdin), keeps its files in
memory and closes at once."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from envbuild.store import LocalStore
from runtime_shim.backends.fake import fake_lock
from runtime_shim.fleet.calls import LocalCalls
from runtime_shim.fleet.client import Fleet
from runtime_shim.fleet.daemon import NodeDaemon
from runtime_shim.fleet.model import CreateSpec, DaemonConfig
from runtime_shim.node.model import ExecResult


class StubProcess:
    """A started command of a stub sandbox: stdin is echoed to stdout; it ends with EOF on
    stdin (0) or a signal (128 + it)."""

    def __init__(self, on_stdout: Any) -> None:
        self.on_stdout = on_stdout or (lambda b: None)
        self.code: int | None = None
        self.ended = threading.Event()

    @property
    def done(self) -> bool:
        return self.ended.is_set()

    def _end(self, code: int) -> None:
        if self.code is None:
            self.code = code
            self.ended.set()

    unsent_stdin = 0

    def write_stdin(self, data: bytes) -> None:
        self.on_stdout(data)

    def close_stdin(self) -> None:
        self._end(0)

    def send_signal(self, sig: int) -> None:
        self._end(128 + sig)

    def kill(self) -> None:
        self._end(137)

    def resize(self, rows: int, cols: int) -> None:
        self.on_stdout(f"{rows}x{cols}".encode())

    def wait(self) -> ExecResult:
        self.ended.wait()
        return ExecResult(exit_code=self.code or 0, stdout=b"", stderr=b"", duration=0.0)


class StubSandbox:
    def __init__(self, root: Path) -> None:
        self.id = f"eb-{random.getrandbits(48):012x}"
        self.paths = SimpleNamespace(root=root, meta=root / "sandbox.json")
        self.files: dict[str, bytes] = {}
        self.procs: list[StubProcess] = []

    def start(self, cmd: Any, **kwargs: Any) -> StubProcess:
        proc = StubProcess(kwargs.get("on_stdout"))
        self.procs.append(proc)
        return proc

    def exec(self, cmd: Any, **kwargs: Any) -> ExecResult:
        line = cmd if isinstance(cmd, str) else " ".join(cmd)
        return ExecResult(exit_code=0, stdout=line.encode() + (kwargs.get("stdin") or b""),
                          stderr=repr(sorted(kwargs)).encode(), duration=0.0)

    def read_file(self, path: str) -> bytes:
        return self.files[path]

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.files[path] = data

    def close(self) -> None:
        return None


class StubDaemon(NodeDaemon):
    """A real daemon whose node start makes a ``StubSandbox``."""

    def _new_sandbox(self, spec: CreateSpec) -> StubSandbox:
        root = self.layout.root / "stub"
        root.mkdir(exist_ok=True)
        return StubSandbox(root)


class CountingCalls(LocalCalls):
    def __init__(self) -> None:
        super().__init__(workers=32)
        self.counts: dict[str, int] = {}

    def submit(self, handle, method, *args):
        self.counts[method] = self.counts.get(method, 0) + 1
        return super().submit(handle, method, *args)


def stub_cell(root: Path, nodes: int = 3, **config: Any) -> SimpleNamespace:
    """A store with a fake lock, ``nodes`` stub daemons, and ``fleet(**Fleet kwargs)``; call
    ``close()`` at the end."""
    store = LocalStore(root / "store")
    digest = fake_lock(store)
    cfg = DaemonConfig(store=str(root / "store"), node_dir=str(root / "{node_id}"),
                       **{"slots": 10, "memory_bytes": 1 << 40, "niceness": None, **config})
    daemons = {f"{i:040x}": StubDaemon(cfg, f"{i:040x}") for i in range(1, nodes + 1)}
    calls = CountingCalls()

    def fleet(**kwargs: Any) -> Fleet:
        return Fleet(str(root / "store"), store, daemons, owns_ray=False, config=cfg,
                     calls=calls, **kwargs)

    def close() -> None:
        for d in daemons.values():
            d.shutdown()
        calls.shutdown()

    return SimpleNamespace(fleet=fleet, daemons=daemons, calls=calls, lock=digest, close=close,
                           config=cfg)


@pytest.fixture
def data_cell(tmp_path):
    """One stub node whose daemon has a data plane on 127.0.0.1 (closed after the test)."""
    c = stub_cell(tmp_path, nodes=1, data_host="127.0.0.1")
    yield c
    c.close()
