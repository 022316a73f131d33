"""CLI start-up (issue 12, item 10): heavy imports only in the commands that need them.

Each check runs a fresh interpreter (the only honest view of ``sys.modules``) and lists which
of the heavy top-level packages it imported. The timing goal itself is measured by
``benchmarks/cli_startup.py``; this pins the cause, so a stray module-level import fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

HEAVY = ("networkx", "jsonschema", "referencing", "boto3", "botocore", "rich", "zstandard",
         "yaml", "runtime_shim", "concurrent", "envbuild.defs", "envbuild.plan",
         "envbuild.build", "envbuild.store", "envbuild.jobs")

_PROBE = """
import json, sys
argv = sys.argv[1:]
if argv:
    from envbuild.cli.main import main
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    assert code == 0, code
else:
    import envbuild.cli.main
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def _heavy_imports(*argv: str) -> set[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stderr.strip().splitlines()[-1])
    return {h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in modules)}


def test_importing_the_cli_imports_nothing_heavy():
    assert _heavy_imports() == set()


def test_version_imports_nothing_heavy():
    assert _heavy_imports("--version") == set()


def test_layer_ls_imports_only_zstandard(tmp_path):
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_text("hi\n")
    from envbuild.layers import pack_to_file

    pack_to_file(src, tmp_path / "layer")
    assert _heavy_imports("layer", "ls", str(tmp_path / "layer")) == {"zstandard"}
