"""Every test of the real tree is in exactly one tier, the one its directory or its own mark
says (issue 12, item 8; issue 38, item 4; docs/testing.md).

Collects the whole tree in-process (``--collect-only``: no test runs, but importing the
integration modules probes tools, hence not a fast test) and checks each collected test's tier:
every test under tests/integration and tests/security, and every store test that starts a
server (moto S3, a registry), is ``integration``; the memory and local conformance runs are
``fast``; a test under tests/unit is ``fast`` unless it or its module is marked otherwise.
(A test in no tier or two already stops the collection: tests/conftest.py, and
tests/unit/test_tiers.py for that rule on a tree of its own.)
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO, tiers_of


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


def _tier(item: pytest.Item) -> str:
    tiers = tiers_of(item)
    assert len(tiers) == 1, f"{item.nodeid}: {tiers}"
    return tiers[0]


def _own_mark(item: pytest.Item) -> bool:
    """Whether the test, its class or its module carries a tier mark of its own."""
    node: pytest.Item | pytest.Collector | None = item
    while node is not None and not isinstance(node, pytest.Package | pytest.Session):
        if any(m.name in ("fast", "integration") for m in node.own_markers):
            return True
        node = node.parent
    return False


def test_every_test_is_in_the_tier_its_directory_or_its_mark_says():
    from tests.store.conftest import starts_a_server

    items = _collect("tests")
    assert len(items) > 2000
    by_dir: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_dir.setdefault(item.path.relative_to(REPO / "tests").parts[0], []).append(item)
    assert sorted(by_dir) == ["integration", "security", "store", "unit"]
    assert [i.nodeid for d in ("integration", "security") for i in by_dir[d]
            if _tier(i) != "integration"] == []
    unit_integration = [i for i in by_dir["unit"] if _tier(i) == "integration"]
    assert [i.nodeid for i in unit_integration if not _own_mark(i)] == []
    assert len(unit_integration) < len(by_dir["unit"]) / 10  # the exceptions stay exceptions
    servers = [i for i in by_dir["store"] if starts_a_server(i)]
    assert servers, "no store test starts a server: the rule below checks nothing"
    assert [i.nodeid for i in servers if _tier(i) != "integration"] == []
    # The in-memory and local runs of the conformance suite stay in the fast tier.
    fast = [i for i in by_dir["store"] if getattr(i, "callspec", None) is not None
            and i.callspec.params.get("backend") in ("memory", "local")]
    assert fast and all(_tier(i) == "fast" for i in fast)
