"""A stand-in for EC2's instance metadata service (IMDSv2), for the rehearsal's spot notices.

    python -m localswarm.fake_imds --root DIR --port-file FILE     (a free port, written to FILE)

One server for every node: a node's watcher uses http://127.0.0.1:PORT/<node> as its IMDS,
so it asks /<node>/latest/api/token and then, with that token, for the spot paths. A
notice is a file: DIR/<node>/imds/spot-instance-action.json (or rebalance.json, or
maintenance-scheduled.json), written by `localswarm node spot-notice` (and health.maintenance_notice).
No file: 404, as EC2 answers when nothing is announced.
Like IMDSv2, a GET without a token gets 401.
"""
from __future__ import annotations

import argparse
import secrets
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PATHS = {"/latest/meta-data/spot/instance-action": "spot-instance-action.json",
         "/latest/meta-data/events/recommendations/rebalance": "rebalance.json",
         "/latest/meta-data/events/maintenance/scheduled": "maintenance-scheduled.json"}


def notice_file(root: Path, node: str, kind: str = "spot-instance-action") -> Path:
    return root / node / "imds" / f"{kind}.json"


def make_handler(root: Path, token: str):
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

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

        def log_message(self, *_):  # quiet: the watcher logs what matters
            pass

    return Handler


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
