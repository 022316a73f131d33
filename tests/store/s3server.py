"""A real S3 server on loopback for tests: ``moto_server`` in a subprocess (nothing patches boto3).

``MotoServer.start()`` runs the venv's ``moto_server`` on a free 127.0.0.1 port and waits until it
answers; ``kill()`` / ``restart()`` are for fault tests (moto keeps its state in memory, so a
restarted server is empty). ``s3_env`` is the environment that points boto3 at it with dummy
credentials and no instance-metadata lookups (tests never leave loopback).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_argv(port: int) -> list[str]:
    exe = Path(sys.executable).parent / "moto_server"
    if exe.exists():
        return [str(exe), "-H", "127.0.0.1", "-p", str(port)]
    found = shutil.which("moto_server")
    if found:
        return [found, "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


class MotoServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> MotoServer:
        # parts down to 1 MiB (S3 itself wants 5 MiB): keeps multipart tests small and fast
        env = {**os.environ, **CREDENTIALS, "S3_UPLOAD_PART_MIN_SIZE": str(1 << 20)}
        self.proc = subprocess.Popen(_moto_argv(self.port), env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.5):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("moto_server did not start listening")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self):
        import boto3

        return boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing",
            region_name="us-east-1").client("s3", endpoint_url=self.endpoint)

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def session():
    import boto3

    return boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                 region_name="us-east-1")


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoServer]:
    """One moto server for the whole session (per importing module), stopped at the end."""
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def s3_env(moto_s3, monkeypatch) -> MotoServer:
    """``moto_s3`` with boto3's environment pointing at it (for code that opens URLs itself)."""
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    return moto_s3


class CuttableProxy:
    """A loopback TCP proxy in front of a server that can drop every connection and refuse new
    ones (``cut``), then accept again (``restore``): a network partition, or a crash of a
    server whose storage is durable (real S3), without losing moto's in-memory state."""

    def __init__(self, upstream_port: int) -> None:
        import threading

        self.upstream = upstream_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.cut_now = False
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_now:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                client.close()  # RST: connection reset
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.cut_now = True
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def restore(self) -> None:
        self.cut_now = False

    def close(self) -> None:
        self.cut()
        self.listener.close()
