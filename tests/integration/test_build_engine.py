"""The build engine end to end on the busybox env: real runc, overlayfs, store, locks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from envbuild.store import LocalStore, get_key_record
from tests.conftest import require_tool
from tests.oci_schemas import IMAGE_SPEC, assert_valid


def test_build_then_everything_cached(envbuild_cli):
    first = envbuild_cli("build", "--json")
    assert first.code == 0, first.err
    report = first.json()
    assert {lay["name"]: lay["status"] for lay in report["layers"]} == {
        "busybox-tiny": "built", "kvsh": "built", "shtest": "built"}
    assert report["locks"][0]["env"] == "busybox-shell" and report["locks"][0]["digest"]

    second = envbuild_cli("build", "--json")
    assert second.code == 0
    assert {lay["status"] for lay in second.json()["layers"]} == {"cached"}
    assert second.json()["locks"][0]["digest"] == report["locks"][0]["digest"]

    plan = envbuild_cli("plan", "--json")
    assert {lay["status"] for lay in plan.json()["layers"]} == {"cached"}


def test_lock_is_a_real_oci_image(envbuild_cli, tmp_path):
    assert envbuild_cli("build").code == 0
    store = LocalStore(envbuild_cli.store)
    index = json.loads((envbuild_cli.store / "index.json").read_text())
    assert_valid(IMAGE_SPEC, "image-index-schema.json", index)
    manifest_digest = store.get_ref("env/busybox-shell").digest
    manifest = json.loads(store.blob_path(manifest_digest).read_bytes())
    assert_valid(IMAGE_SPEC, "image-manifest-schema.json", manifest)
    config = json.loads(store.blob_path(manifest["config"]["digest"]).read_bytes())
    assert_valid(IMAGE_SPEC, "config-schema.json", config)
    roles = [lay["annotations"]["org.envbuild.role"] for lay in manifest["layers"]]
    assert roles == ["base", "workspace", "toolkit"]
    assert "PATH=/opt/toolkits/shtest/bin:/usr/sbin:/usr/bin:/sbin:/bin" in config["config"]["Env"]

    skopeo = require_tool("skopeo")
    out = subprocess.run([skopeo, "inspect", f"oci:{envbuild_cli.store}:env/busybox-shell"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["Digest"] == manifest_digest

    # Debian's umoci 0.4.7 predates zstd layers ("blob is not correct mediatype"), so umoci
    # reads the image after skopeo — which decodes our layers with stock zstd — re-encodes
    # them as gzip: both tools must accept our blobs as ordinary layers for this to pass.
    gz = tmp_path / "gz"
    subprocess.run([skopeo, "copy", "--dest-compress", "--dest-compress-format", "gzip",
                    f"oci:{envbuild_cli.store}:env/busybox-shell", f"oci:{gz}:busybox-shell"],
                   check=True, capture_output=True)
    umoci = require_tool("umoci")
    bundle = tmp_path / "bundle"
    subprocess.run([umoci, "unpack", "--image", f"{gz}:busybox-shell", str(bundle)],
                   check=True, capture_output=True)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = ["/bin/sh", "-c", "shtest /workspace/tests | tail -1"]
    (bundle / "config.json").write_text(json.dumps(cfg))
    runc = require_tool("runc")
    run = subprocess.run([runc, "--root", str(tmp_path / "runc"), "run", "--bundle", str(bundle),
                          "eb-test-umoci"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "0 failed" in run.stdout


def test_check_runs_workspace_checks_in_a_sandbox(envbuild_cli):
    assert envbuild_cli("build").code == 0
    result = envbuild_cli("check", "busybox-shell")
    assert result.code == 0, result.out + result.err
    assert "ok   busybox-shell" in result.out
    assert "1 passed, 0 failed" in result.out


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_failed_step_publishes_nothing_and_unrelated_layers_finish(envbuild_cli):
    defs = envbuild_cli.defs
    _write(defs / "toolkits" / "broken.yaml", """\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: broken
        build_on: busybox-tiny
        prefix: /opt/toolkits/broken
        steps:
          - run: echo about to fail; echo details >&2; exit 3
            network: none
        """)
    result = envbuild_cli("build", "--json")
    assert result.code == 1
    layers = {lay["name"]: lay for lay in result.json()["layers"]}
    assert layers["broken"]["status"] == "failed"
    assert "exited 3" in layers["broken"]["error"]
    assert layers["kvsh"]["status"] == "built" and layers["shtest"]["status"] == "built"
    assert "about to fail" in result.err and "details" in result.err  # the output tail
    assert "full log:" in result.err
    store = LocalStore(envbuild_cli.store)
    assert get_key_record(store, layers["broken"]["key"]) is None
    assert "Traceback" not in result.err


def test_toolkit_outside_its_prefix_is_refused_with_the_paths(envbuild_cli):
    _write(envbuild_cli.defs / "toolkits" / "leaky.yaml", """\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: leaky
        build_on: busybox-tiny
        prefix: /opt/toolkits/leaky
        steps:
          - run: mkdir -p /opt/toolkits/leaky /root/.cache && touch /root/.cache/x /etc/leak
            network: none
        """)
    result = envbuild_cli("build", "leaky", "--json")
    assert result.code == 1
    error = {lay["name"]: lay for lay in result.json()["layers"]}["leaky"]["error"]
    assert "outside its prefix /opt/toolkits/leaky" in error
    assert "/etc/leak" in error and "/root/.cache" in error


def test_two_processes_build_each_key_once(envbuild_cli, tmp_path):
    env = {"ENVBUILD_NODE_CACHE": str(envbuild_cli.node), "ENVBUILD_STORE": str(envbuild_cli.store),
           "ENVBUILD_DEFS": str(envbuild_cli.defs), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    argv = [sys.executable, "-m", "envbuild.cli", "build", "--json"]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    built = {}
    for out, _ in outs:
        for lay in json.loads(out)["layers"]:
            built[lay["name"]] = built.get(lay["name"], 0) + (lay["status"] == "built")
    assert built == {"busybox-tiny": 1, "kvsh": 1, "shtest": 1}


def test_verbose_build_streams_each_steps_output(envbuild_cli):
    """``build -v`` shows a run step's output on the console (issue 12, item 9), stdout and
    stderr, line by line prefixed with its layer; without -v only the log has it."""
    _write(envbuild_cli.defs / "toolkits" / "chatty.yaml", """\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: chatty
        build_on: busybox-tiny
        prefix: /opt/toolkits/chatty
        steps:
          - run: echo first line; echo to stderr >&2; mkdir -p /opt/toolkits/chatty; printf tail
            network: none
        """)
    quiet = envbuild_cli("build", "chatty")
    assert quiet.code == 0 and "chatty | first line" not in quiet.err.splitlines()
    result = envbuild_cli("build", "chatty", "-v", "--no-cache")
    assert result.code == 0, result.err
    lines = result.err.splitlines()
    assert "chatty | first line" in lines and "chatty | to stderr" in lines
    assert "chatty | tail" in lines  # a last line without a newline still comes out


def test_build_builds_a_tasks_env_hidden_layer_and_task_lock(envbuild_cli):
    """Issue 35: a Task in the tree is built with its env: the env is locked, then the task
    (its hidden layer built as a layer, its task lock under task/NAME); a build of the task
    alone builds and locks the same (tests/integration/test_task_lock.py has the rest)."""
    _write(envbuild_cli.defs / "tasks" / "kv-task.yaml", """\
        apiVersion: envbuild/v1
        kind: Task
        name: kv-task
        env: busybox-shell
        workdir: /workspace
        hidden: {path: hidden}
        grade: {run: sh /workspace/hidden-test.sh, timeout: 30}
        """)
    (envbuild_cli.defs / "tasks" / "hidden").mkdir()
    (envbuild_cli.defs / "tasks" / "hidden" / "hidden-test.sh").write_text("exit 0\n")
    result = envbuild_cli("build")
    assert result.code == 0, result.err
    assert "env busybox-shell: locked sha256:" in result.out
    assert "task kv-task: locked sha256:" in result.out and "as task/kv-task" in result.out
    assert "kv-task:hidden" in result.out  # the hidden layer in the layer table
    report = envbuild_cli("build", "--json", "kv-task")
    assert report.code == 0, report.err
    assert [lk["env"] for lk in report.json()["locks"]] == ["busybox-shell"]
    [task] = report.json()["tasks"]
    assert (task["task"], task["ref"], task["error"]) == ("kv-task", "task/kv-task", None)
    assert f"task kv-task: locked {task['digest']} as task/kv-task" in result.out
