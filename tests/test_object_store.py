"""The S3 stand-in (localswarm/object_store.py) on loopback: its CA and certificate made with the real
openssl, its handler behind real TLS, and who may read."""
from __future__ import annotations

import http.client
import http.server
import socket
import ssl
import subprocess
import threading

import pytest

from localswarm import network, object_store
from tests.tools import require_tool


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A CA and a server certificate under tmp_path, and the handler serving tmp_path/objects on 127.0.0.1."""
    require_tool("openssl")
    monkeypatch.setattr(object_store, "CA_DIR", tmp_path / "ca")
    monkeypatch.setattr(object_store, "CA_CERT", tmp_path / "ca" / "ca.crt")
    cert, key = object_store.issue_server_cert(tmp_path / "tls")
    handler = type("TestHandler", (object_store.Handler,), {"root": tmp_path / "objects"})
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tmp_path, server.server_address[1]
    server.shutdown()
    server.server_close()


def get(port: int, host: str, path: str, method: str = "GET") -> tuple[int, bytes, dict]:
    context = ssl.create_default_context(cafile=str(object_store.CA_CERT))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    # Verified against the S3 name, as a machine's curl does, though connected to loopback.
    conn.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname=host)
    conn.request(method, path, headers={"Host": host})
    answer = conn.getresponse()
    body = answer.read()
    conn.close()
    return answer.status, body, dict(answer.getheaders())


def test_the_ca_is_made_once_and_the_certificate_names_every_region(store):
    tmp_path, _ = store
    first = object_store.ensure_ca().read_bytes()
    assert object_store.ensure_ca().read_bytes() == first
    text = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "tls" / "server.crt"), "-noout", "-ext",
                           "subjectAltName"], capture_output=True, text=True, check=True).stdout
    assert "DNS:*.s3.us-east-1.amazonaws.com" in text and "DNS:*.s3.eu-central-1.amazonaws.com" in text
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(object_store.CA_CERT),
                             str(tmp_path / "tls" / "server.crt")], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr


def test_loopback_is_outside_the_subnet_and_is_refused(store):
    _, port = store
    status, body, _ = get(port, "bundles.s3.us-east-1.amazonaws.com", "/k")
    assert status == 403 and b"<Code>AccessDenied</Code>" in body


def test_objects_are_served_virtual_hosted_and_path_style(store, monkeypatch):
    tmp_path, port = store
    monkeypatch.setattr(object_store, "allowed", lambda client: True)  # as if from a machine
    monkeypatch.setattr(object_store, "STORE", tmp_path)
    object_store.put("bundles", "node/a b.tar", b"x" * 10)
    status, body, headers = get(port, "bundles.s3.us-west-2.amazonaws.com", "/node/a%20b.tar")
    assert (status, body, headers["Content-Length"]) == (200, b"x" * 10, "10")
    assert headers["ETag"].startswith('"') and headers["Server"] == "AmazonS3"
    assert get(port, "s3.us-west-2.amazonaws.com", "/bundles/node/a%20b.tar")[:2] == (200, b"x" * 10)
    assert get(port, "bundles.s3.us-west-2.amazonaws.com", "/node/a%20b.tar", "HEAD")[:2] == (200, b"")
    assert b"NoSuchKey" in get(port, "bundles.s3.us-west-2.amazonaws.com", "/node/other")[1]
    assert b"NoSuchBucket" in get(port, "other.s3.us-west-2.amazonaws.com", "/node/a%20b.tar")[1]
    assert get(port, "bundles.s3.us-west-2.amazonaws.com", "/../../ca/ca.key")[0] in (400, 404)


# By name: the addresses are the lane's (localswarm/lane.py), and pytest-xdist's workers must collect
# the same test ids.
CLIENTS = {"a machine": lambda: network.node_addr(1), "the subnet's last": lambda: str(network.SUBNET[-2]),
           "the host's bridge": lambda: network.BRIDGE_ADDR, "loopback": lambda: "127.0.0.1",
           "another subnet": lambda: "10.0.0.5"}


@pytest.mark.parametrize("client, ok", [("a machine", True), ("the subnet's last", True),
                                        ("the host's bridge", False), ("loopback", False), ("another subnet", False)])
def test_only_machines_may_read(client, ok):
    assert object_store.allowed(CLIENTS[client]()) is ok


@pytest.mark.parametrize("bucket, key", [("b", "../x"), ("b", ""), ("", "k"), ("b", "a/../../x")])
def test_keys_cannot_leave_their_bucket(tmp_path, bucket, key):
    with pytest.raises(ValueError):
        object_store.object_path(bucket, key, root=tmp_path)
