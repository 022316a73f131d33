"""Golden keys of the example ``envdefs/``: a key that moves is a decision, not an accident.

Regenerate with ``ENVBUILD_UPDATE_GOLDENS=1 .venv/bin/python -m pytest tests/unit/test_plan_golden.py``
after a change that is *meant* to move keys (an edited example, a new key version), and commit
the golden file with it. The file holds each layer's key *and* its key inputs, so the failure
diff says which input moved.

Pinned for real: every file and tree inside the repository (``sources/``, ``envdefs/**/files``).
Not pinned: files outside it (the host's ``/bin/busybox`` of ``busybox-tiny``), which differ from
machine to machine; they get a fixed placeholder digest here. Tree digests include permission
bits, so the repository is expected to be checked out with the usual umask 022.
"""

from __future__ import annotations

import difflib
import json
import os

from envbuild.build.pin import Pinner, pin_inputs
from envbuild.defs import load_definitions
from envbuild.plan.graph import build_graph
from envbuild.plan.keys import compute_keys
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "unit" / "golden" / "envdefs_keys.json"
HOST_FILE = "sha256:" + "0" * 64


class RepoOnlyPinner(Pinner):
    def path(self, base_dir: str, rel: str) -> str:
        full = os.path.realpath(os.path.join(base_dir, rel))
        if not full.startswith(str(REPO) + os.sep):
            return HOST_FILE
        return super().path(base_dir, rel)


def render_keys() -> str:
    defs = load_definitions(REPO / "envdefs")
    graph = build_graph(defs)
    keys = compute_keys(graph, pin_inputs(defs, RepoOnlyPinner()))
    doc = {"layers": {n: {"key": keys.layers[n], "inputs": keys.inputs[n]}
                      for n in sorted(keys.layers)},
           "envs": dict(sorted(keys.env_locks.items()))}
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def test_envdefs_keys_match_the_golden_file():
    got = render_keys()
    if os.environ.get("ENVBUILD_UPDATE_GOLDENS") == "1":
        GOLDEN.write_text(got)
    want = GOLDEN.read_text() if GOLDEN.exists() else ""
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                            str(GOLDEN.relative_to(REPO)), "computed now"))
        raise AssertionError("layer keys of envdefs/ changed; if intended, rerun with "
                             "ENVBUILD_UPDATE_GOLDENS=1 and commit the golden file\n" + diff)


def test_golden_keys_are_stable_across_runs():
    assert render_keys() == render_keys()
