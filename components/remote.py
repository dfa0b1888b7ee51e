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
# A manager's sshd takes the program's fan-out (cloud-init/sshd.conf: MaxStartups 256, against the default 10),
# so these count dials to a node that does not answer, not handshakes refused by a busy jump host.
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
    host_key: pulumi.Input[str],
    jump_host: pulumi.Input[str] | None = None,
    jump_host_key: pulumi.Input[str] | None = None,
    budget: tuple[int, int] = LIVE,
) -> pulumi.Output[command.remote.ConnectionArgs]:
    """SSH straight to `host`, or through `jump_host` (a manager) to a node with no public SSH.

    Every connection pins the host key the node booted with (components/host_keys.py), the
    proxy's included: pulumi-command then refuses any other answer at that address.

    One Output that resolves to plain ConnectionArgs: a cluster passes the same connection to
    many commands, and nested Outputs would be walked again for each of them. It is secret,
    as the private key is.
    """
    limit, timeout = budget

    def build(values) -> command.remote.ConnectionArgs:
        host_, user_, key_, host_key_, jump_, jump_key_ = values
        proxy = None
        if jump_ is not None:
            proxy = command.remote.ProxyConnectionArgs(
                host=jump_, user=user_, private_key=key_, host_key=pinned(jump_key_), dial_error_limit=limit,
                per_dial_timeout=timeout)
        return command.remote.ConnectionArgs(
            host=host_, user=user_, private_key=key_, host_key=pinned(host_key_), proxy=proxy,
            dial_error_limit=limit, per_dial_timeout=timeout)

    return pulumi.Output.secret(
        pulumi.Output.all(host, user, private_key, host_key, jump_host, jump_host_key).apply(build))


def pinned(public_key: str | None) -> str:
    """The host key as pulumi-command takes it: one "TYPE BASE64" line (authorized_keys format), no comment."""
    words = (public_key or "").split()
    if len(words) < 2 or not words[0].startswith("ssh-"):
        raise ValueError(f"expected an OpenSSH public host key such as 'ssh-ed25519 AAAA...', found {public_key!r}")
    return f"{words[0]} {words[1]}"
