"""What one FnCall call costs on top of its command (issue 34 item 2: every call in
namespaces of its own). A small loop, not a CI test:

    .venv/bin/python benchmarks/fncall_call_cost.py [N]

builds the busybox env in a temp dir, then on one fncall sandbox (``disk_bytes=64 MiB``) runs N
sequential ``fn.call("true")`` (nothing to reset) and N ``fn.call("echo x > /tmp/x")`` (one
slot to swap after each) after 3 warm-up calls of each. Prints wall ms per call and CPU ms
per call: this process plus the sandbox's cgroup (``cpuacct``: the commands, and since issue 34
the per-call helper and agent, which join it first thing). Run it on the commit before and
after a change to compare; it measures nothing else.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime_shim.isolation import cgroupfs  # noqa: E402
from runtime_shim.node.model import Limits  # noqa: E402
from runtime_shim.sdk.sandbox import Sandbox  # noqa: E402
from tests.integration.conftest import build_busybox_env  # noqa: E402


def _cpu(sandbox_id: str) -> float:
    t = os.times()
    found = cgroupfs.controller_dir("cpuacct", sandbox_id)
    group = int((found[0] / "cpuacct.usage").read_text()) / 1e9 if found else 0.0
    return t.user + t.system + group


def main(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="fncall-cost-") as tmp:
        store, node = build_busybox_env(Path(tmp))
        with Sandbox.create("env/busybox-shell", store=store, node_dir=node,
                            backend="fncall", limits=Limits(disk_bytes=64 << 20)) as fn:
            for label, cmd in (("true", "true"), ("write /tmp", "echo x > /tmp/x")):
                for _ in range(3):
                    fn.call(cmd)
                cpu, wall = _cpu(fn.id), time.perf_counter()
                for _ in range(n):
                    done = fn.call(cmd)
                    assert done.ok, done
                wall, cpu = time.perf_counter() - wall, _cpu(fn.id) - cpu
                print(f"{label:10s} {wall / n * 1e3:6.1f} ms wall {cpu / n * 1e3:6.1f} ms CPU "
                      f"per call (n={n})", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
