"""How the swarm components reach the nodes: SSH connections, and builder scripts run as root."""
from __future__ import annotations

import shlex

import pulumi
import pulumi_command as command

# Two dial budgets. A command that meets a node for the first time must outwait its boot:
# an instance is "running" a minute or more before sshd answers, so BOOT keeps dialling
# (pulumi-command backs off between dials, up to a few seconds) for about 20 minutes.
# Every other command talks to a node that answered before, and gives up after about two
# minutes, with pulumi-command's own error naming the host, rather than hang `pulumi up`.
BOOT = (120, 10)  # (dial_error_limit, per_dial_timeout seconds)
LIVE = (12, 10)


def as_root(script: str) -> str:
    """Run a builder script as root.

    The SSH user joins no docker group: the first session opens before Docker is
    installed, and a session keeps the groups it started with. sudo works from the first
    second, and runs the scripts under bash, as the local rehearsal does.
    """
    return f"sudo -n bash -c {shlex.quote(script)}"


def connection(
    *,
    host: pulumi.Input[str],
    user: pulumi.Input[str],
    private_key: pulumi.Input[str],
    jump_host: pulumi.Input[str] | None = None,
    budget: tuple[int, int] = LIVE,
) -> command.remote.ConnectionArgs:
    """SSH straight to `host`, or through `jump_host` (a manager) to a node with no public SSH."""
    limit, timeout = budget
    proxy = None
    if jump_host is not None:
        proxy = command.remote.ProxyConnectionArgs(
            host=jump_host, user=user, private_key=private_key, dial_error_limit=limit, per_dial_timeout=timeout,
        )
    return command.remote.ConnectionArgs(
        host=host, user=user, private_key=private_key, proxy=proxy, dial_error_limit=limit, per_dial_timeout=timeout,
    )
