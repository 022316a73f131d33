"""glibc's malloc in the lazy daemon (``runtime_shim.lazyfs.daemon.tune_malloc``): one arena
for all its threads, told apart from glibc's default in a real interpreter (the test spawns
one per case: the setting is process-wide and the test process has threads of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


_ARENAS = """
import ctypes, os, sys, tempfile, threading
from runtime_shim.lazyfs import daemon
print(daemon.tune_malloc() if sys.argv[1] == "tune" else "default")
hold, ready = [], threading.Barrier(9)
def work():
    hold.append(os.urandom(1 << 20))   # each thread mallocs (a 1 MiB bytes object)
    ready.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
ready.wait()
from envbuild.libc import LIBC, function
path = tempfile.mktemp()
fp = function("fopen", ctypes.c_void_p)(path.encode(), b"w")
LIBC.malloc_info(0, ctypes.c_void_p(fp))
LIBC.fclose(ctypes.c_void_p(fp))
print(open(path).read().count("<heap nr="))
os.unlink(path)
for t in threads: t.join()
"""


@pytest.mark.parametrize("how", ["tune", "default"])
def test_tune_malloc_leaves_one_arena_for_all_threads(how):
    # with an arena per thread, memory freed on one thread is not reused by the next and
    # every fetch faults in fresh pages; glibc counts its arenas in malloc_info's XML
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", _ARENAS, how], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    if how == "tune":
        assert out == ["tuned", "1"]
    else:
        assert out[0] == "default" and int(out[1]) > 1   # the test can tell them apart
