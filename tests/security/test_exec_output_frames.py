"""Issue 34 item 7, exec output in tiny frames: a command printing one byte per ``write(2)``
(or an agent sending one-byte frames) must not cost the host more than a small multiple of
``Limits.output_bytes`` in memory, nor minutes of CPU.

Each measurement runs in a fresh Python process (``ru_maxrss`` is a peak: only a process of
its own shows what one exec cost), against a real sandbox and the real agent, or against a
hostile agent on a real unix socket.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.security.test_exec_channel import _compile

MiB = 1 << 20
PRINTED = 1 * MiB

# Prints argv[1] bytes, one write(2) each ('a'..'z' repeating), each only once the previous
# one was read from the pipe: the agent then never finds more than one byte to send.
PRINTER_C = r"""
#include <stdlib.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    for (long i = 0; i < n; i++) {
        char c = 'a' + i % 26;
        int queued = 1;
        if (write(1, &c, 1) != 1) return 1;
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        do { /* wait (up to 10 ms) for the agent to read it */
            if (ioctl(1, FIONREAD, &queued) < 0) return 2;
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while (queued && (t.tv_sec - t0.tv_sec) * 1000000000L + t.tv_nsec - t0.tv_nsec < 10000000L);
    }
    return 0;
}
"""

# Runs in its own process: one exec, then the peak RSS growth and the CPU it took as JSON.
MEASURE_REAL = """
import hashlib, json, resource, sys
from runtime_shim.sdk.sandbox import Limits, Sandbox
store, node, printer, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with Sandbox.create("env/busybox-shell", store=store, node_dir=node,
                    limits=Limits(output_bytes=16 << 20)) as sb:
    sb.write_file("/tmp/printer", open(printer, "rb").read(), mode=0o755)
    assert sb.exec(["/tmp/printer", "1000"]).ok  # warm every code path first
    before = resource.getrusage(resource.RUSAGE_SELF)
    r = sb.exec(["/tmp/printer", str(n)])
    after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({
    "grew": (after.ru_maxrss - before.ru_maxrss) * 1024,
    "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
    "exit": r.exit_code, "truncated": r.output_truncated, "len": len(r.stdout),
    "sha": hashlib.sha256(r.stdout).hexdigest()}))
"""

# A hostile agent on a socketpair: HELLO, then ``n`` one-byte STDOUT frames, then EXIT 0 --
# ignoring KILL. The host side is the real ``agent.run``.
MEASURE_HOSTILE = """
import json, resource, socket, sys, threading
from runtime_shim.isolation import agent
n, cap = int(sys.argv[1]), int(sys.argv[2])
host, evil = socket.socketpair()

def serve():
    evil.recv(65536)
    evil.sendall(agent.frame(agent.R_HELLO, b"\\0\\0\\0\\1evil"))
    batch = agent.frame(agent.R_STDOUT, b"x") * 65536
    try:
        for _ in range(n // 65536):
            evil.sendall(batch)
        evil.sendall(agent.frame(agent.R_EXIT, bytes(6)))
    except OSError:
        pass  # the host hung up
    evil.close()

threading.Thread(target=serve, daemon=True).start()
before = resource.getrusage(resource.RUSAGE_SELF)
r = agent.run(lambda: host, agent.ExecRequest(argv=("x",)), cap, deadline=60)
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({
    "grew": (after.ru_maxrss - before.ru_maxrss) * 1024,
    "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
    "truncated": r.output_truncated, "len": len(r.stdout)}))
"""


def _measure(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2], env=os.environ)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_command_printing_one_byte_per_write_costs_the_host_little(busybox_store, tmp_path):
    store, node = busybox_store
    printer = tmp_path / "printer"
    printer.write_bytes(_compile(tmp_path, "printer", PRINTER_C))
    m = _measure(MEASURE_REAL, str(store.root), str(node), str(printer), str(PRINTED))
    expected = bytes(ord("a") + i % 26 for i in range(PRINTED))
    # the output arrives whole (the agent coalesces; the per-frame charge leaves it alone)
    assert (m["exit"], m["truncated"], m["len"]) == (0, False, PRINTED)
    assert m["sha"] == hashlib.sha256(expected).hexdigest()
    # before: ~75 bytes of RSS and ~3 us of CPU per byte printed (1.26 GB, 45 s for 16 MB)
    assert m["grew"] < 4 * PRINTED, m
    assert m["cpu"] < 3.0, m


def test_a_hostile_agent_sending_one_byte_frames_is_cut_off_at_the_output_cap():
    cap = 16 * MiB
    m = _measure(MEASURE_HOSTILE, str(4 * MiB), str(cap))
    # each frame is charged against the cap: the exec is killed long before 16 M frames
    assert m["truncated"] and m["len"] < cap // 32, m
    assert m["grew"] < 3 * cap, m
    assert m["cpu"] < 10.0, m
