"""Adapters that let agent harnesses run their commands in envbuild sandboxes.

``envbuild.harness.minisweagent.EnvbuildEnvironment``: mini-swe-agent's environment class,
loaded by its dotted path from mini-swe-agent's config; ``envbuild.harness.swerex.
EnvbuildDeployment``: a SWE-ReX deployment (``swerex-remote`` in a sandbox, reached through a
loopback port forward, ``envbuild.harness.portforward``) (docs/harnesses.md). Harness packages
are optional (``envbuild[harness]``); these modules import them only where they must.
"""
