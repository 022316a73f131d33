"""``ShellSession`` / ``AsyncShellSession`` (issue 37 item 2: the persistent shell SWE-ReX's
``run_in_session`` needs) in real runc sandboxes of the busybox env (its ``sh``): state
persists between commands, output and exit code per command, a timeout interrupts the command
and the session carries on, ``exit`` ends it."""

from __future__ import annotations

import asyncio
import time

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim import AsyncSandbox, AsyncShellSession, Sandbox, ShellSession
from tests.integration.conftest import build_busybox_env

ENV = "busybox-shell"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("sdksession"))


@pytest.fixture(scope="module")
def sb(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sandbox:
        yield sandbox


def test_state_persists_and_each_command_has_its_output_and_exit_code(sb):
    with ShellSession(sb, env={"FROM_OPEN": "o"}, cwd="/tmp") as sh:
        r = sh.run("pwd; echo $FROM_OPEN")
        assert (r.stdout, r.exit_code, r.stderr, r.timed_out) == (b"/tmp\no\n", 0, b"", False)
        assert sh.run("mkdir -p /w/a && cd /w/a && export MODE=fast X='a b'").ok
        assert sh.run("greet() { echo \"hi $1\"; }; alias ll='ls -1'").ok
        r = sh.run("pwd; echo \"$MODE|$X\"; greet you; touch f; ll")
        assert r.stdout == b"/w/a\nfast|a b\nhi you\nf\n"
        r = sh.run("echo out; echo err >&2; printf no-newline; false")
        assert (r.stdout, r.exit_code) == (b"out\nerr\nno-newline", 1)
        assert sh.run("exit_code_of() { return $1; }; exit_code_of 7").exit_code == 7
        r = sh.run("for i in 1 2 3; do\n  echo \"line $i\"\ndone")  # several lines
        assert r.stdout == b"line 1\nline 2\nline 3\n"
        r = sh.run("echo 'single '\"'\"' quote' \"$(echo sub)\"")
        assert r.stdout == b"single ' quote sub\n"
        r = sh.run("if then")  # a syntax error is reported, the shell stays
        assert r.exit_code != 0 and b"syntax error" in r.stdout
        assert sh.run("echo still $MODE").stdout == b"still fast\n"


def test_a_timeout_interrupts_the_command_and_the_session_carries_on(sb):
    with ShellSession(sb) as sh:
        sh.run("cd /tmp; export KEPT=yes")
        started = time.monotonic()
        r = sh.run("echo begun; sleep 100; echo never", timeout=1)
        assert r.timed_out and r.exit_code == 124 and r.stdout.startswith(b"begun\n")
        assert b"never" not in r.stdout and 1 <= time.monotonic() - started < 8
        r = sh.run("i=0; while :; do i=$((i+1)); done", timeout=1)  # the shell's own loop
        assert r.timed_out
        r = sh.run("echo $KEPT; pwd; ps -o comm | grep -c '^sleep$' || true")
        assert (r.stdout, r.exit_code) == (b"yes\n/tmp\n0\n", 0)


def test_a_long_output_is_bounded_and_exit_ends_the_session(sb):
    sh = ShellSession(sb, max_output=1000)
    r = sh.run("yes | head -c 100000; echo; echo tail")
    assert r.output_truncated and r.stdout.startswith(b"y\ny\n") and r.ok
    assert 1000 <= len(r.stdout) <= 1000 + 4096 and r.stdout.endswith(b"tail\n")
    assert sh.run("echo fine").stdout == b"fine\n"  # the next command is whole again
    with pytest.raises(RuntimeShimError, match="shell exited"):
        sh.run("exit 3")
    with pytest.raises(RuntimeShimError, match="shell exited"):
        sh.run("echo after")
    sh.close()


def test_async_session(built):
    store, node = built

    async def main() -> None:
        sb = await AsyncSandbox.create(ENV, store=store, node_dir=node)
        try:
            async with await AsyncShellSession.open(sb) as sh:
                await sh.run("cd /etc; V=1")
                r = await sh.run("pwd; echo $V")
                assert (r.stdout, r.exit_code) == (b"/etc\n1\n", 0)
                r = await sh.run("sleep 100", timeout=0.5)
                assert r.timed_out and r.exit_code == 124
                assert (await sh.run("echo $V")).stdout == b"1\n"
                # two sessions of one sandbox are independent
                async with await AsyncShellSession.open(sb) as other:
                    assert (await other.run("echo ${V:-unset}")).stdout == b"unset\n"
        finally:
            await sb.close()

    asyncio.run(main())


def test_a_sandbox_with_bash_gets_a_bash_session(built):
    """The host's bash and its libraries copied into a fresh sandbox (``ldd``): the session
    runs ``bash --norc --noprofile --noediting -i`` there, with bash's own state."""
    import os
    import re
    import subprocess

    store, node = built
    libs = re.findall(r"(/\S+) \(0x", subprocess.run(["ldd", "/usr/bin/bash"], check=True,
                                                      capture_output=True, text=True).stdout)
    with Sandbox.create(ENV, store=store, node_dir=node) as sandbox:
        for path in [*libs, "/usr/bin/bash"]:
            real = os.path.realpath(path)
            sandbox.exec(["mkdir", "-p", os.path.dirname(path)])
            with open(real, "rb") as f:
                sandbox.write_file(path, f.read(), mode=0o755)
        sandbox.exec(["ln", "-sf", "/usr/bin/bash", "/bin/bash"])
        with ShellSession(sandbox) as sh:
            r = sh.run("echo $BASH_VERSION; declare -A m=([k]=v); shopt -s extglob")
            assert r.ok and re.match(rb"\d+\.\d+", r.stdout), r.stdout
            assert sh.run("echo ${m[k]} $((2**10))").stdout == b"v 1024\n"
            r = sh.run("sleep 100", timeout=0.5)
            assert r.timed_out and sh.run("echo ${m[k]}").stdout == b"v\n"
            assert sh.run("false").exit_code == 1


def test_a_session_outlives_the_exec_deadline(built):
    """An exec's default deadline (``Limits.exec_timeout``) is not the shell's: the session
    lives as long as its sandbox; and a deadline of weeks is waited on, not an overflow."""
    from runtime_shim import Limits

    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node, limits=Limits(exec_timeout=1)) as sb:
        with ShellSession(sb) as sh:
            sh.run("X=kept")
            time.sleep(3)  # past exec_timeout and the host's slack
            assert sh.run("echo $X").stdout == b"kept\n"
        assert sb.exec("echo long", timeout=40 * 86400).stdout == b"long\n"
