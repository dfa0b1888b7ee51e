"""A stand-in for dockerd's Engine API on a unix socket: the two calls the metrics exporter makes.

GET /containers/json (the task containers) and GET /containers/<id>/json (their .Config.Env),
answered from a dict the caller can change while it runs. For the exporter's unit tests and
bench/metrics_budget.py, where no engine runs; the rehearsal's integration test uses real ones.
"""
from __future__ import annotations

import json
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlparse


def send_json(handler: BaseHTTPRequestHandler, body) -> None:
    """Answer a request with `body` as the Engine API does: JSON, with its length."""
    data = json.dumps(body).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def task_container(cid: str, service: str, slot: int, env: list[str]) -> dict:
    """A container as dockerd describes a swarm task's: Docker's labels, swarm's variables in its Env."""
    return {"Id": cid, "Labels": {"com.docker.swarm.service.name": service,
                                  "com.docker.swarm.task.name": f"{service}.{slot}.{cid[:25]}",
                                  "com.docker.swarm.task.id": cid[:25]},
            "Config": {"Env": ["PATH=/usr/bin:/bin", *env]}}


class DockerApiStub:
    def __init__(self, sock: Path):
        self.sock, self.containers, self.calls = str(sock), {}, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                path = urlparse(self.path).path
                stub.calls.append(path)
                if path == "/containers/json":
                    body = [{"Id": c["Id"], "Labels": c["Labels"]} for c in stub.containers.values()]
                elif path.startswith("/containers/") and path.endswith("/json") and \
                        path.split("/")[2] in stub.containers:
                    body = stub.containers[path.split("/")[2]]
                else:
                    self.send_error(404)
                    return
                send_json(self, body)

            def log_message(self, *args):
                pass

            def address_string(self):  # a unix socket has no client address
                return "stub"

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        Path(self.sock).unlink(missing_ok=True)
        self.server = Server(self.sock, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, container: dict) -> None:
        self.containers[container["Id"]] = container

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        Path(self.sock).unlink(missing_ok=True)
