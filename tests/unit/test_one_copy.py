"""One copy of each fact (issue 38, item 2): the size grammar, the digest pattern and the libc
binding each live in one module, and these tests fail when a second copy appears in envbuild/
or runtime_shim/ (found by reading the code's syntax tree, so a comment or docstring that names
the fact does not count, and a renamed copy of the same text does).

- sizes: ``envbuild.sizes`` (``parse_size``, ``format_size``, ``human_size``);
- digests: ``envbuild.oci`` (``DIGEST_PATTERN``, ``is_digest``, ``digest_hex``, ``is_hex64``);
- the C library: ``envbuild.libc`` (``LIBC``, ``function``);
- an atomic write (temp file, rename): ``envbuild.atomic`` (``write_atomic``, ``atomic_file``);
  a function that both writes a file and renames one is a hand-rolled copy unless
  ``OTHER_RENAMES`` says why its contract differs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import pytest

from envbuild.errors import RuntimeShimError, SettingsError
from envbuild.oci import digest_hex, is_digest, is_hex64
from envbuild.sizes import SizeError, format_size, human_size, parse_percent, parse_size
from tests.conftest import REPO

SIZE_FUNCTIONS = {"parse_size", "format_size", "human_size", "format_bytes", "human_bytes", "parse_bytes"}
#: Text that only a digest's grammar contains (a git object id, 40 or 64 hex digits, is
#: another fact: ``[0-9a-f]{40}|[0-9a-f]{64}`` is not a digest).
DIGEST_TEXT = ("[0-9a-f]{64}", "[0-9a-fA-F]{64}")
LIBC_LOADERS = {"CDLL", "find_library", "LoadLibrary", "cdll"}


def copies(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each copy of a fact that has one home, in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name in SIZE_FUNCTIONS:
                yield node.lineno, f"size: def {node.name}"
            if node.name in {"is_digest", "digest_hex"}:
                yield node.lineno, f"digest: def {node.name}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if any(t in node.value for t in DIGEST_TEXT) and "{40}" not in node.value:
                yield node.lineno, "digest: a hex-64 pattern"
            if "{40}" in node.value:
                yield node.lineno, "gitoid: a git object id pattern"
        elif isinstance(node, ast.BoolOp) and _hand_rolled_hex64(node):
            yield node.lineno, "digest: len(...) == 64 and hex digits"
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if {"K", "M", "G"} <= keys:
                yield node.lineno, "size: a unit table"
        elif isinstance(node, ast.Attribute | ast.Name):
            name = node.attr if isinstance(node, ast.Attribute) else node.id
            if name in LIBC_LOADERS:
                yield node.lineno, f"libc: {name}"


def _hand_rolled_hex64(node: ast.BoolOp) -> bool:
    """``len(x) == 64 and <x is hex digits>``: a digest's hex part checked by hand."""
    def len_64(c: ast.expr) -> bool:
        return isinstance(c, ast.Compare) and isinstance(c.ops[0], ast.Eq) and any(
            isinstance(s, ast.Constant) and s.value == 64 for s in c.comparators) and \
            isinstance(c.left, ast.Call) and getattr(c.left.func, "id", None) == "len"
    text = ast.unparse(node)
    return any(len_64(v) for v in node.values) and any(
        h in text for h in ("0123456789abcdef", "hexdigits", "_HEX"))


#: Functions that write a file and rename it with a contract ``envbuild.atomic`` does not have.
OTHER_RENAMES = {
    "envbuild/build/scratch.py:claim_scratch": "an owner file flocked before its rename, its fd "
                                               "kept open: a lock handed over, not content",
    "envbuild/dockerd.py:_claim": "the same owner-file handover for a dockerd's directories",
    "envbuild/store/local.py:put": "a blob named by the digest of what was streamed, verified, its "
                                   "temp file flocked (list_partials tells live from crashed)",
}
_WRITES = {"write_text", "write_bytes", "write", "dump", "mkstemp", "NamedTemporaryFile"}


def hand_rolled_atomic_writes(source: str) -> Iterator[str]:
    """Names of the functions in ``source`` that write a file and rename one."""
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and _renames(fn) and any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in _WRITES for n in ast.walk(fn)):
            yield fn.name


