"""Stacks: deploy a compose file read from stdin, and remove a stack completely.

The compose file travels on stdin, so a deploy never depends on a file that a reboot, a
new manager or a changed connection left behind. Each stack the program deploys is marked
with a swarm config object, which lives in the swarm's Raft store and so survives the loss
of any manager: reconcile() removes marked stacks the program no longer wants, and never
touches a stack someone deployed by hand.
"""
from __future__ import annotations

from swarm.labels import STACK_LABEL
from swarm.script import quote, script, sha256_hex, swarm_name, wait_until

STACK_MARKER_PREFIX = f"{STACK_LABEL}."  # the marker of stack s is the config STACK_LABEL.s, labelled STACK_LABEL=s


def marker(name: str) -> str:
    return STACK_MARKER_PREFIX + swarm_name(name, "stack name")


def deploy_stack(name: str, content_sha256: str) -> str:
    """Deploy (or update) a stack from the compose file on stdin; content_sha256 names that content."""
    stack = quote(swarm_name(name, "stack name"))
    sha = sha256_hex(content_sha256, "the compose file")
    return script(
        f'echo "deploying stack {name} (compose file sha256 {sha[:16]})"',
        # --detach=true: the CLI says its default will flip to waiting for convergence, and a
        # task that waits for a free GPU would hold `pulumi up` for ever.
        f"docker stack deploy --detach=true --with-registry-auth --prune -c - {stack}",
        f"docker config inspect {quote(marker(name))} >/dev/null 2>&1 ||",
        f"  printf '%s' {stack} | docker config create --label {STACK_LABEL}={stack} {quote(marker(name))} - "
        ">/dev/null",
    )


def remove_stack(name: str, *, timeout_s: int = 120) -> str:
    """Remove a stack and wait until it is gone; removing one that is not there succeeds.

    `docker stack rm` returns before its services and networks are gone, and a deploy
    of the same name meanwhile fails on the leftover network.
    """
    return script(*remove_stack_lines(name, timeout_s))


def remove_stack_lines(name: str, timeout_s: int) -> list[str]:
    stack = quote(swarm_name(name, "stack name"))
    label = quote(f"label=com.docker.stack.namespace={name}")
    return [
        f"if docker stack ls --format '{{{{.Name}}}}' | grep -qx {stack}; then",
        f"  docker stack rm {stack} >/dev/null; echo 'stack {name} removed'",
        "else",
        f"  echo 'stack {name} not deployed'",
        "fi",
        *wait_until(f'[ -z "$(docker service ls -q --filter {label})$(docker network ls -q --filter {label})" ]',
                    timeout_s, f"stack {name} still has services or networks", interval_s=1),
        f"docker config rm {quote(marker(name))} >/dev/null 2>&1 || true",
    ]
