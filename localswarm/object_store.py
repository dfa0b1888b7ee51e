"""The rehearsal's S3: HTTPS GET/HEAD of objects on the bridge, as a bucket behind a VPC gateway endpoint.

Nodes fetch https://<bucket>.s3.<region>.amazonaws.com/<key> (their /etc/hosts maps the name to
the bridge address) and verify the certificate against the rehearsal CA, which the node image
trusts. Only the rehearsal's machines may read (others get 403 AccessDenied, as a bucket policy
limited to the VPC endpoint answers). Objects are files, <state>/objects/<bucket>/<key>.
API: ensure_ca() -> Path, start() -> None, put(bucket, key, data), url(bucket, key, region),
stop(). The server is a background process of this module (`serve`), like the local registry; the
bridge's resolver (localswarm/dns.py) and instance metadata (localswarm/fake_imds.py) run in the same
process, so they start and stop with it.
"""
from __future__ import annotations

import email.utils
import hashlib
import http.server
import ipaddress
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from localswarm import dns, fake_aws_api, fake_imds, lane
from localswarm.host import SETUP_HINT, RehearsalError, run
from localswarm.network import BRIDGE_ADDR, SUBNET

# Kept with the node image's cache: the image trusts this CA, so it outlives `down`.
CA_DIR = Path(os.environ.get("GPU_SWARM_CA_DIR", "/var/cache/gpu-swarm/rehearsal-ca"))
CA_CERT = CA_DIR / "ca.crt"
# Beside the machines (machines.STATE), apart from /var/lib/localswarm, which `down` removes whole.
STORE = lane.MACHINES_STATE / "object-store"
PORT = 443
# The server certificate names every commercial region, so any stack's region works.
REGIONS = ("us-east-1", "us-east-2", "us-west-1", "us-west-2", "ca-central-1", "ca-west-1", "sa-east-1",
           "eu-west-1", "eu-west-2", "eu-west-3", "eu-central-1", "eu-central-2", "eu-north-1", "eu-south-1",
           "eu-south-2", "ap-south-1", "ap-south-2", "ap-northeast-1", "ap-northeast-2", "ap-northeast-3",
           "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-southeast-4", "ap-southeast-5",
           "ap-east-1", "me-south-1", "me-central-1", "il-central-1", "af-south-1", "mx-central-1")
_HOST = re.compile(r"(?:(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])\.)?"  # virtual-hosted style
                   r"s3(?:[.-](?P<region>[a-z0-9-]+))?\.amazonaws\.com")


def ensure_ca() -> Path:
    """The rehearsal CA's certificate, made once (openssl) and kept; the node image bakes it in."""
    cert, key = CA_CERT, CA_DIR / "ca.key"
    if cert.exists() and key.exists():
        return cert
    CA_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(CA_DIR, 0o700)
    tmp = Path(tempfile.mkdtemp(dir=CA_DIR))
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(tmp / "ca.key"), "-out", str(tmp / "ca.crt"), "-days", "3650",
             "-subj", "/O=gpu-swarm rehearsal/CN=gpu-swarm rehearsal CA (local only)",
             "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    os.replace(tmp / "ca.key", key)
    os.replace(tmp / "ca.crt", cert)
    tmp.rmdir()
    return cert


def _openssl(*args: str) -> None:
    try:
        run(["openssl", *args])
    except FileNotFoundError:
        raise RehearsalError(f"`openssl` is not installed; {SETUP_HINT}")


def server_names() -> list[str]:
    """S3's names, and the Auto Scaling and SSM endpoints that elastic pools' nodes call (fake_aws_api.py)."""
    names = ["s3.amazonaws.com", "*.s3.amazonaws.com"]
    for region in REGIONS:
        names += [f"s3.{region}.amazonaws.com", f"*.s3.{region}.amazonaws.com", f"autoscaling.{region}.amazonaws.com",
                  f"ssm.{region}.amazonaws.com"]
    return names


def issue_server_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate for every S3 endpoint name, signed by the rehearsal CA; kept while it is the CA's."""
    ca = ensure_ca()
    cert, key = folder / "server.crt", folder / "server.key"
    signed_by = folder / "server.ca-sha256"
    # Issued again for another CA, or another list of names.
    ca_digest = hashlib.sha256(ca.read_bytes() + "\n".join(server_names()).encode()).hexdigest()
    if cert.exists() and key.exists() and signed_by.exists() and signed_by.read_text() == ca_digest:
        return cert, key
    folder.mkdir(parents=True, exist_ok=True)
    ext = folder / "server.ext"
    ext.write_text("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                   "extendedKeyUsage=serverAuth\nsubjectAltName=" + ",".join(f"DNS:{n}" for n in server_names()) + "\n")
    csr = folder / "server.csr"
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", "/CN=s3.amazonaws.com")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(CA_DIR / "ca.key"), "-CAcreateserial",
             "-CAserial", str(folder / "ca.srl"), "-out", str(cert), "-days", "825", "-extfile", str(ext))
    signed_by.write_text(ca_digest)
    return cert, key


def object_path(bucket: str, key: str, root: Path | None = None) -> Path:
    """Where an object lives; a key that would leave its bucket's folder is refused."""
    base = (root or STORE / "objects") / bucket
    path = (base / key).resolve()
    if not key or not bucket or base.resolve() not in path.parents:
        raise ValueError(f"bad bucket or key: {bucket!r} {key!r}")
    return path


