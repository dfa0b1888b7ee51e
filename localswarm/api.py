"""Reads from the Docker Engine API over a node's socket, for what the rehearsal asks often.

Each `docker` CLI call is a process of its own, about 20 ms of CPU. The rehearsal polls
while engines start and stacks converge, and on a 2-core machine those processes took
the CPU from the engines they waited for; one request here costs a millisecond or two.
The answers are the documents `docker inspect` prints.
"""
from __future__ import annotations

import http.client
import json
import socket
import urllib.parse


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def request(sock: str, path: str, *, timeout: float = 10, **query) -> bytes:
    """GET `path` (filters given as dicts); raises OSError when nothing answers, ApiError on an error status."""
    if query:
        path += "?" + urllib.parse.urlencode({k: json.dumps(v) if isinstance(v, dict) else v
                                              for k, v in query.items()})
    conn = _UnixConnection(sock, timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status >= 400:
        raise ApiError(resp.status, body.decode(errors="replace").strip())
    return body


def get(sock: str, path: str, *, timeout: float = 10, **query):
    return json.loads(request(sock, path, timeout=timeout, **query) or b"null")


def ping(sock: str) -> bool:
    try:
        return request(sock, "/_ping", timeout=2) == b"OK"
    except (OSError, ApiError, http.client.HTTPException):
        return False
