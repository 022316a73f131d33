"""A hand-made layer whose member carries an attribute the kernel refuses (issue 34, item 8):
a ``security.capability`` value that is no file capability (here ``y``, beside
``trusted.overlay.opaque=y``, as found) made every unpack fail with "[Errno 22] Invalid
argument: 5", naming neither the member nor the attribute. It is one line naming both."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from envbuild.layers import pack_tar
from tests.conftest import REPO, require_root


def _layer(path: Path, member_type: bytes) -> None:
    """A layer (envbuild's format, via ``pack_tar``) with ``d/`` and ``d/f``; the member of
    ``member_type`` carries the two attributes."""
    xattrs = {"SCHILY.xattr.security.capability": "y", "SCHILY.xattr.trusted.overlay.opaque": "y"}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, typ in (("d", tarfile.DIRTYPE), ("d/f", tarfile.REGTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = typ, 0o755
            if typ == member_type:
                info.pax_headers = xattrs
            t.addfile(info, io.BytesIO(b"") if typ == tarfile.REGTYPE else None)
    raw.seek(0)
    with open(path, "wb") as out:
        pack_tar(raw, out, name="crafted")


@pytest.mark.parametrize(("member_type", "member"), [(tarfile.DIRTYPE, "d"),
                                                     (tarfile.REGTYPE, "d/f")])
@pytest.mark.parametrize("whiteouts", ["apply", "overlay"])
def test_an_attribute_the_kernel_refuses_is_named_in_one_line(tmp_path, member_type, member,
                                                              whiteouts):
    require_root()  # security.capability needs CAP_SETFCAP
    layer = tmp_path / "crafted.layer"
    _layer(layer, member_type)
    done = subprocess.run([sys.executable, "-m", "envbuild.cli", "layer", "unpack", str(layer),
                           str(tmp_path / "out"), "--whiteouts", whiteouts],
                          capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1, done.stderr
    first = done.stderr.splitlines()[0]
    assert f"member {member!r}" in first and "'security.capability'" in first, done.stderr
    assert "Errno" not in done.stderr and "Traceback" not in done.stderr, done.stderr
