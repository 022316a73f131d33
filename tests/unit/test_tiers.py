"""The test tiers (docs/testing.md, tests/conftest.py): every test is in exactly one, from its
directory or its own mark, and a run with a test in none or in two stops at collection; a
fast-tier test that asks for root or a tool, starts a program or connects beyond loopback fails.

Each case runs pytest in-process (``pytester``) on a small tree of its own whose conftest uses
the real tier code of tests/conftest.py with its own directory table."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = '''
from pathlib import Path

import pytest

from tests.conftest import (  # noqa: F401  (hooks and fixtures registered by name)
    _fast_tier_guard, assign_tiers, pytest_runtest_protocol, tier_error)


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: tier")
    config.addinivalue_line("markers", "integration: tier")


def pytest_collection_modifyitems(config, items):
    problems = assign_tiers(items, Path(__file__).parent,
                            {"quick": "fast", "real": "integration"})
    if problems:
        raise pytest.UsageError(tier_error(problems))
'''


@pytest.fixture
def tree(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\naddopts = --strict-markers -p no:cacheprovider -p no:hypothesispytest\n")
    return pytester


def _write(pytester: pytest.Pytester, rel: str, source: str) -> None:
    path = pytester.path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def _selected(pytester: pytest.Pytester, marker: str) -> list[str]:
    result = pytester.runpytest("--collect-only", "-q", "-m", marker)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    return sorted(line for line in result.stdout.lines if "::" in line)


def test_a_test_takes_its_directorys_tier_unless_it_or_its_module_says_otherwise(tree):
    _write(tree, "quick/test_a.py", "import pytest\n\n"
           "def test_plain():\n    pass\n\n"
           "@pytest.mark.integration\ndef test_needs_root():\n    pass\n")
    _write(tree, "quick/test_b.py", "import pytest\n\npytestmark = pytest.mark.integration\n\n"
           "def test_module_marked():\n    pass\n")
    _write(tree, "real/test_c.py", "def test_real():\n    pass\n")
    assert _selected(tree, "fast") == ["quick/test_a.py::test_plain"]
    assert _selected(tree, "integration") == ["quick/test_a.py::test_needs_root",
                                              "quick/test_b.py::test_module_marked",
                                              "real/test_c.py::test_real"]


def test_a_test_in_no_tier_stops_the_run_naming_it(tree):
    _write(tree, "quick/test_a.py", "def test_fine():\n    pass\n")
    _write(tree, "newdir/test_x.py", "def test_lost():\n    pass\n")
    result = tree.runpytest("-m", "fast")  # even a run that would not select it
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "1 test(s) not in exactly one tier" in err
    assert "newdir/test_x.py::test_lost: in no tier" in err
    assert "DIRECTORY_TIERS" in err and "docs/testing.md" in err
    assert "test_fine" not in err


def test_a_test_in_two_tiers_stops_the_run_naming_both(tree):
    _write(tree, "quick/test_a.py", "import pytest\n\npytestmark = pytest.mark.fast\n\n"
           "@pytest.mark.integration\ndef test_both():\n    pass\n")
    result = tree.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "quick/test_a.py::test_both: in fast and integration" in result.stderr.str()


@pytest.mark.parametrize("body, need", [
    ("from tests.conftest import require_root\n    require_root()", "needs root"),
    ("from tests.conftest import require_tool\n    require_tool('runc')", "needs the tool 'runc'"),
    ("import subprocess\n    subprocess.run(['true'])", "must not start programs"),
    ("import socket\n    socket.create_connection(('192.0.2.1', 80), timeout=5)",
     "must not connect to 192.0.2.1 (loopback only)"),
])
def test_a_fast_test_that_needs_root_or_a_tool_starts_a_program_or_connects_out_fails(tree, body, need):
    _write(tree, "quick/test_a.py", f"def test_greedy():\n    {body}\n")
    _write(tree, "real/test_b.py", f"def test_allowed():\n    {body}\n")
    result = tree.runpytest("-q", "quick/test_a.py")
    result.assert_outcomes(failed=1)
    assert f"a fast-tier test {need}" in result.stdout.str()
    assert "integration tier" in result.stdout.str()
    if "require" in body:  # (this test is fast itself: it cannot start or connect either)
        # the same code in the integration tier passes the guard (then fails without root)
        result = tree.runpytest("-q", "real/test_b.py")
        assert "fast-tier" not in result.stdout.str()
