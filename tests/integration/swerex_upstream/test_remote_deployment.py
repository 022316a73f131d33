# Ported from SWE-ReX v1.4.0 (github.com/SWE-agent/SWE-ReX, tag v1.4.0, commit f802b3e,
# tests/test_remote_deployment.py), MIT License, Copyright (c) 2024 Kilian Lieret, Carlos E. Jimenez.
# ruff: noqa: E501, I001 - upstream's line length and import order, kept verbatim
# Verbatim except where a "# envbuild:" comment says what changed and why. It runs against
# envbuild.harness.swerex.EnvbuildDeployment: the fixtures of ./conftest.py start swerex-remote
# in a real sandbox and give SWE-ReX's RemoteRuntime through the deployment's loopback forward.
import pytest

from swerex.deployment.remote import RemoteDeployment
from swerex.exceptions import DeploymentNotStartedError


async def test_remote_deployment(remote_server):
    port = remote_server.port
    print(f"Using port {port} for the remote deployment")
    # envbuild: the token is the deployment's own (random per deployment), not a constant
    d = RemoteDeployment(port=port, auth_token=remote_server.auth_token)
    with pytest.raises(DeploymentNotStartedError):
        await d.is_alive()
    await d.start()
    assert await d.is_alive()
    await d.stop()
