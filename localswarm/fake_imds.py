"""A stand-in for EC2's instance metadata service (IMDSv2), for the rehearsal's spot notices.

    python -m localswarm.fake_imds --root DIR --port-file FILE     (a free port, written to FILE)

One server for every node: a node's watcher uses http://127.0.0.1:PORT/<node> as its IMDS,
so it asks /<node>/latest/api/token and then, with that token, for the spot paths. A
notice is a file: DIR/<node>/imds/spot-instance-action.json (or rebalance.json, or
maintenance-scheduled.json), written by `localswarm node spot-notice` (and health.maintenance_notice).
No file: 404, as EC2 answers when nothing is announced.
Like IMDSv2, a GET without a token gets 401.

The program's rehearsal (localswarm/pulumi_cli.py) asks for what EC2 gives each instance instead: one
server on the bridge, which the bridge's packets to 169.254.169.254:80 reach (network.create_bridge),
answering each machine by its address from the record LocalCloud writes when it launches it
(register): its instance id, user data and metadata options, kept as EC2 keeps them
(fake_account.launch). With httpTokens optional a GET without a token is answered (IMDSv1); with
required it gets 401. A token's PUT is answered with packets whose IP TTL is the hop limit, so a
container behind the machine's bridge (one hop more) never gets one at hop limit 1 (EC2 User Guide,
"Instance metadata options": the hop limit is the PUT response's number of network hops).
It answers the same notice paths too, from files beside the records (instance_notice_file, which
`localswarm node spot-notice` and `maintenance-notice` write for a machine): the node's own watcher,
as its user data installed it, reads them there.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from localswarm import lane
from localswarm.network import IMDS_PORT

PATHS = {"/latest/meta-data/spot/instance-action": "spot-instance-action.json",
         "/latest/meta-data/events/recommendations/rebalance": "rebalance.json",
         "/latest/meta-data/events/maintenance/scheduled": "maintenance-scheduled.json"}


class _Answering(BaseHTTPRequestHandler):
    def _answer(self, status: int, body: str = "") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_):  # quiet: the watcher logs what matters
        pass


def notice_file(root: Path, node: str, kind: str = "spot-instance-action") -> Path:
    return root / node / "imds" / f"{kind}.json"


def spot_action(action: str = "terminate") -> dict:
    """What EC2's IMDS says two minutes before it reclaims a spot instance (EC2 User Guide, "Spot Instance
    interruption notices": {"action": "terminate" | "stop" | "hibernate", "time": ...})."""
    when = (datetime.now(timezone.utc) + timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"action": action, "time": when}


def scheduled_event(instance: str, code: str = "system-reboot", starts_in_s: int = 60) -> dict:
    """One entry of events/maintenance/scheduled, as EC2 lists an event it scheduled for an instance (EC2
    User Guide, "View scheduled events": Code, Description, EventId, NotBefore, NotAfter, State)."""
    fmt = "%d %b %Y %H:%M:%S GMT"
    start = datetime.now(timezone.utc) + timedelta(seconds=starts_in_s)
    return {"Code": code, "Description": f"scheduled {code}", "EventId": f"instance-event-{instance}",
            "NotBefore": start.strftime(fmt), "NotAfter": (start + timedelta(hours=2)).strftime(fmt),
            "State": "active"}


def make_handler(root: Path, token: str):
    class Handler(_Answering):
        def _split(self) -> tuple[str, str]:
            node, _, rest = self.path.lstrip("/").partition("/")
            return node, "/" + rest

        def do_PUT(self):  # noqa: N802 (http.server's names)
            _, path = self._split()
            ok = path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            self._answer(200, token) if ok else self._answer(400)

        def do_GET(self):  # noqa: N802
            node, path = self._split()
            if self.headers.get("X-aws-ec2-metadata-token") != token:
                return self._answer(401)
            if path not in PATHS or "/" in node or node in ("", ".", ".."):
                return self._answer(404)
            file = root / node / "imds" / PATHS[path]
            self._answer(200, file.read_text()) if file.exists() else self._answer(404)

    return Handler


# Beside the machines (machines.STATE): the records of the program's rehearsal, one per machine address.
RECORDS = lane.MACHINES_STATE / "imds"
INSTANCE_PATHS = {"/latest/meta-data/instance-id": "instance-id", "/latest/meta-data/ami-id": "ami-id",
                  "/latest/user-data": "user-data", "/latest/meta-data/local-ipv4": "local-ipv4",
                  # spot, on-demand, scheduled or capacity-block (EC2 User Guide, "Instance metadata categories")
                  "/latest/meta-data/instance-life-cycle": "instance-life-cycle"}
