"""What AWS does between two `pulumi up`s of the rehearsal that no input of the program says.

AWS publishes a new "latest" image under a public SSM parameter; a Capacity Block is extended, nears
its end, or ends. A test records such a move here (a file beside the rehearsal's Pulumi state), and the
rehearsal's aws plugin applies every move recorded so far to the fake AWS when the CLI starts it (once
per CLI run: localswarm/provider_plugin.py). The program then finds the moved AWS as a second `up`
finds the real one: through its lookups, with nothing of the program or its stack changed.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

FILE = "aws-moves.json"


def _file() -> Path:
    from localswarm import pulumi_cli
    return pulumi_cli.root() / FILE


def _moves() -> dict:
    try:
        return json.loads(_file().read_text())
    except (OSError, ValueError):
        return {}


def _record(kind: str, key: str, value) -> None:
    moves = _moves()
    moves.setdefault(kind, {})[key] = value
    path = _file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(moves, indent=1))


def publish_image(parameter: str, ami: str, architecture: str = "x86_64", root_gib: int = 75) -> None:
    """AWS releases a new image and points its public "latest" parameter at it (as the Deep Learning AMI's
    and Ubuntu's parameters move with each release); DescribeImages describes it from then on."""
    _record("images", ami, [architecture, root_gib])
    _record("latest", parameter, ami)


def move_block(reservation_id: str, **fields: str) -> None:
    """The Capacity Block as DescribeCapacityReservations shows it from now: a later endDate (extended), or
    state expired once its end has passed."""
    moves = _moves().get("reservations", {})
    _record("reservations", reservation_id, {**moves.get(reservation_id, {}), **fields})


def recorded(reservation_id: str) -> dict:
    """What the moves so far made of a reservation (the fields moved)."""
    return _moves().get("reservations", {}).get(reservation_id, {})


def rfc3339(seconds_from_now: float) -> str:
    """A time as EC2 writes a reservation's dates: whole seconds, UTC, Z."""
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds_from_now)).strftime("%Y-%m-%dT%H:%M:%SZ")


def apply() -> None:
    """Every move recorded so far, made to this process's fake AWS (the aws plugin's, at its start)."""
    from localswarm import fake_aws
    moves = _moves()
    for ami, (architecture, root_gib) in moves.get("images", {}).items():
        fake_aws.AMIS[ami] = (architecture, root_gib)
    fake_aws.LATEST.update(moves.get("latest", {}))
    for reservation_id, fields in moves.get("reservations", {}).items():
        fake_aws.RESERVATIONS[reservation_id].update(fields)
