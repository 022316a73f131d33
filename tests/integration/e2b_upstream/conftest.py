"""E2B's own SDK tests (ported from e2b-dev/E2B ``packages/python-sdk/tests``, see each file's
header) against ``envbuild serve``: the fixtures they use, with upstream's names, on the shared
``e2b_server`` fixture's server (``serving`` of ``tests/integration/conftest.py``: the real
``envbuild serve`` and the SDK's three variables), one for the package, whose store holds
E2B's ``base`` template — the env ``base`` of ``./envdefs`` (Debian bookworm with Python, a
user ``user`` in ``/home/user``, sudo, curl), built once for the package on the example Debian
layers (``python_example_store``).

``sandbox``/``sandbox_factory`` and ``async_sandbox``/``async_sandbox_factory`` keep upstream's
behaviour (a ``sandbox_test_id`` in the metadata, every sandbox killed after the test), except
that the modules of ``SHARED_SANDBOX`` get one ``sandbox`` for the module (killed after it).
Upstream runs its ``async def`` tests with pytest-asyncio (auto mode); here
``pytest_pyfunc_call`` runs each on a fresh event loop and makes the async fixtures' sandboxes
there, before the test (an ``AsyncSandbox``'s connections belong to the loop that made them).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import shutil
import string
import subprocess
import sys
from collections.abc import Awaitable, Callable

import pytest

from tests.conftest import REPO, require_root, require_tool
from tests.integration.conftest import python_example_store, serving

HERE = os.path.dirname(__file__)
#: the example definitions ``base`` stands on, copied with their relative paths
DEBIAN_PARTS = ("base/debian-bookworm.yaml", "base/debian-bookworm-py311.yaml",
                "base/files/debian")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "skip_debug: upstream's: skip if E2B_DEBUG is set.")


class _Deferred:
    """An async fixture's value, made on the test's event loop (``pytest_pyfunc_call``)."""

    def __init__(self, make: Callable[[], Awaitable[object]]) -> None:
        self.make = make


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run an ``async def`` test on a fresh event loop (what pytest-asyncio does upstream)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames

    async def run() -> None:
        args = {}
        for n in names:
            value = pyfuncitem.funcargs[n]
            args[n] = await value.make() if isinstance(value, _Deferred) else value
        await pyfuncitem.obj(**args)

    asyncio.run(run())
    return True


@pytest.fixture(scope="package")
def e2b_built(tmp_path_factory, request):
    """The env ``base`` (``./envdefs``) built into a store of its own, its Debian layers taken
    from ``python_example_store`` (``--cache-from``); overrides the busybox one of
    ``tests/integration/conftest.py`` for this package's ``e2b_server``."""
    from envbuild.store import LocalStore

    require_root()
    require_tool("runc")
    root = tmp_path_factory.mktemp("e2b-upstream")
    defs = root / "envdefs"
    for rel in DEBIAN_PARTS:
        src, target = REPO / "envdefs" / rel, defs / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, target)
    shutil.copytree(os.path.join(HERE, "envdefs"), defs, dirs_exist_ok=True)
    cache = python_example_store(request)
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(root / "node"),
           "ENVBUILD_STORE": str(root / "store"), "ENVBUILD_DEFS": str(defs)}
    proc = subprocess.run([sys.executable, "-m", "envbuild.cli", "--cache-from",
                           str(cache.root), "build", "base"], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, LocalStore(root / "store"), root / "node"


#: ``ENVBUILD_E2B_UPSTREAM=fleet`` runs the whole package against ``envbuild serve --fleet``
#: (slow: a manual run); CI runs the subset of ``./fleet`` that way and the rest on one node
MODE_VARIABLE = "ENVBUILD_E2B_UPSTREAM"


def fleet_mode(item: pytest.Item) -> bool:
    """Whether ``item`` runs against a ``--fleet`` server (``MODE_VARIABLE``, or ``./fleet``)."""
    return os.environ.get(MODE_VARIABLE) == "fleet" or "/e2b_upstream/fleet/" in item.nodeid


#: what a fleet sandbox cannot do, by upstream test (``module::name``): strict xfails in fleet
#: mode, each naming the limitation (docs/e2b.md "On a Ray fleet")
_MEMORY_PAUSE = ("a fleet keeps a paused sandbox's files only (pause publishes its pack-diff "
                 "to the shared store): no auto-pause with memory")
FLEET_CANNOT = {
    "sync.test_create::test_keep_memory_none_defaults_to_full_memory": _MEMORY_PAUSE,
    "sync.test_create::test_auto_pause_without_auto_resume_requires_connect": _MEMORY_PAUSE,
    "sync.test_create::test_auto_resume_wakes_on_http_request": _MEMORY_PAUSE,
    "sync.test_connect::test_connect_to_paused_sandbox_resumes": _MEMORY_PAUSE,
    **dict.fromkeys(("sync.test_snapshot::test_snapshot",
                     "sync.test_snapshot_api::test_list_snapshots",
                     "sync.test_snapshot_api::test_list_snapshots_for_sandbox",
                     "sync.test_snapshot_api::test_list_snapshots_filtered_by_name",
                     "sync.test_snapshot_api::test_delete_snapshot"),
                    "a fleet's snapshot keeps files only (a pack-diff in the shared store): "
                    "no snapshot with memory, the SDK's default"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function) or not fleet_mode(item):
            continue
        test = item.function.__module__.removeprefix(__package__ + ".") + "::"
        test += item.originalname
        if test in FLEET_CANNOT:
            item.add_marker(pytest.mark.xfail(reason=FLEET_CANNOT[test], strict=True))


@pytest.fixture(scope="package")
def e2b_server(e2b_built, request):
    """The shared ``envbuild serve`` (``serving``), once for the package; with
    ``MODE_VARIABLE`` set to ``fleet``, ``fleet_serving``."""
    if os.environ.get(MODE_VARIABLE) == "fleet":
        yield from fleet_serving(e2b_built, request.getfixturevalue("ray_cluster"))
    else:
        yield from serving(e2b_built)


def fleet_serving(built, cluster):
    """``envbuild serve --fleet`` on the session's Ray cluster (``ray_cluster``), the fleet's
    daemons started on ``built``'s store (``fleet_daemons``), with the SDK's variables set."""
    from tests.e2b_server import e2b_env, running_server
    from tests.integration.test_e2b_fleet import fleet_daemons

    root, store, _ = built
    # its own directory: the one-node server may run at the same time (CI runs both), and two
    # servers on one node dir would share its disk pool and records
    where = root / "fleet"
    where.mkdir(exist_ok=True)
    with fleet_daemons(cluster.address, store.root, where / "nodes"), \
            running_server(where, store.root, where / "node",
                           args=("--fleet", cluster.address)) as srv, e2b_env(srv):
        yield srv


@pytest.fixture
def sandbox_test_id() -> str:
    return "test_" + "".join(random.choices(string.ascii_lowercase + string.digits, k=8))


@pytest.fixture
def test_api_key() -> str:
    """Upstream's: a key of E2B's format for tests that do not reach the control plane."""
    return "e2b_" + "0" * 40


@pytest.fixture
def template() -> str:
    return "base"


@pytest.fixture
def debug() -> bool:
    return os.getenv("E2B_DEBUG") is not None


@pytest.fixture(autouse=True)
def skip_by_debug(request, debug):
    if request.node.get_closest_marker("skip_debug") and debug:
        pytest.skip("skipped because E2B_DEBUG is set")


@pytest.fixture
def sandbox_factory(request, e2b_server, template, sandbox_test_id):
    from e2b import Sandbox

    def factory(*, template_name: str = template, **kwargs):
        kwargs.setdefault("metadata", {}).setdefault("sandbox_test_id", sandbox_test_id)
        sandbox = Sandbox.create(template_name, **kwargs)
        request.addfinalizer(sandbox.kill)
        return sandbox

    return factory


#: envbuild: modules whose tests each use ``sandbox`` without changing what another of them
#: sees (each its own file names; commands that end or time out), so one sandbox serves the
#: module instead of one per test (upstream's per-test sandbox costs a create and a kill each)
SHARED_SANDBOX = frozenset({
    "sync.files.test_read", "sync.files.test_write", "sync.files.test_info",
    "sync.files.test_make_dir", "sync.files.test_content_encoding", "sync.files.test_rename",
    "sync.files.test_remove", "sync.commands.test_run", "sync.commands.test_send_stdin"})


@pytest.fixture(scope="module")
def module_sandbox(e2b_server):
    """envbuild: one sandbox of ``base`` for a module of ``SHARED_SANDBOX``, killed after it."""
    from e2b import Sandbox

    sandbox_test_id = "test_" + "".join(random.choices(string.ascii_lowercase + string.digits,
                                                       k=8))
    sandbox = Sandbox.create("base", timeout=1800, metadata={"sandbox_test_id": sandbox_test_id})
    yield sandbox
    sandbox.kill()


@pytest.fixture
def sandbox(request, sandbox_factory):
    # the test's own module: ``./fleet`` runs upstream's tests from their modules
    module = request.function.__module__.removeprefix(__package__ + ".")
    if module in SHARED_SANDBOX:  # envbuild: see SHARED_SANDBOX
        return request.getfixturevalue("module_sandbox")
    return sandbox_factory()


@pytest.fixture
def async_sandbox_factory(e2b_server, template, sandbox_test_id):
    """Upstream's async factory; the sandboxes are killed by id after the test (its loop is
    gone by then)."""
    from e2b import AsyncSandbox, Sandbox

    made: list[str] = []

    async def factory(*, template_name: str = template, **kwargs):
        kwargs.setdefault("metadata", {}).setdefault("sandbox_test_id", sandbox_test_id)
        sandbox = await AsyncSandbox.create(template_name, **kwargs)
        made.append(sandbox.sandbox_id)
        return sandbox

    yield factory
    for sandbox_id in made:
        Sandbox.kill(sandbox_id)


@pytest.fixture
def async_sandbox(async_sandbox_factory):
    return _Deferred(async_sandbox_factory)
