"""The public surface of ``envbuild.layers`` (issue 38, item 3).

``envbuild.layers.__all__`` is sorted (constants, classes, functions) and complete: every name
the package exports lazily is in it and importable. Code outside the package imports only those
names, never a private module (``envbuild.layers._x``); the sites that still do are listed in
``KNOWN`` with who switches them, and the list only shrinks. (That ``envbuild.layers`` imports
nothing above it, ``envbuild.store`` included, is ``test_import_rule``'s rooms.)
"""

from __future__ import annotations

import envbuild.layers as layers
from tests.layering import REPO, imported_modules, module_name, within

#: (importing module, private layers module) -> who switches it to ``envbuild.layers``.
KNOWN: dict[tuple[str, str], str] = {}

#: White-box tests of private internals: the tar codec, and the reader limits the bomb tests
#: lower with monkeypatch (not API).
WHITE_BOX = {("tests.unit.test_layers_format", "envbuild.layers._tar"),
             ("tests.unit.test_layers_bombs", "envbuild.layers._reader"),
             ("tests.unit.test_layers_bombs", "envbuild.layers._toc")}


def _private_layers_module(target: str) -> str | None:
    parts = target.split(".")
    if parts[:2] == ["envbuild", "layers"] and len(parts) > 2 and parts[2].startswith("_"):
        return ".".join(parts[:3])
    return None


def private_imports() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    paths = [*REPO.glob("envbuild/**/*.py"), *REPO.glob("runtime_shim/**/*.py"),
             *REPO.glob("tests/**/*.py"), *REPO.glob("benchmarks/**/*.py")]
    for path in sorted(paths):
        name = module_name(path)
        if within(name, "envbuild.layers"):
            continue
        for line, target in imported_modules(path):
            private = _private_layers_module(target)
            if private is not None and (name, private) not in WHITE_BOX:
                found.setdefault((name, private), []).append(
                    f"{path.relative_to(REPO)}:{line} imports {target}")
    return found


def test_all_is_sorted_and_every_name_imports():
    def kind(n: str) -> tuple[int, str]:
        return (0 if n.isupper() else 1 if n[0].isupper() else 2, n)

    assert layers.__all__ == sorted(layers.__all__, key=kind)
    assert len(set(layers.__all__)) == len(layers.__all__)
    for name in layers.__all__:
        assert getattr(layers, name) is not None, name
    lazy = set(layers._LAZY)
    assert lazy <= set(layers.__all__), lazy - set(layers.__all__)


def test_nothing_outside_the_package_imports_a_private_layers_module():
    new = {k: v for k, v in private_imports().items() if k not in KNOWN}
    assert new == {}, "import these names from envbuild.layers (add them to __all__ if missing)"


def test_every_known_private_import_still_exists():
    assert set(KNOWN) <= set(private_imports()), set(KNOWN) - set(private_imports())


def test_the_cli_help_names_a_layer_as_the_api_does():
    from envbuild.cli.cmd_layer import LAYER_HELP

    assert LAYER_HELP == layers.REF_HELP


# -- a store is passed in: layers uses only the Store methods it names --------------------------


def test_pack_to_store_puts_once_under_the_writers_digest_and_a_changed_file_is_refused(tmp_path):
    """``put_packed`` hands the writer's digest to ``Store.put``, which verifies it: the blob
    is read once (no hashing pass first), and a file that changed after packing is refused
    by the store (``DigestMismatch``), never stored under a digest it does not have."""
    import pytest

    from envbuild.errors import DigestMismatch
    from envbuild.store import MemoryStore

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x\n")
    store = MemoryStore()
    info = layers.pack_to_store(tmp_path / "src", store)
    assert store.calls["put"] == 1 and store.get_range(info.digest, 0, 4) == b"\x28\xb5\x2f\xfd"

    out = tmp_path / "l"
    info = layers.pack_to_file(tmp_path / "src", out)
    out.write_bytes(out.read_bytes()[:-1] + b"\0")
    other = MemoryStore()
    with pytest.raises(DigestMismatch):
        layers.put_packed(other, out, info)
    assert list(other.list()) == []


def test_a_layer_opens_by_digest_prefix_from_any_store_shaped_object(tmp_path):
    """``open_layer`` needs ``list``, ``stat`` and ``get_range`` of a store, nothing more."""
    from envbuild.store import MemoryStore

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x\n")
    full = MemoryStore()
    info = layers.pack_to_store(tmp_path / "src", full)

    class Blobs:  # only the three methods
        list, stat, get_range = full.list, full.stat, full.get_range

    with layers.open_layer(info.digest[7:7 + 12], Blobs) as reader:
        assert reader.name == info.digest
        assert layers.read_member(reader, "f") == b"x\n"
