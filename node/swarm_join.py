#!/usr/bin/env python3
"""An elastic pool's node joins the swarm by itself: the last step of its first boot (join-swarm.sh).

No `pulumi up` runs when an Auto Scaling group launches a node, so the node fetches what a fixed node
is handed over SSH: the swarm's worker token and the managers' addresses, from the pool's SSM
parameter (a SecureString, JOIN_PARAMETER_ENV). Its instance role may read that parameter and no
other; only root reaches IMDS, where the role's credentials are (imds-root-only.sh ran first). It
then writes two engine labels (its instance id and its pool), which the leader's scaler matches
against the pool's group before it admits the node, and joins drained, as every node joins: no task
lands on it before the admit's GPU check (node/swarm_scaler.py runs the same admit a fixed node gets).
The token travels from SSM to dockerd's API in this process's memory, never on a command line.
A node already in the swarm (a reboot) stays. Exit 0 joined or already in; 1 failed; 2 bad input.
Stdlib, its sibling contract.py, aws_api.py and daemon_json.py.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import aws_api  # noqa: E402
from contract import (DOCKER_DAEMON_JSON, DOCKER_SOCKET, DOCKERD_PIDFILE, ELASTIC_POOL_LABEL,  # noqa: E402
                      INSTANCE_ID_LABEL, JOIN_DOCUMENT_KEYS)
from daemon_json import locked, read_daemon_json, set_labels, write_atomic  # noqa: E402

SWARM_PORT = 2377


class JoinError(Exception):
    pass


class Engine:
    """dockerd's API on its unix socket: the three calls a join needs."""

    def __init__(self, sock: str, timeout: float = 60):
        self.sock, self.timeout = sock, timeout

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
        class Conn(http.client.HTTPConnection):
            def connect(conn):  # noqa: N805 (the connection is the instance)
                conn.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.sock.settimeout(self.timeout)
                conn.sock.connect(self.sock)
        conn = Conn("localhost", timeout=self.timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"} if body is not None else {})
            answer = conn.getresponse()
            text = answer.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as e:
            raise JoinError(f"Cannot connect to the Docker daemon at unix://{self.sock} ({e})") from None
        finally:
            conn.close()
        try:
            return answer.status, json.loads(text) if text.strip() else {}
        except ValueError:
            return answer.status, text

    def info(self) -> dict:
        status, doc = self.call("GET", "/info")
        if status != 200 or not isinstance(doc, dict):
            raise JoinError(f"dockerd's /info answered {status}")
        return doc


def join_document(text: str) -> dict:
    """The parameter's value: {"token", "managers", "cluster"} (components/elastic_pool.py writes it)."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise JoinError("the join parameter does not hold JSON") from None
    if not isinstance(doc, dict) or set(doc) != set(JOIN_DOCUMENT_KEYS) or not doc["managers"] or \
            not str(doc["token"]).startswith("SWMTKN-"):
        raise JoinError(f"the join parameter holds no {{{', '.join(JOIN_DOCUMENT_KEYS)}}} with a swarm token")
    return doc


def write_labels(daemon_json: str, pidfile: str, labels: dict[str, str]) -> bool:
    """Our engine labels in daemon.json (every other key and label kept); dockerd reloads them on SIGHUP.
    True when they changed."""
    with locked(daemon_json):
        config = read_daemon_json(daemon_json) or {}
        old = list(config.get("labels", []))
        new = old
        for key, value in labels.items():
            new = set_labels(new, key, {key: value})
        if new == old:
            return False
        config["labels"] = new
        write_atomic(daemon_json, (json.dumps(config, indent=2) + "\n").encode())
    try:
        with open(pidfile, encoding="utf-8") as f:
            os.kill(int(f.read().strip()), signal.SIGHUP)
    except (OSError, ValueError) as e:
        raise JoinError(f"could not tell dockerd to read its labels again ({pidfile}: {e})") from None
    return True


def wait_for_labels(engine: Engine, labels: dict[str, str], timeout: float) -> None:
    want = {f"{k}={v}" for k, v in labels.items()}
    deadline = time.monotonic() + timeout
    while not want <= set(engine.info().get("Labels") or []):
        if time.monotonic() > deadline:
            raise JoinError(f"dockerd did not take the labels {sorted(want)} within {timeout:g} s")
        time.sleep(0.2)


def join(engine: Engine, doc: dict, advertise: str) -> str:
    """POST /swarm/join to each manager in turn, drained; the node ID. A node in the swarm already stays."""
    info = engine.info()
    swarm = info.get("Swarm") or {}
    if swarm.get("LocalNodeState") == "active":
        return swarm.get("NodeID", "")
    errors = []
    for manager in doc["managers"]:
        status, answer = engine.call("POST", "/swarm/join", {
            "ListenAddr": f"0.0.0.0:{SWARM_PORT}", "AdvertiseAddr": advertise,
            "RemoteAddrs": [f"{manager}:{SWARM_PORT}"], "JoinToken": doc["token"], "Availability": "drain"})
        if status == 200:
            return (engine.info().get("Swarm") or {}).get("NodeID", "")
        errors.append(f"{manager}: {answer.get('message') if isinstance(answer, dict) else answer}")
    raise JoinError("no manager took the join (" + "; ".join(str(e).strip() for e in errors) + ")")


def run(args, imds: aws_api.Imds, client_for=aws_api.Client, sleep=time.sleep) -> str:
    """Fetch the join, label the engine, join; tried again (the managers may be restarting) until args.timeout."""
    deadline = time.monotonic() + args.timeout
    instance = imds.get("/latest/meta-data/instance-id").strip()
    advertise = args.advertise_address or imds.get("/latest/meta-data/local-ipv4").strip()
    engine = Engine(args.docker_socket)
    labels = {INSTANCE_ID_LABEL: instance, ELASTIC_POOL_LABEL: args.pool}
    if write_labels(args.daemon_json, args.dockerd_pidfile, labels):
        wait_for_labels(engine, labels, 60)
    client = client_for(args.region, imds.credentials)
    while True:
        try:
            doc = join_document(client.get_parameter(args.parameter))
            return join(engine, doc, advertise)
        except (aws_api.AwsError, JoinError) as e:
            if isinstance(e, aws_api.AwsError) and e.code in ("AccessDeniedException", "AccessDenied"):
                raise JoinError(f"the instance role may not read {args.parameter}: {e.message}") from None
            if time.monotonic() > deadline:
                raise
            print(f"not joined yet ({e}); trying again in 5 s", file=sys.stderr, flush=True)
            sleep(5)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Join the swarm from the pool's SSM join parameter, drained, as an "
                                            "elastic pool's node does at its first boot. Exit 0 joined, 1 failed.")
    p.add_argument("--parameter", required=True, help="the SSM parameter (SecureString) with the join")
    p.add_argument("--region", required=True)
    p.add_argument("--pool", required=True, help="the elastic pool, written as an engine label")
    p.add_argument("--advertise-address", default="", help="default: IMDS local-ipv4")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to keep trying (default 1800)")
    p.add_argument("--docker-socket", default=DOCKER_SOCKET)
    p.add_argument("--daemon-json", default=DOCKER_DAEMON_JSON)
    p.add_argument("--dockerd-pidfile", default=DOCKERD_PIDFILE)
    p.add_argument("--imds", default=aws_api.IMDS, metavar="HOST[:PORT]")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    host, _, port = args.imds.partition(":")
    try:
        node_id = run(args, aws_api.Imds(host, int(port or 80)))
    except (JoinError, aws_api.AwsError) as e:
        print(f"gpu-swarm join: {e}", file=sys.stderr)
        return 1
    print(node_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
