"""Every runnable block of README.md and docs/ runs, in page order, as a reader would run it
(the convention: tests/docblocks.py, docs/contributing-docs.md).

Each page gets a fresh project dir laid out as a clone after ``bash scripts/main.sh``:
``envdefs/`` and ``sources/`` copied from the repository, ``.venv`` the repository's, and the
default store ``./cache`` already holding built layers (a hard-linked copy: blobs are never
written in place). The README's tutorial needs the Python base, so its store is the session's
build of all of ``envdefs/`` (``cluster_examples``, shared with the rest of the suite); every
other page gets the busybox env, built once for this module. The CLI's own defaults
(``./cache``, ``./envdefs``) are left alone: only the node cache points at a temp dir.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docblocks import Block, blocks, pages
from tests.integration.conftest import EXAMPLE_PARTS, build_busybox_env
from tests.leftovers import assert_nothing_left_under

RUNNABLE = [p for p in pages() if any(b.runs for b in blocks(p))]
#: Pages whose examples need the Python envs of envdefs/ (the rest use env/busybox-shell).
NEEDS_EXAMPLES = {REPO / "README.md"}


@pytest.fixture(scope="module")
def busybox_store(tmp_path_factory):
    store, _node = build_busybox_env(tmp_path_factory.mktemp("docs-busybox"))
    return Path(store.root)


def _project(root: Path, store: Path) -> Path:
    for rel in EXAMPLE_PARTS:
        src, target = REPO / rel, root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, target)
    (root / ".venv").symlink_to(Path(sys.prefix))
    subprocess.run(["cp", "-al", str(store), str(root / "cache")], check=True)
    return root


def _env(root: Path, node: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVBUILD_")}
    env.update(PATH=f"{root / '.venv/bin'}:{os.environ['PATH']}", PYTHONPATH=str(REPO),
               ENVBUILD_NODE_CACHE=str(node), PYTHONUNBUFFERED="1")
    return env


def _run(block: Block, root: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    if block.lang == "sh":
        argv = ["bash", "-euo", "pipefail", "-c", block.text]
    elif block.lang == "python":
        argv = [sys.executable, "-c", block.text]
    elif block.lang == "yaml" and "title" in block.attrs:
        path = root / block.attrs["title"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.text, encoding="utf-8")
        argv = [sys.executable, "-m", "envbuild.cli", "validate"]
    else:   # yaml without a title, json: parsed by tests/unit/test_docs_blocks.py
        argv = ["true"]
    return subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(REPO)))
def test_page_runs(page, tmp_path, request, busybox_store):
    store = (request.getfixturevalue("cluster_examples").local_store
             if page in NEEDS_EXAMPLES else busybox_store)
    root = _project(tmp_path / "project", store)
    node = tmp_path / "node"
    env = _env(root, node)
    try:
        for block in blocks(page):
            if not block.runs:
                continue
            started = time.monotonic()
            r = _run(block, root, env)
            print(f"{block.where}: {block.lang} {time.monotonic() - started:.1f}s")
            assert r.returncode == 0, (f"{block.where} ({block.lang}) exited {r.returncode}\n"
                                       f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
    finally:
        subprocess.run([sys.executable, "-m", "envbuild.cli", "sandbox", "gc"], cwd=root,
                       env=env, capture_output=True, timeout=300)
    assert_nothing_left_under(tmp_path)


def test_every_runnable_page_is_collected():
    """The pages this module runs are the ones with a runnable block (a page whose every block
    is text or norun has nothing to run); the README and the SDK guide are among them."""
    assert REPO / "README.md" in RUNNABLE and REPO / "docs/sdk.md" in RUNNABLE
    assert all(any(b.runs for b in blocks(p)) for p in RUNNABLE)