def put(bucket: str, key: str, data: bytes) -> None:
    path = object_path(bucket, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # a node downloading now gets the old or the new object, never half


def url(bucket: str, key: str, region: str = "us-east-1") -> str:
    return f"https://{bucket}.s3.{region}.amazonaws.com/{urllib.parse.quote(key)}"


def allowed(client: str) -> bool:
    """Only machines: the subnet, less the bridge's own address (this host, the operator's side)."""
    address = ipaddress.ip_address(client)
    return address in SUBNET and str(address) != BRIDGE_ADDR


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3; every answer has a Content-Length
    root: Path = STORE / "objects"

    def version_string(self) -> str:
        return "AmazonS3"

    def _error(self, status: int, code: str, message: str) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                "</Error>\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _locate(self) -> tuple[str, str] | None:
        host = (self.headers.get("Host") or "").split(":")[0].lower()
        match = _HOST.fullmatch(host)
        if not match:
            return None
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        if match["bucket"]:  # virtual-hosted style
            return match["bucket"], path.lstrip("/")
        bucket, _, key = path.lstrip("/").partition("/")  # path style
        return bucket, key

    def _api(self) -> bool:
        """A request to the Auto Scaling or SSM stand-in (an elastic pool's): answered here, True."""
        host = (self.headers.get("Host") or "").split(":")[0].lower()
        if not fake_aws_api.HOST.fullmatch(host):
            return False
        from localswarm import elastic_cloud
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            with elastic_cloud.STORE.changing() as state:
                status, kind, data = fake_aws_api.handle(
                    state, self.command, host, self.path, dict(self.headers), body,
                    launch=lambda group, instance: elastic_cloud.launch_instance(state, group, instance),
                    terminate=lambda instance: elastic_cloud.terminate_instance(state, instance))
        except Exception as e:  # noqa: BLE001 (AWS's answer to its own fault; the log has the rest)
            self.log_message("API fault: %s", repr(e))
            status, kind, data = 500, "text/xml", (f"<ErrorResponse><Error><Type>Receiver</Type><Code>InternalFailure"
                                                  f"</Code><Message>{e!r}</Message></Error></ErrorResponse>").encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return True

    def do_POST(self) -> None:  # noqa: N802
        if not allowed(self.client_address[0]):
            return self._error(403, "AccessDenied", "Access Denied")
        if not self._api():
            self._error(405, "MethodNotAllowed", "The specified method is not allowed against this resource.")

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if not allowed(self.client_address[0]):
            return self._error(403, "AccessDenied", "Access Denied")
        where = self._locate()
        if where is None:
            return self._error(400, "InvalidURI", "not an S3 host name")
        try:
            path = object_path(*where, root=self.root)
        except ValueError:
            return self._error(400, "InvalidURI", "Could not parse the specified URI")
        if not (self.root / where[0]).is_dir():
            return self._error(404, "NoSuchBucket", "The specified bucket does not exist")
        try:
            data = path.read_bytes()
            stamp = path.stat().st_mtime
        except (FileNotFoundError, IsADirectoryError):
            return self._error(404, "NoSuchKey", "The specified key does not exist.")
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')
        self.send_header("Last-Modified", email.utils.formatdate(stamp, usegmt=True))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_HEAD = do_GET

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {self.client_address[0]} {format % args}\n")


def serve(address: str = BRIDGE_ADDR, port: int = PORT) -> None:
    """Run the server in this process until SIGTERM."""
    cert, key = issue_server_cert(STORE / "tls")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = http.server.ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    server.socket = context.wrap_socket(server.socket, server_side=True)
    dns.serve_in_background(address)
    fake_imds.serve_in_background(address)
    threading.Thread(target=_converge_groups, name="groups", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


def _converge_groups(interval_s: float = 2) -> None:
    """What Auto Scaling does by itself: each group replaces what it lost (a reclaimed machine) and terminates
    what it was asked to, between the scaler's calls."""
    from localswarm import elastic_cloud
    while True:
        time.sleep(interval_s)
        try:
            elastic_cloud.converge_all()
        except Exception as e:  # noqa: BLE001 (the server goes on; the log says why)
            sys.stderr.write(f"{time.strftime('%H:%M:%S')} groups: converge failed: {e}\n")


def _pid() -> int | None:
    try:
        pid = int((STORE / "server.pid").read_text())
        return pid if b"localswarm.object_store" in Path(f"/proc/{pid}/cmdline").read_bytes() else None
    except (OSError, ValueError):
        return None


def start() -> None:
    """Start the server (once), and wait until it answers; needs the bridge (network.create_bridge)."""
    if _pid():
        return
    (STORE / "objects").mkdir(parents=True, exist_ok=True)
    issue_server_cert(STORE / "tls")  # here, so that an openssl failure is reported to the caller
    repo = Path(__file__).resolve().parent.parent
    with open(STORE / "server.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "localswarm.object_store", "serve"], cwd=repo,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    (STORE / "server.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection((BRIDGE_ADDR, PORT), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    raise RehearsalError(f"the S3 stand-in did not start on {BRIDGE_ADDR}:{PORT}; see {STORE / 'server.log'}")


def stop() -> None:
    pid = _pid()
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while _pid() and time.monotonic() < deadline:
            time.sleep(0.05)
    (STORE / "server.pid").unlink(missing_ok=True)


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
