"""A lazy create fetches its stack's start-up files ahead (``runtime_shim.lazyfs.startup``), over
a real FUSE passthrough daemon, overlayfs and runc: runc's ``etc/passwd``/``etc/group`` (the
upper layer's, where it replaces the base's), the locale the lock's ``LANG`` names, glibc's
gconv cache, ``/etc/localtime``'s zone file, the lock's command and its script's interpreter
are on the node before anything opens them, so
their first opens are answered without a fetch (the daemon's open trace says how each first
open was answered); a file outside that set still misses."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from envbuild.oci import MEDIA_TYPE_CONFIG
from envbuild.plan.lockspec import RuntimeConfig, make_lock, merge_config
from envbuild.store import LocalStore, put_json
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool
from tests.integration.test_container_runtime import make_busybox_root
from tests.integration.test_lazy_sandbox import _no_leftovers, _pack

pytestmark = pytest.mark.integration

LOCALE = "usr/lib/locale/C.utf8"
GCONV = "usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache"
ZONE = "usr/share/zoneinfo/Etc/UTC"


@pytest.fixture
def startup_lock(tmp_path, monkeypatch):
    require_root()
    require_tool("runc")
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    trace = tmp_path / "open.trace"
    monkeypatch.setenv("ENVBUILD_LAZY_OPEN_TRACE", str(trace))  # the daemon inherits it
    store = LocalStore(tmp_path / "store")
    base = make_busybox_root(tmp_path / "base")
    (base / "etc" / "passwd").write_text("root:x:0:0:base:/root:/bin/sh\n")
    (base / "etc" / "group").write_text("root:x:0:\n")
    for name, size in (("LC_CTYPE", 300_000), ("LC_TIME", 3000), ("LC_MESSAGES/SYS_LC_MESSAGES",
                                                                   48)):
        p = base / LOCALE / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))
    (base / GCONV).parent.mkdir(parents=True)
    (base / GCONV).write_bytes(os.urandom(27_000))
    (base / ZONE).parent.mkdir(parents=True)
    (base / ZONE).write_bytes(b"TZif2" + os.urandom(100))
    os.symlink("/" + ZONE, base / "etc" / "localtime")
    # far from every start-up file in tar order (behind 3 MiB that no readahead window
    # spans): nothing fetches it before its own open
    (base / "zy").mkdir()
    (base / "zy" / "big.bin").write_bytes(os.urandom(3 << 20))
    (base / "zz").mkdir()
    (base / "zz" / "control").write_text("not a start-up file\n")
    # the lock's command: a script on PATH whose interpreter nothing else runs
    (base / "usr" / "local" / "bin").mkdir(parents=True)
    (base / "usr" / "local" / "bin" / "mytool").write_text("#!/opt/interp/bb2 sh\necho hi\n")
    os.chmod(base / "usr" / "local" / "bin" / "mytool", 0o755)
    (base / "opt" / "interp").mkdir(parents=True)
    (base / "opt" / "interp" / "bb2").write_bytes((base / "bin" / "busybox").read_bytes()
                                                   + b"\0" * 16)   # not busybox's digest
    os.chmod(base / "opt" / "interp" / "bb2", 0o755)
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc" / "passwd").write_text("root:x:0:0:upper:/root:/bin/sh\n")
    layers = [_pack(store, base, tmp_path, "base", source_date_epoch=1_700_000_000),
              _pack(store, upper, tmp_path, "upper", source_date_epoch=1_700_000_000)]
    config = merge_config([RuntimeConfig(env={"LANG": "C.UTF-8",
                                              "PATH": "/usr/local/bin:/bin:/usr/bin"},
                                         cmd=("mytool",))])
    lock = make_lock("startup", layers, config)
    put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
    store.put_ref("env/startup", put_json(store, lock.manifest).digest)
    node_dir = tmp_path / "n"
    yield store, node_dir, layers, trace
    _no_leftovers(node_dir)


def _first_opens(trace: Path) -> dict[str, tuple[str, str]]:
    """path -> (how its first open was answered, layer hex prefix) from the open trace."""
    out: dict[str, tuple[str, str]] = {}
    if trace.exists():
        for line in trace.read_text().splitlines():
            f = line.split(maxsplit=5)
            if len(f) == 6 and f[2] in ("miss", "file", "chunk"):
                out.setdefault(f[5], (f[2], f[3]))
    return out


def test_a_lazy_create_fetches_the_start_up_files_before_they_are_opened(startup_lock):
    store, node_dir, layers, trace = startup_lock
    base, upper = Path(trace.parent / "base"), Path(trace.parent / "upper")
    wanted = {p: base / p for p in ("etc/group", f"{LOCALE}/LC_CTYPE", f"{LOCALE}/LC_TIME",
                                    f"{LOCALE}/LC_MESSAGES/SYS_LC_MESSAGES", GCONV, ZONE)}
    wanted["etc/passwd"] = upper / "etc" / "passwd"   # the upper layer's: the base's is hidden
    # the lock's command (found on PATH) and the interpreter its #! line names
    wanted["usr/local/bin/mytool"] = base / "usr" / "local" / "bin" / "mytool"
    wanted["opt/interp/bb2"] = base / "opt" / "interp" / "bb2"
    files = node_dir / "node" / "files"

    def on_node(p: Path) -> bool:
        return (files / hashlib.sha256(p.read_bytes()).hexdigest()).is_file()

    with Sandbox.create("startup", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert sb.info().lazy.startswith("passthrough")
        # before any command: every start-up file is on the node (fetched and verified),
        # the control is not (the base's hidden passwd may be: it shares etc/group's frame)
        deadline = time.monotonic() + 10
        while not all(map(on_node, wanted.values())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p, f in wanted.items() if not on_node(f)] == []
        assert not on_node(base / "zz" / "control")
        r = sb.exec(f"cat /{LOCALE}/LC_CTYPE /{LOCALE}/LC_TIME /{LOCALE}/LC_MESSAGES/"
                    f"SYS_LC_MESSAGES /{GCONV} /etc/localtime /etc/group > /dev/null && "
                    "cat /etc/passwd /zz/control")
        assert r.exit_code == 0, r.stderr
        assert r.stdout == b"root:x:0:0:upper:/root:/bin/sh\nnot a start-up file\n"
        while "zz/control" not in _first_opens(trace) and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        opens = _first_opens(trace)
    # their opens did not wait for a fetch (those absent were served by a meta layer the
    # create built from them: no FUSE open at all); the control's did
    assert [p for p in wanted if opens.get(p, ("",))[0] == "miss"] == [], opens
    assert opens["zz/control"] == ("miss", layers[0].digest[7:19]), opens


@pytest.fixture
def python_lock(tmp_path, monkeypatch):
    """A stack with a Python's start-up files: the interpreter ``python3`` on PATH names
    (a symlink to ``python3.11``), its ``encodings`` package and ``sitecustomize``, and a
    venv near the root with a ``.pth`` file that imports a module. The lock's command is not
    Python: only the stack says a Python runs here."""
    require_root()
    require_tool("runc")
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    store = LocalStore(tmp_path / "store")
    base = make_busybox_root(tmp_path / "base")
    std = base / "usr" / "lib" / "python3.11"
    (std / "encodings" / "__pycache__").mkdir(parents=True)
    (std / "encodings" / "__init__.py").write_bytes(os.urandom(9000))
    (std / "encodings" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(
        os.urandom(7000))
    (std / "sitecustomize.py").write_bytes(os.urandom(200))
    (base / "usr" / "bin").mkdir(parents=True, exist_ok=True)
    (base / "usr" / "bin" / "python3.11").write_bytes(b"\x7fELF" + os.urandom(50_000))
    os.chmod(base / "usr" / "bin" / "python3.11", 0o755)
    os.symlink("python3.11", base / "usr" / "bin" / "python3")
    venv = base / "opt" / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.2\n")
    (site / "hook.pth").write_text("import hookmod\n")
    # frames of its own (not in hook.pth's frame, which brings it into memory before the
    # .pth is read: then it is predicted but needs no load, and is written at its open)
    (site / "hookmod.py").write_bytes(os.urandom(300_000))
    (base / "zy").mkdir()   # behind 3 MiB no readahead window spans: the control
    (base / "zy" / "big.bin").write_bytes(os.urandom(3 << 20))
    (base / "zz").mkdir()
    (base / "zz" / "control.py").write_text("not a start-up file\n")
    layers = [_pack(store, base, tmp_path, "base", source_date_epoch=1_700_000_000)]
    config = merge_config([RuntimeConfig(env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
                                         cmd=("sh",))])
    lock = make_lock("pystart", layers, config)
    put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
    store.put_ref("env/pystart", put_json(store, lock.manifest).digest)
    node_dir = tmp_path / "n"
    yield store, node_dir, base
    _no_leftovers(node_dir)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_lazy_create_fetches_pythons_start_up_files(python_lock, monkeypatch, switch):
    monkeypatch.setenv("ENVBUILD_LAZY_PY_STARTUP", switch)   # the daemon inherits it
    store, node_dir, base = python_lock
    std = base / "usr" / "lib" / "python3.11"
    site = base / "opt" / "venv" / "lib" / "python3.11" / "site-packages"
    wanted = [base / "usr" / "bin" / "python3.11", std / "encodings" / "__init__.py",
              std / "encodings" / "__pycache__" / "__init__.cpython-311.pyc",
              std / "sitecustomize.py", base / "opt" / "venv" / "pyvenv.cfg",
              site / "hook.pth", site / "hookmod.py"]
    files = node_dir / "node" / "files"

    def on_node(p: Path) -> bool:
        return (files / hashlib.sha256(p.read_bytes()).hexdigest()).is_file()

    with Sandbox.create("pystart", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert sb.info().lazy.startswith("passthrough")
        # before any command runs: on the node (fetched, verified, written) — or, switched
        # off, not (nothing opened them: the interpreter's first open would predict them)
        deadline = time.monotonic() + (10 if switch == "1" else 2)
        while not all(map(on_node, wanted)) and time.monotonic() < deadline:
            time.sleep(0.05)
        missing = [str(p.relative_to(base)) for p in wanted if not on_node(p)]
        assert missing == ([] if switch == "1" else [str(p.relative_to(base)) for p in wanted])
        assert not on_node(base / "zz" / "control.py")
        r = sb.exec("cat /opt/venv/lib/python3.11/site-packages/hook.pth")
        assert (r.exit_code, r.stdout) == (0, b"import hookmod\n"), r.stderr