# An instance with an instance profile: its role's name, and its temporary credentials as JSON (EC2 User Guide,
# "Retrieve security credentials from instance metadata"). The record's "iam": {"role", "AccessKeyId",
# "SecretAccessKey", "Token", "Expiration"}; localswarm/fake_aws_api.py accepts requests signed with them.
CREDENTIALS_PATH = "/latest/meta-data/iam/security-credentials/"


def instance_record(records: Path, address: str) -> dict:
    """The record of the instance at `address`, {} when none."""
    try:
        return json.loads((records / f"{address}.json").read_text())
    except (OSError, ValueError):
        return {}


def register(records: Path, address: str, record: dict) -> None:
    """What the instance at `address` is to IMDS: {"instance-id", "ami-id", "user-data", "metadataOptions"},
    and "local-ipv4", "instance-life-cycle" and "iam" (see CREDENTIALS_PATH) where it has them."""
    records.mkdir(parents=True, exist_ok=True)
    try:
        before = json.loads((records / f"{address}.json").read_text()).get("instance-id")
    except (OSError, ValueError):
        before = None
    if before != record.get("instance-id"):
        # EC2 sends a notice to one instance. Another one at the address (a machine of the lane's last
        # module, which `down` took away without an unregister) never inherits it: CI saw fresh nodes
        # drained as reclaimed by a maintenance notice left from the pool's drill.
        clear_instance_notices(records, address)
    tmp = records / f".{address}.tmp"
    tmp.write_text(json.dumps(record))
    os.chmod(tmp, 0o600)  # the user data holds the node's host key
    tmp.replace(records / f"{address}.json")


def unregister(records: Path, address: str) -> None:
    (records / f"{address}.json").unlink(missing_ok=True)
    clear_instance_notices(records, address)  # a new instance at this address has no notice of the old one


def instance_notice_file(records: Path, address: str, kind: str = "spot-instance-action") -> Path:
    """Where the notice of `kind` (a file name of PATHS, without .json) for the instance at `address` is."""
    return records / "notices" / address / f"{kind}.json"


def clear_instance_notices(records: Path, address: str) -> int:
    """Every notice for the instance at `address` withdrawn; how many there were."""
    files = [instance_notice_file(records, address, name.removesuffix(".json")) for name in PATHS.values()]
    there = [f for f in files if f.exists()]
    for f in there:
        f.unlink(missing_ok=True)
    return len(there)


def make_instance_handler(records: Path):
    """IMDS as each instance sees it, found by the address a request comes from."""
    tokens: dict[str, str] = {}  # address -> its token

    class Handler(_Answering):
        def _record(self) -> dict | None:
            try:
                return json.loads((records / f"{self.client_address[0]}.json").read_text())
            except (OSError, ValueError):
                return None

        def do_PUT(self):  # noqa: N802
            record = self._record()
            options = (record or {}).get("metadataOptions") or {}
            if record is None or options.get("httpEndpoint") == "disabled":
                return self._answer(404)
            if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self._answer(400)
            hops = int(options.get("httpPutResponseHopLimit") or 1)
            self.connection.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, hops)
            token = tokens.setdefault(self.client_address[0], secrets.token_hex(16))
            self._answer(200, token)

        def do_GET(self):  # noqa: N802
            record = self._record()
            options = (record or {}).get("metadataOptions") or {}
            if record is None or options.get("httpEndpoint") == "disabled":
                return self._answer(404)
            token = self.headers.get("X-aws-ec2-metadata-token")
            if token is not None and token != tokens.get(self.client_address[0]):
                return self._answer(401)
            if token is None and options.get("httpTokens", "optional") == "required":
                return self._answer(401)
            iam = record.get("iam")
            if self.path.startswith(CREDENTIALS_PATH):
                role = self.path[len(CREDENTIALS_PATH):]
                if not iam or role not in ("", iam["role"]):
                    return self._answer(404)
                return self._answer(200, iam["role"] if not role else json.dumps({
                    "Code": "Success", "Type": "AWS-HMAC", **{k: iam[k] for k in
                                                             ("AccessKeyId", "SecretAccessKey", "Token", "Expiration")}}))
            if self.path in PATHS:  # nothing announced: 404, as EC2 answers
                file = instance_notice_file(records, self.client_address[0], PATHS[self.path].removesuffix(".json"))
                return self._answer(200, file.read_text()) if file.exists() else self._answer(404)
            key = INSTANCE_PATHS.get(self.path)
            if key is None or key not in record:
                return self._answer(404)
            self._answer(200, str(record[key]))

    return Handler


def serve_in_background(address: str, records: Path = RECORDS) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((address, IMDS_PORT), make_instance_handler(records))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="imds", daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--port-file", type=Path, required=True, help="where the port it listens on is written")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(args.root, secrets.token_hex(16)))
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(f"{server.server_address[1]}\n")
    tmp.replace(args.port_file)  # whole or not at all: the reader polls for it
    server.serve_forever()


if __name__ == "__main__":
    main()
