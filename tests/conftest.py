"""Shared test helpers, and the test tiers.

Required tools are *required*: a missing ``runc`` or ``zstd`` fails the test that needs it with
the install hint, it never skips silently (``scripts/setup.sh`` installs all of them).

Tiers (docs/testing.md): every test is in exactly one, ``fast`` or ``integration``, a marker
that comes from the directory the test is in (``DIRECTORY_TIERS``) unless the test or its
module carries one itself. A run where a test is in no tier or in two stops at collection.
A ``fast`` test that asks for root or a real tool (``require_root``, ``require_tool``) fails:
it belongs in ``integration``.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


#: The tiers, each a marker (pyproject.toml [tool.pytest.ini_options] says what each means).
TIERS = ("fast", "integration")

#: The tier of the tests in each directory right under tests/. A test or module in another
#: tier says so itself (``pytestmark = pytest.mark.integration``); tests/store/conftest.py marks
#: the store runs that start a server (S3, registries) ``integration``.
DIRECTORY_TIERS = {"unit": "fast", "store": "fast",
                   "integration": "integration", "security": "integration"}


def tiers_of(item: pytest.Item) -> list[str]:
    """The tier markers on ``item`` (its own, its class's, its module's), sorted, once each."""
    return sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})


def assign_tiers(items: list[pytest.Item], root: Path,
                 directories: dict[str, str]) -> list[str]:
    """Mark each item that has no tier with its directory's (``directories``: a directory
    right under ``root`` -> tier); return one line per item then in no tier or in two."""
    problems = []
    for item in items:
        if not tiers_of(item):
            rel = Path(item.path).relative_to(root) if Path(item.path).is_relative_to(root) else None
            tier = directories.get(rel.parts[0]) if rel is not None and len(rel.parts) > 1 else None
            if tier is not None:
                item.add_marker(tier)
        found = tiers_of(item)
        if len(found) != 1:
            problems.append(f"{item.nodeid}: in {' and '.join(found) or 'no tier'}")
    return problems


def tier_error(problems: list[str]) -> str:
    shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    return (f"{len(problems)} test(s) not in exactly one tier ({', '.join(TIERS)}):\n  "
            + "\n  ".join(shown) + "\nhint: add the directory to DIRECTORY_TIERS in "
            "tests/conftest.py, or mark the test or module with its one tier (docs/testing.md)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tiers: runs after the directory conftests' hooks (tests/store's marks) and before
    ``-m`` selects, since pluggy calls the hooks registered last first."""
    problems = assign_tiers(items, REPO / "tests", DIRECTORY_TIERS)
    if problems:
        raise pytest.UsageError(tier_error(problems))


#: The tier of the test being run (its setup, call and teardown), for ``require_*``.
_running_tier: list[str] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    outer = list(_running_tier)  # a test that runs pytest in-process (tests/unit/test_tiers.py)
    _running_tier[:] = tiers_of(item)
    try:
        return (yield)
    finally:
        _running_tier[:] = outer


def _refuse_in_fast_tier(need: str) -> None:
    if _running_tier == ["fast"]:
        pytest.fail(f"a fast-tier test needs {need}: it belongs in the integration tier "
                    "(mark the test or its module `integration`, docs/testing.md)", pytrace=False)


@pytest.fixture(autouse=True)
def _fast_tier_guard(request: pytest.FixtureRequest) -> None:
    """A fast-tier test runs no program (no real tools) and connects nowhere but loopback (no
    network): either fails it. (A forked Python, ``multiprocessing``'s fork context, is no
    program; a server the test runs on 127.0.0.1 in a thread is no network.)"""
    if tiers_of(request.node) != ["fast"]:
        return
    monkeypatch = request.getfixturevalue("monkeypatch")

    def refuse(what: str) -> AssertionError:
        return AssertionError(f"a fast-tier test must not {what}: it belongs in the integration "
                              "tier (mark the test or its module `integration`, docs/testing.md)")

    def no_program(*args, **kwargs):
        raise refuse("start programs")

    def loopback_only(real):
        def connect(sock: socket.socket, address, *args):
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
                raise refuse(f"connect to {address[0]} (loopback only)")
            return real(sock, address, *args)
        return connect

    monkeypatch.setattr(subprocess.Popen, "__init__", no_program)
    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, loopback_only(getattr(socket.socket, name)))


#: The suite's sandboxes unmount the node's disk pool with its last sandbox (no grace), so the
#: many fixtures that check nothing is left mounted under their node dir when the test's
#: sandboxes closed hold without knowing of the grace; programs the suite starts (servers,
#: Ray's daemons) inherit it. The grace itself is tested where it is set
#: (tests/security/test_disk_pool.py). A developer's own setting is kept.
os.environ.setdefault("ENVBUILD_DISK_POOL_GRACE", "0")


@pytest.fixture(autouse=True)
def _disk_pools_unmounted():
    """After each test, the disk pools its closes left mounted for their grace
    (``runtime_shim.node.diskpool``) are unmounted, as at a process's exit: no test's pool
    outlives it. A test that checks the host while it runs calls ``unmount_idle`` itself."""
    yield
    diskpool = sys.modules.get("runtime_shim.node.diskpool")
    if diskpool is not None:
        diskpool.unmount_all_idle()


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_tool(name: str) -> str:
    """Absolute path of ``name`` on PATH, or fail the calling test loudly."""
    _refuse_in_fast_tier(f"the tool {name!r}")
    path = shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)
    if path is None:
        pytest.fail(f"required tool {name!r} is not installed; run `bash scripts/setup.sh`",
                    pytrace=False)
    return path


def require_root() -> None:
    _refuse_in_fast_tier("root")
    if os.geteuid() != 0:
        pytest.fail("this test needs root (mounts, runc); CI and the dev machines run as root",
                    pytrace=False)


@pytest.fixture
def repo_root() -> Path:
    return REPO


from tests.ray_cluster import ray_cluster  # noqa: E402,F401  (session fixture shared by fleet and ray builds)


@pytest.fixture(scope="session")
def swerex_tree(tmp_path_factory):
    """One project with the py-swerex env built (``tests/swerex_env.py``; ~30 s), shared by
    every SWE-ReX test module: its store and node are only read and sandboxed from."""
    from tests.swerex_env import make_swerex_tree

    require_root()
    require_tool("runc")
    return make_swerex_tree(tmp_path_factory.mktemp("swerex"))