def _renames(fn: ast.AST) -> bool:
    """``os.replace(a, b)``, ``os.rename(a, b)``, ``path.replace(other)``, ``path.rename(other)``
    (``str.replace(old, new)`` has two arguments, so it is not one)."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                and n.func.attr in ("replace", "rename"):
            on_os = isinstance(n.func.value, ast.Name) and n.func.value.id == "os"
            if len(n.args) == (2 if on_os else 1) and not n.keywords \
                    and not isinstance(n.args[0], ast.Constant):
                return True
    return False


def test_every_atomic_write_is_the_helper():
    found = set()
    for path in sorted([*REPO.glob("envbuild/**/*.py"), *REPO.glob("runtime_shim/**/*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel != "envbuild/atomic.py":
            found |= {f"{rel}:{name}" for name in hand_rolled_atomic_writes(path.read_text())}
    assert found - set(OTHER_RENAMES) == set(), "use envbuild.atomic.write_atomic / atomic_file"
    assert set(OTHER_RENAMES) <= found, "an entry of OTHER_RENAMES is gone: remove it"


def test_the_atomic_write_check_sees_a_hand_rolled_one():
    source = """
def save(path, doc):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)

def fine(text):
    return text.replace("a", "b")
"""
    assert list(hand_rolled_atomic_writes(source)) == ["save"]


def backend_lists(source: str) -> Iterator[int]:
    """Lines of tuple, list or set literals in ``source`` that name two or more backends: a copy
    of the registry (``runtime_shim.backends.backend_names()``)."""
    names = {"container", "microvm", "fncall"}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(names & {
                e.value for e in node.elts if isinstance(e, ast.Constant)}) >= 2:
            yield node.lineno


#: Lists of backends that are another fact than "the backends there are".
OTHER_BACKEND_LISTS = {
    "runtime_shim/node/reclaim.py": "CGROUP_BACKENDS: the backends whose sandboxes are cgroups "
                                    "of this host (the node cannot import the backends above it)",
}


def test_the_backend_registry_is_the_one_list():
    found = set()
    for path in sorted([*REPO.glob("envbuild/**/*.py"), *REPO.glob("runtime_shim/**/*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel != "runtime_shim/backends/base.py" and list(backend_lists(path.read_text())):
            found.add(rel)
    assert found == set(OTHER_BACKEND_LISTS), "ask runtime_shim.backends.backend_names()"
    assert list(backend_lists('BACKENDS = ("container", "microvm")')) == [1]
    for schema in (REPO / "envbuild/defs/schema").glob("*.json"):
        assert '"microvm"' not in schema.read_text(), f"{schema.name}: a copy of the backends"


HOMES = {"envbuild/sizes.py": "size", "envbuild/oci.py": "digest", "envbuild/libc.py": "libc",
         "envbuild/build/gitoid.py": "gitoid"}


def test_each_fact_has_one_copy():
    found = []
    for path in sorted([*REPO.glob("envbuild/**/*.py"), *REPO.glob("runtime_shim/**/*.py")]):
        rel = path.relative_to(REPO).as_posix()
        for line, what in copies(path.read_text()):
            if HOMES.get(rel) != what.partition(":")[0]:
                found.append(f"{rel}:{line}: {what}")
    assert found == [], ("use envbuild.sizes, envbuild.oci's digest grammar and envbuild.libc "
                         "instead of a copy")


def test_tests_scripts_and_benchmarks_load_no_libc_of_their_own():
    # benchmarks/.work holds what benchmarks build (a venv tree of third-party code): not ours
    found = [f"{path.relative_to(REPO)}:{line}" for top in ("tests", "scripts", "benchmarks")
             for path in sorted((REPO / top).rglob("*.py"))
             if ".work" not in path.relative_to(REPO).parts
             for line, what in copies(path.read_text()) if what.startswith("libc")]
    assert found == [], "use envbuild.libc"


def test_the_check_sees_each_kind_of_copy():
    source = '''
import ctypes, re
_libc = ctypes.CDLL(None)
_D = re.compile(r"sha256:[0-9a-f]{64}")
_G = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_U = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
def parse_size(text): ...
def is_digest(text): ...
ok = len(name) == 64 and set(name) <= set("0123456789abcdef")
'''
    assert sorted(what.partition(":")[0] for _, what in copies(source)) == \
        ["digest", "digest", "digest", "gitoid", "libc", "size", "size"]


@pytest.mark.parametrize(("text", "n"), [
    ("0", 0), ("1024", 1024), ("512B", 512), ("500M", 500 << 20), ("500 MB", 500 << 20),
    ("500MiB", 500 << 20), ("2G", 2 << 30), ("2gib", 2 << 30), ("2 GiB", 2 << 30),
    ("1.5GiB", int(1.5 * (1 << 30))), ("10T", 10 << 40), ("64k", 64 << 10), (" 7 ", 7),
    (2 << 30, 2 << 30), ("123456789012345678901", 123456789012345678901),
])
def test_the_size_grammar_takes_what_users_wrote_before(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "G", "-1", "1e3", "inf", "20%", "2 GG", "2X", "1,5G",
                                  -1, True, 1.5, None])
def test_anything_else_is_one_clear_error(text):
    with pytest.raises(SizeError) as e:
        parse_size(text, what="limits.memory")
    assert e.value.message == f"limits.memory: not a size: {text!r}" and "2GiB" in e.value.hint
    # callers of settings and of the runtime catch it as their own
    assert isinstance(e.value, SettingsError) and isinstance(e.value, RuntimeShimError)


def test_percentages():
    assert parse_percent("20%", what="X") == 0.2 and parse_percent(" 100 %", what="X") == 1.0
    assert parse_percent("12.5%", what="X", below_100=True) == 0.125
    for bad, below in (("20", False), ("101%", False), ("100%", True), ("-1%", False),
                       ("1e1%", False), ("%", False)):
        with pytest.raises(SizeError, match="X is not a percentage"):
            parse_percent(bad, what="X", below_100=below)


def test_settings_and_the_node_budget_use_the_one_grammar(tmp_path):
    from envbuild.settings import Settings, node_cache_budget
    from runtime_shim.node import BudgetSettings

    assert node_cache_budget("1.5G", tmp_path) == 3 << 29
    assert 0 < node_cache_budget("50%", tmp_path) <= node_cache_budget("100%", tmp_path)
    with pytest.raises(SizeError, match="ENVBUILD_NODE_CACHE_MAX is not a percentage"):
        node_cache_budget("150%", tmp_path)
    with pytest.raises(SizeError, match="ENVBUILD_NODE_CACHE_MAX: not a size: '5 parsecs'"):
        node_cache_budget("5 parsecs", tmp_path)
    assert Settings.from_env({"ENVBUILD_BUILD_DISK": "10 GB"}).build_disk_bytes == 10 << 30
    with pytest.raises(SizeError, match="ENVBUILD_HOST_RESERVE is not a percentage below 100%"):
        BudgetSettings.from_env({"ENVBUILD_HOST_RESERVE": "100%"})


def test_format_size_round_trips_and_human_size_is_decimal():
    for n in (0, 1, 1000, 1 << 10, 3 << 20, 2 << 30, 5 << 40, (2 << 30) + 1):
        assert parse_size(format_size(n)) == n
    assert format_size(2 << 30) == "2GiB" and format_size(1000) == 1000
    assert human_size(999) == "999 B" and human_size(1_234_567) == "1.2 MB"


def test_the_digest_grammar():
    hexpart = "ab" * 32
    assert is_digest(f"sha256:{hexpart}") and digest_hex(f"sha256:{hexpart}") == hexpart
    assert is_hex64(hexpart) and not is_hex64(hexpart.upper())
    for bad in (hexpart, f"sha256:{hexpart.upper()}", f"sha512:{hexpart}", f"sha256:{hexpart}\n",
                f"sha256:{hexpart[:-1]}", "sha256:../../etc", None, 7):
        assert not is_digest(bad) and digest_hex(bad) is None
