"""Every integration test carries the ``integration`` marker (issue 12, item 8).

Collects the integration, security and store suites in-process (``--collect-only``: no test
runs, but importing them probes tools, hence not a unit test) and checks each collected test's
markers: every test under
tests/integration and tests/security, and every store test that starts the moto S3 server,
must be selected by ``-m integration``; the memory and local conformance runs must not be.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO


class _Collector:
    def __init__(self) -> None:
        self.items: list[pytest.Item] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)


def _collect(*paths: str) -> list[pytest.Item]:
    collector = _Collector()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", str(REPO),
                        *[str(REPO / p) for p in paths]], plugins=[collector])
    assert code == 0, f"collecting {paths} failed (exit {code})"
    return collector.items


def _marked(item: pytest.Item) -> bool:
    return item.get_closest_marker("integration") is not None


def test_every_integration_and_security_test_is_marked():
    items = _collect("tests/integration", "tests/security")
    assert len(items) > 50
    unmarked = [item.nodeid for item in items if not _marked(item)]
    assert unmarked == []


def test_store_tests_that_start_a_server_are_marked_and_the_others_not():
    from tests.store.conftest import starts_a_server

    items = _collect("tests/store")
    servers = [item for item in items if starts_a_server(item)]
    assert servers, "no store test starts the S3 server: the rule below checks nothing"
    assert [i.nodeid for i in servers if not _marked(i)] == []
    # The in-memory and local runs of the conformance suite stay in the fast selection.
    fast = [i for i in items if getattr(i, "callspec", None) is not None
            and i.callspec.params.get("backend") in ("memory", "local")]
    assert fast and not any(_marked(i) for i in fast)
