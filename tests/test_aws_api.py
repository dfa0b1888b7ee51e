"""The node's AWS calls (node/aws_api.py) and the rehearsal's endpoints that answer them (localswarm/fake_aws_api.py).

The signer is held to the AWS SigV4 test suite's published signatures. Then the real client, with credentials
from the fake IMDS over HTTP, calls the fake Auto Scaling and SSM endpoints over HTTP on loopback: each request's
signature is checked, and each call is allowed or refused by the policies the program writes, as IAM would. An
elastic node's join (node/swarm_join.py) runs whole against them and a stand-in Engine API.
"""
from __future__ import annotations

import json
import socketserver
import tempfile
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from components.elastic_pool import join_document, join_policy, scaler_policy
from localswarm import fake_aws_api, fake_groups, fake_imds
from swarm.node_module import load

aws_api = load("aws_api.py", "aws_api")  # the node's module, as its siblings import it
swarm_join = load("swarm_join.py", "swarm_join_under_test")

SUITE_KEY = ("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
SUITE_TIME = datetime(2015, 8, 30, 12, 36, tzinfo=timezone.utc)


@pytest.mark.parametrize("method,url,headers,body,signature", [
    # aws-sig-v4-test-suite: get-vanilla, post-x-www-form-urlencoded (service "service", us-east-1).
    ("GET", "https://example.amazonaws.com/", {}, b"",
     "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"),
    ("POST", "https://example.amazonaws.com/", {"Content-Type": "application/x-www-form-urlencoded"},
     b"Param1=value1", "ff11897932ad3f4e8b18135d722051e5ac45fc38421b1da7b9d196a0fe09473a"),
])
def test_the_signer_makes_the_aws_test_suites_signatures(method, url, headers, body, signature):
    signed = aws_api.sign(method, url, headers, body, aws_api.Credentials(*SUITE_KEY), "us-east-1", "service",
                          SUITE_TIME)
    names = "content-type;host;x-amz-date" if headers else "host;x-amz-date"
    assert signed["Authorization"] == (f"AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/"
                                       f"aws4_request, SignedHeaders={names}, Signature={signature}")


GROUP, OTHER = "gpu-swarm-dev-t4", "gpu-swarm-dev-l4"
PARAMETER = "/gpu-swarm/gpu-swarm-dev/t4/join"
PARAMETER_ARN = f"arn:aws:ssm:us-east-1:123456789012:parameter{PARAMETER}"


class Cloud:
    """The fake endpoints over plain HTTP on loopback, the fake IMDS beside them, and one state dict."""

    def __init__(self):
        self.state = fake_aws_api.empty_state()
        for name in (GROUP, OTHER):
            fake_groups.create_group(self.state["groups"], name, {"minSize": 0, "maxSize": 2, "protectFromScaleIn": True})
        self.state["roles"] = {
            "scaler": {"policies": {"p": json.loads(scaler_policy([fake_groups.group_arn(GROUP)]))}},
            "t4-node": {"policies": {"p": json.loads(join_policy(PARAMETER_ARN))}}}
        self.state["parameters"][PARAMETER] = {"type": "SecureString", "value": join_document(
            "SWMTKN-1-abc-def", ["10.42.0.5"], "clusteraaaaaaaaaaaaaaaaaa")}
        self.launched, self.now = [], None
        cloud = self

        class Api(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status, kind, data = fake_aws_api.handle(
                    cloud.state, "POST", self.headers["Host"], self.path, dict(self.headers), body, now=cloud.now,
                    launch=lambda group, instance: cloud.launched.append(instance))
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_):
                pass

        self.api = ThreadingHTTPServer(("127.0.0.1", 0), Api)
        self.records = Path(tempfile.mkdtemp(prefix="imds-"))
        self.imds = ThreadingHTTPServer(("127.0.0.1", 0), fake_imds.make_instance_handler(self.records))
        for server in (self.api, self.imds):
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def as_instance(self, role: str) -> aws_api.Client:
        """A client with the credentials the fake IMDS hands an instance of `role` (this host plays it)."""
        key, secret, token = f"ASIA{role.upper().replace('-', '')}", f"secret-of-{role}", f"token-of-{role}"
        self.state["credentials"][key] = {"secret": secret, "token": token, "role": role, "instance": "i-0abc"}
        fake_imds.register(self.records, "127.0.0.1", {
            "instance-id": "i-0abc", "local-ipv4": "10.42.0.9", "metadataOptions": {"httpTokens": "required"},
            "iam": {"role": role, "AccessKeyId": key, "SecretAccessKey": secret, "Token": token,
                    "Expiration": "2099-01-01T00:00:00Z"}})
        self.imds_client = aws_api.Imds("127.0.0.1", self.imds.server_address[1])
        return aws_api.Client("us-east-1", self.imds_client.credentials, tries=1,
                              connect_to=("127.0.0.1", self.api.server_address[1], False))

    def close(self):
        for server in (self.api, self.imds):
            server.shutdown()
            server.server_close()


@pytest.fixture
def cloud():
    c = Cloud()
    yield c
    c.close()


def refused(call) -> aws_api.AwsError:
    with pytest.raises(aws_api.AwsError) as err:
        call()
    return err.value


def test_the_scaler_describes_scales_and_terminates_only_its_pools_group(cloud):
    scaler = cloud.as_instance("scaler")
    assert scaler.describe_groups([GROUP]) == {GROUP: {"desired": 0, "min": 0, "max": 2, "instances": {}}}
    scaler.set_desired_capacity(GROUP, 2)
    found = scaler.describe_groups([GROUP, "no-such-group"])[GROUP]
    assert found["desired"] == 2 and sorted(found["instances"]) == sorted(cloud.launched)
    assert set(found["instances"].values()) == {"InService"}
    above = refused(lambda: scaler.set_desired_capacity(GROUP, 3))
    assert (above.code, above.message) == ("ValidationError", "New SetDesiredCapacity value 3 is above max value 2 "
                                                              "for the AutoScalingGroup.")
    other = refused(lambda: scaler.set_desired_capacity(OTHER, 1))
    assert other.code == "AccessDenied" and "autoscaling:SetDesiredCapacity on resource: arn:aws:autoscaling:" in \
        other.message and OTHER in other.message
    first = cloud.launched[0]
    scaler.terminate_instance(first, decrement=True)
    after = scaler.describe_groups([GROUP])[GROUP]
    assert after["desired"] == 1 and first not in after["instances"] and len(after["instances"]) == 1


def test_the_last_decrement_below_min_is_refused_in_aws_words(cloud):
    cloud.state["groups"][GROUP]["min"] = 1
    scaler = cloud.as_instance("scaler")
    scaler.set_desired_capacity(GROUP, 1)
    error = refused(lambda: scaler.terminate_instance(cloud.launched[0], decrement=True))
    assert error.code == "ValidationError" and "Terminating instance without replacement will violate group's min " \
        "size constraint" in error.message


def test_a_node_reads_its_pools_join_and_nothing_else(cloud):
    node = cloud.as_instance("t4-node")
    assert json.loads(node.get_parameter(PARAMETER))["token"] == "SWMTKN-1-abc-def"
    denied = refused(lambda: node.get_parameter(PARAMETER.replace("/t4/", "/l4/")))
    assert denied.code == "AccessDeniedException" and "ssm:GetParameter" in denied.message
    assert refused(lambda: node.describe_groups([GROUP])).code == "AccessDenied"
    scaler = cloud.as_instance("scaler")
    assert refused(lambda: scaler.get_parameter(PARAMETER)).code == "AccessDeniedException"


def test_a_request_signed_with_another_secret_or_too_long_ago_is_refused(cloud):
    scaler = cloud.as_instance("scaler")
    creds = scaler.credentials()
    forged = aws_api.Client("us-east-1", lambda: aws_api.Credentials(creds.access_key, "guessed", creds.token),
                            tries=1, connect_to=scaler.connect_to)
    assert refused(lambda: forged.describe_groups([GROUP])).code == "SignatureDoesNotMatch"
    cloud.now = datetime.now(timezone.utc) + timedelta(minutes=6)
    late = refused(lambda: scaler.describe_groups([GROUP]))
    assert late.code == "SignatureDoesNotMatch" and "Signature expired" in late.message


class EngineStub(BaseHTTPRequestHandler):
    """dockerd's /info and /swarm/join, as an elastic node's join asks them."""

    def do_GET(self):  # noqa: N802
        engine = self.server.engine
        self._json(200, {"Labels": engine["labels"](), "Swarm": engine["swarm"]})

    def do_POST(self):  # noqa: N802
        engine = self.server.engine
        engine["joins"].append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        engine["swarm"] = {"LocalNodeState": "active", "NodeID": "joinednodeaaaaaaaaaaaaaaa"}
        self._json(200, {})

    def _json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def address_string(self):
        return "unix"

    def log_message(self, *_):
        pass


def test_an_elastic_node_joins_drained_from_its_parameter_with_its_instance_labelled(cloud, tmp_path):
    cloud.as_instance("t4-node")
    daemon_json = tmp_path / "daemon.json"
    daemon_json.write_text('{"labels": ["gpu.count=1"], "default-runtime": "nvidia"}\n')
    pidfile = tmp_path / "docker.pid"
    pidfile.write_text("999999\n")  # no such process: the test's dockerd reads daemon.json itself (below)
    sock = Path(tempfile.mkdtemp(prefix="eng-")) / "docker.sock"
    server = socketserver.ThreadingUnixStreamServer(str(sock), EngineStub)
    server.engine = {"swarm": {"LocalNodeState": "inactive"}, "joins": [],
                     "labels": lambda: json.loads(daemon_json.read_text())["labels"]}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    args = swarm_join.parse_args(["--parameter", PARAMETER, "--region", "us-east-1", "--pool", "t4",
                                  "--docker-socket", str(sock), "--daemon-json", str(daemon_json),
                                  "--dockerd-pidfile", str(pidfile), "--timeout", "0"])
    client_for = lambda region, creds: aws_api.Client(region, creds, tries=1,  # noqa: E731
                                                      connect_to=("127.0.0.1", cloud.api.server_address[1], False))
    try:
        with pytest.raises(swarm_join.JoinError) as err:  # dockerd was not told: nothing is joined
            swarm_join.run(args, cloud.imds_client, client_for)
        assert "could not tell dockerd" in str(err.value) and not server.engine["joins"]
        pidfile.write_text(f"{__import__('os').getpid()}\n")  # SIGHUP to this test: ignored, as dockerd reloads
        import signal
        old = signal.signal(signal.SIGHUP, lambda *_: None)
        try:
            daemon_json.write_text('{"labels": ["gpu.count=1"], "default-runtime": "nvidia"}\n')
            node_id = swarm_join.run(args, cloud.imds_client, client_for)
        finally:
            signal.signal(signal.SIGHUP, old)
    finally:
        server.shutdown()
        server.server_close()
    assert node_id == "joinednodeaaaaaaaaaaaaaaa"
    assert server.engine["joins"] == [{"ListenAddr": "0.0.0.0:2377", "AdvertiseAddr": "10.42.0.9",
                                       "RemoteAddrs": ["10.42.0.5:2377"], "JoinToken": "SWMTKN-1-abc-def",
                                       "Availability": "drain"}]
    written = json.loads(daemon_json.read_text())
    assert written["labels"] == ["gpu.count=1", "gpu-swarm.instance-id=i-0abc", "gpu-swarm.elastic-pool=t4"]
    assert written["default-runtime"] == "nvidia"  # every other key kept
