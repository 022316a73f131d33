"""The CLI on a terminal (issue 34, item 9): what rich prints (the live build table, plan
tables) is data, never markup. A failing Dockerfile ``RUN`` names ``[/…]`` paths in its
command; rich read them as closing tags and ``envbuild build`` crashed (exit 2,
``rich.errors.MarkupError``) instead of reporting the failed step."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import require_root, require_tool
from tests.integration.conftest import copy_busybox_defs

REPO = Path(__file__).resolve().parents[2]
MARKUP = "[/x] [bold]not bold[/bold] [red"


def _on_terminal(argv: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on a pseudo-terminal (so both are ttys and the CLI
    draws with rich); its exit code and everything it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env=env, cwd=REPO)
    os.close(slave)
    out = bytearray()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            assert ready, f"no output for {timeout} s: {out[-2000:]!r}"
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            out += chunk
        return proc.wait(timeout), out.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_build_on_a_terminal_prints_markup_in_a_failing_step_literally(tmp_path):
    require_root()
    require_tool("runc")
    require_tool("busybox")
    defs = tmp_path / "envdefs"
    copy_busybox_defs(defs)
    (defs / "toolkits" / "broken.yaml").write_text(textwrap.dedent(f"""\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: broken
        build_on: busybox-tiny
        prefix: /opt/toolkits/broken
        steps:
          - run: echo '{MARKUP}'; exit 3
            network: none
        """))
    env = {**os.environ, "PYTHONPATH": str(REPO), "ENVBUILD_STORE": str(tmp_path / "store"),
           "ENVBUILD_NODE_CACHE": str(tmp_path / "node"), "ENVBUILD_DEFS": str(defs),
           "TERM": "xterm", "COLUMNS": "400", "LINES": "50"}
    code, out = _on_terminal([sys.executable, "-m", "envbuild.cli", "build"], env)
    assert "MarkupError" not in out and "Traceback" not in out, out[-3000:]
    assert code == 1, out[-3000:]
    assert MARKUP in out
