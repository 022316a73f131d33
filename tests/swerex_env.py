"""A SWE-ReX env for tests that run ``swerex-remote`` in real sandboxes
(``tests/integration/test_swerex.py``, ``tests/integration/swerex_upstream/``,
``tests/security/test_swerex_forward.py``).

The env ``py-swerex`` is the ``pyhost`` Python base (``tests/py_env.py``) with what SWE-ReX's
sessions need besides Python, as a Debian image has them — the host's ``bash`` (its pexpect
sessions run ``/usr/bin/env bash``) with Debian's ``/etc/bash.bashrc`` prompt (``BASHRC``),
``less``, ``/usr/bin/env`` and ``/usr/bin/python`` links, the host's shared libraries that the
wheels' extension modules link (pydantic-core's: ``libgcc_s``, ``librt`` …) — and a ``swerex``
toolkit: swe-rex 1.4.0 in a venv under ``/opt/toolkits/swerex``, only ``bin/swerex-remote`` on
PATH. The toolkit is built as a user without network access to PyPI would build it: the
wheels of ``tests/swerex_requirements.txt`` (every one pinned by sha256) are pip-downloaded on
the host into a cache the test owns, copied into the build, and installed there with pip run
from its own (sha256-checked) wheel: ``--no-index --require-hashes --only-binary :all:``, the
build step without network.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO, require_tool
from tests.py_env import PyTree, _libraries, copy_host_files, make_py_tree

ENV = "py-swerex"
REQUIREMENTS = REPO / "tests/swerex_requirements.txt"
#: pip itself, run from its wheel in the build (the pyhost base has no pip)
PIP = ("pip", "26.2.1", "71138adf1f4ca900cdb7d289c21b7494329f2332b6d85f0e1c42108c0384ed3e")
PIP_WHEEL = f"{PIP[0]}-{PIP[1]}-py3-none-any.whl"
TOOLKIT_YAML = f"""\
    apiVersion: envbuild/v1
    kind: Toolkit
    name: swerex
    description: swe-rex 1.4.0 (swerex-remote) in a venv, installed from pinned wheels offline
    build_on: pyhost
    prefix: /opt/toolkits/swerex
    steps:
      - copy: {{src: files/swerex, dest: /opt/toolkits/swerex/.build}}
      - name: install swe-rex from the pinned wheels
        network: none
        run: |
          set -eu
          P=/opt/toolkits/swerex
          mkdir -p "$TMPDIR" "$P/bin"
          python3 -m venv --without-pip "$P/venv"
          "$P/venv/bin/python3" "$P/.build/{PIP_WHEEL}/pip" install --no-index \\
            --find-links "$P/.build" --require-hashes --only-binary :all: \\
            -r "$P/.build/requirements.txt"
          ln -s ../venv/bin/swerex-remote "$P/bin/swerex-remote"
          rm -rf "$P/.build" "$TMPDIR"
          "$P/venv/bin/python3" -c 'import swerex.server'
        env:
          TMPDIR: /opt/toolkits/swerex/.tmp
          PIP_NO_CACHE_DIR: "1"
          PIP_DISABLE_PIP_VERSION_CHECK: "1"
          PIP_NO_INPUT: "1"
          PYTHONDONTWRITEBYTECODE: "1"
          SOURCE_DATE_EPOCH: "0"
    config:
      env: {{PATH: /opt/toolkits/swerex/bin:$PATH}}
    """
ENV_YAML = f"""\
    apiVersion: envbuild/v1
    kind: Env
    name: {ENV}
    base: pyhost
    toolkits: [swerex]
    config: {{workdir: /workspace}}
    """


#: Debian's ``/etc/bash.bashrc`` prompt lines: an interactive bash sets its own first prompt.
#: Without them the first prompt of a SWE-ReX session is the marker it puts in PS1, which its
#: ``start`` does not read, and the session's first command sees that stale prompt (docs).
BASHRC = """\
[ -z "$PS1" ] && return
PS1='\\u@\\h:\\w\\$ '
"""


def extension_modules(wheels: Path, out: Path) -> list[str]:
    """The extension modules (``*.so``) of the wheels in ``wheels``, unpacked under ``out``."""
    found = []
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.endswith(".so"):
                    found.append(z.extract(name, out / wheel.stem))
    return found


def swerex_extras(wheels: Path) -> Callable[[Path], None]:
    """What SWE-ReX needs in the pyhost root besides Python (module docstring)."""

    def add(rootfs: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            libs = _libraries(extension_modules(wheels, Path(tmp)))
        tools = [require_tool("bash"), require_tool("less")]  # fail loudly when missing
        copy_host_files(rootfs, [*tools, *sorted(libs)])
        (rootfs / "usr/bin/env").symlink_to("/bin/busybox")
        (rootfs / "usr/bin/python").symlink_to("python3.11")
        (rootfs / "etc/bash.bashrc").write_text(BASHRC)

    return add


def download_wheels(cache: Path) -> None:
    """The pinned wheels (pip checks each sha256) and pip's own (checked here) in ``cache``."""
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary",
           ":all:", "-d", str(cache)]
    subprocess.run([*pip, "--require-hashes", "-r", str(REQUIREMENTS)], check=True,
                   capture_output=True, timeout=600)
    subprocess.run([*pip, f"{PIP[0]}=={PIP[1]}"], check=True, capture_output=True, timeout=600)
    digest = hashlib.sha256((cache / PIP_WHEEL).read_bytes()).hexdigest()
    assert digest == PIP[2], f"{PIP_WHEEL}: sha256 {digest}, pinned {PIP[2]}"


def make_swerex_tree(root: Path) -> PyTree:
    """A tree at ``root`` with ``py-swerex`` built (module docstring)."""
    wheels = root / "wheels"
    wheels.mkdir(parents=True)
    download_wheels(wheels)
    tree = make_py_tree(root, extra=swerex_extras(wheels))
    files = tree.defs / "toolkits/files/swerex"
    shutil.copytree(wheels, files)
    shutil.copy(REQUIREMENTS, files / "requirements.txt")
    tree.write("toolkits/swerex.yaml", TOOLKIT_YAML)
    tree.write(f"envs/{ENV}.yaml", ENV_YAML)
    tree.cli("build", ENV)
    return tree
