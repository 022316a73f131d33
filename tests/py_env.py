"""A Python env for tests that need one in a real sandbox (grading, mini-swe-agent, the grade
benchmark): a Base from a ``rootfs:`` directory assembled from this host — busybox (and its
applets as ``/bin`` links), Debian's ``python3.11`` with its standard library and the shared
libraries everything links (``ldd``), ``git``, and pytest with its dependencies copied from the
project's venv into ``/usr/lib/python3/dist-packages``. Tens of MB, built once per session
(``PyTree``): tests add their own workspaces, envs and tasks to the one definition tree and
build only those, so the base is built once and every later build finds it in the store.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from envbuild.store import LocalStore

PYTHON = "/usr/bin/python3.11"
GIT = "/usr/bin/git"
#: pytest and what it imports, copied from the venv that runs the tests
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py")
#: parts of the standard library no test uses (GUI, the 2to3 and IDLE tools)
STDLIB_SKIP = ("idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data",
               "config-3.11-x86_64-linux-gnu")
BASE_YAML = """\
apiVersion: envbuild/v1
kind: Base
name: pyhost
abi: pyhost-311
from: {rootfs: files/pyhost-root}
config:
  env: {PATH: /usr/local/bin:/usr/bin:/bin, LANG: C.UTF-8, HOME: /root}
  user: "0:0"
"""


def _copy_with_parents(src: str, root: Path) -> None:
    """``src`` (a host path) at the same path under ``root``; symlinks kept as links, their
    targets copied too."""
    target = root / src.lstrip("/")
    if target.exists() or target.is_symlink():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if os.path.islink(src):
        link = os.readlink(src)
        os.symlink(link, target)
        _copy_with_parents(os.path.normpath(os.path.join(os.path.dirname(src), link)), root)
    else:
        shutil.copy2(src, target)


def _libraries(binaries: list[str]) -> set[str]:
    libs: set[str] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
        for line in out.splitlines():
            path = line.split("=>")[-1].split("(")[0].strip()
            if path.startswith("/"):
                libs.add(path)
    return libs


def assemble_rootfs(root: Path) -> None:
    """The pyhost root at ``root`` (see the module docstring)."""
    for d in ("bin", "etc", "tmp", "root", "workspace", "usr/lib/python3/dist-packages"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for applet in applets:
        if not (root / "bin" / applet).exists():
            os.symlink("busybox", root / "bin" / applet)
    stdlib = root / "usr/lib/python3.11"
    shutil.copytree("/usr/lib/python3.11", stdlib, symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in STDLIB_SKIP])
    for binary in (PYTHON, GIT):
        _copy_with_parents(binary, root)
    (root / "usr/bin/python3").symlink_to("python3.11")
    dynload = [str(p) for p in Path("/usr/lib/python3.11/lib-dynload").glob("*.so")]
    for lib in _libraries([PYTHON, GIT, *dynload]):
        _copy_with_parents(lib, root)
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    for name in PYTEST_PACKAGES:
        src = site / name
        if src.is_dir():
            shutil.copytree(src, root / "usr/lib/python3/dist-packages" / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, root / "usr/lib/python3/dist-packages" / name)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                     "agent:x:1000:1000:agent:/workspace:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\nagent:x:1000:\n")
    (root / "etc/gitconfig").write_text("[safe]\n\tdirectory = *\n")


@dataclasses.dataclass
class PyTree:
    """One definition tree with the ``pyhost`` base, its store and node cache."""

    root: Path
    defs: Path
    store_dir: Path
    node: Path

    @property
    def store(self) -> LocalStore:
        return LocalStore(self.store_dir)

    def env(self) -> dict[str, str]:
        return {**os.environ, "ENVBUILD_NODE_CACHE": str(self.node),
                "ENVBUILD_STORE": str(self.store_dir), "ENVBUILD_DEFS": str(self.defs)}

    def write(self, rel: str, text: str) -> Path:
        """Write a definition (or source file) ``rel`` under the tree, dedented."""
        path = self.defs / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """``envbuild ARGS`` on this tree in a fresh process; fails the caller on exit != 0."""
        proc = subprocess.run([sys.executable, "-m", "envbuild.cli", *args], env=self.env(),
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"envbuild {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stderr[-3000:]}")
        return proc


def copy_host_files(root: Path, paths: list[str]) -> None:
    """Host files ``paths`` at the same paths under ``root``, with the shared libraries they
    link (a ``make_py_tree`` ``extra`` adds tools this way)."""
    for path in [*paths, *_libraries(paths)]:
        _copy_with_parents(path, root)


def make_py_tree(root: Path, extra: Callable[[Path], None] | None = None) -> PyTree:
    """The tree at ``root`` with ``pyhost`` built into its store (a minute at most);
    ``extra(rootfs)`` adds to the base's root before it is built."""
    tree = PyTree(root=root, defs=root / "envdefs", store_dir=root / "store", node=root / "node")
    assemble_rootfs(tree.defs / "base" / "files" / "pyhost-root")
    if extra is not None:
        extra(tree.defs / "base" / "files" / "pyhost-root")
    tree.write("base/pyhost.yaml", BASE_YAML)
    tree.cli("build", "pyhost")
    return tree
