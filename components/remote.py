"""How the swarm components reach the nodes: SSH connections, and builder scripts run as root."""
from __future__ import annotations

import shlex

import pulumi
import pulumi_command as command

# A fresh instance is "running" a minute or more before sshd answers; GPU nodes take
# longer. pulumi-command backs off between dials (up to a few seconds), so this many
# attempts covers a slow boot without waiting forever on a node that never comes up.
DIAL_ERROR_LIMIT = 120
PER_DIAL_TIMEOUT_S = 10


def as_root(script: str) -> str:
    """Run a swarm/commands.py script as root.

    The SSH user joins no docker group: the first session opens while cloud-init may still
    be installing Docker, and a session keeps the groups it started with. sudo works from
    the first second, and runs the scripts under bash, as the local rehearsal does.
    """
    return f"sudo -n bash -c {shlex.quote(script)}"


def connection(
    *,
    host: pulumi.Input[str],
    user: pulumi.Input[str],
    private_key: pulumi.Input[str],
    jump_host: pulumi.Input[str] | None = None,
) -> command.remote.ConnectionArgs:
    """SSH straight to `host`, or through `jump_host` (a manager) to a node with no public SSH."""
    proxy = None
    if jump_host is not None:
        proxy = command.remote.ProxyConnectionArgs(
            host=jump_host,
            user=user,
            private_key=private_key,
            dial_error_limit=DIAL_ERROR_LIMIT,
            per_dial_timeout=PER_DIAL_TIMEOUT_S,
        )
    return command.remote.ConnectionArgs(
        host=host,
        user=user,
        private_key=private_key,
        proxy=proxy,
        dial_error_limit=DIAL_ERROR_LIMIT,
        per_dial_timeout=PER_DIAL_TIMEOUT_S,
    )
