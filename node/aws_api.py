"""AWS's APIs from a node, stdlib only: the instance role's credentials from IMDSv2, each request signed with SigV4.

The node software is stdlib Python and bash, and plain Ubuntu has no AWS CLI (the Deep Learning AMI
has one; the managers never run it): the two calls an elastic pool needs fit in this file. An
elastic node reads its join parameter (SSM GetParameter, node/swarm_join.py); the leader's scaler
describes its pools' Auto Scaling groups, sets their desired capacity and terminates their instances
(node/swarm_scaler.py). Only root reaches IMDS on a node (node/imds-root-only.sh), so only root gets the
role's credentials. Signature Version 4 as the AWS General Reference describes it; tests/test_aws_api.py
holds it to the AWS SigV4 test suite's published signatures, and to the rehearsal's fake AWS.
"""
from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import re
import time
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timezone

IMDS = "169.254.169.254"
TOKEN_TTL_S = 21600
AUTOSCALING_VERSION = "2011-01-01"
_AS_NS = {"a": f"http://autoscaling.amazonaws.com/doc/{AUTOSCALING_VERSION}/"}
_UNRESERVED = "-_.~"  # RFC 3986's, which SigV4 leaves unencoded (with letters and digits)
RETRIED = re.compile(r"Throttling|ThrottlingException|RequestLimitExceeded|ServiceUnavailable|InternalFailure")


class AwsError(Exception):
    """An AWS answer that is not a success: its code (ValidationError, AccessDenied...) and message."""

    def __init__(self, code: str, message: str, status: int = 0):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.status = code, message, status


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    token: str = ""
    expires: float = 0.0  # unix time; 0: never


# ---------------------------------------------------------------- Signature Version 4

def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe=_UNRESERVED)


def canonical_request(method: str, path: str, query: str, headers: dict[str, str], payload_hash: str
                      ) -> tuple[str, str]:
    """(the canonical request, its signed headers), as SigV4 defines them."""
    # The path as sent, encoded once more: every service but S3 signs it so (SigV4's "encode twice").
    uri = urllib.parse.quote(path or "/", safe="/~")
    pairs = sorted((_quote(urllib.parse.unquote_plus(k)), _quote(urllib.parse.unquote_plus(v)))
                   for k, _, v in (p.partition("=") for p in query.split("&") if p))
    names = sorted(headers, key=str.lower)
    canonical_headers = "".join(f"{n.lower()}:{' '.join(str(headers[n]).split())}\n" for n in names)
    signed = ";".join(n.lower() for n in names)
    query_text = "&".join(f"{k}={v}" for k, v in pairs)
    return f"{method}\n{uri}\n{query_text}\n{canonical_headers}\n{signed}\n{payload_hash}", signed


def signing_key(secret: str, day: str, region: str, service: str) -> bytes:
    key = f"AWS4{secret}".encode()
    for part in (day, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def sign(method: str, url: str, headers: dict[str, str], body: bytes, creds: Credentials, region: str,
         service: str, now: datetime | None = None) -> dict[str, str]:
    """`headers` with Host, X-Amz-Date, the session token and Authorization added."""
    now = now or datetime.now(timezone.utc)
    parts = urllib.parse.urlsplit(url)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    signed_headers = {**headers, "Host": parts.netloc, "X-Amz-Date": stamp}
    if creds.token:
        signed_headers["X-Amz-Security-Token"] = creds.token
    request, names = canonical_request(method, parts.path, parts.query, signed_headers,
                                       hashlib.sha256(body).hexdigest())
    scope = f"{stamp[:8]}/{region}/{service}/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(request.encode()).hexdigest()}"
    signature = hmac.new(signing_key(creds.secret_key, stamp[:8], region, service), to_sign.encode(),
                         hashlib.sha256).hexdigest()
    return {**signed_headers, "Authorization": f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                                               f"SignedHeaders={names}, Signature={signature}"}


# ---------------------------------------------------------------- instance metadata (IMDSv2)

class Imds:
    """IMDSv2: a session token first (PUT), then GETs with it; the role's credentials cached until near expiry."""

    def __init__(self, host: str = IMDS, port: int = 80, timeout: float = 5):
        self.host, self.port, self.timeout = host, port, timeout
        self._token, self._token_until, self._creds = "", 0.0, None

    def _call(self, method: str, path: str, headers: dict) -> str:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, headers=headers)
            answer = conn.getresponse()
            text = answer.read().decode()
        except (OSError, http.client.HTTPException) as e:
            raise AwsError("ImdsUnreachable", f"instance metadata at {self.host}: {e} (only root reaches it on a "
                                              "gpu-swarm node)") from None
        finally:
            conn.close()
        if answer.status != 200:
            raise AwsError("ImdsError", f"{method} {path} answered {answer.status}", answer.status)
        return text

    def get(self, path: str) -> str:
        if time.time() >= self._token_until:
            self._token = self._call("PUT", "/latest/api/token",
                                     {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            self._token_until = time.time() + TOKEN_TTL_S - 60
        return self._call("GET", path, {"X-aws-ec2-metadata-token": self._token})

    def credentials(self) -> Credentials:
        """The instance role's temporary credentials (EC2 renews them before they expire: ask again near the end)."""
        if self._creds and (not self._creds.expires or self._creds.expires - time.time() > 300):
            return self._creds
        base = "/latest/meta-data/iam/security-credentials/"
        role = self.get(base).strip().splitlines()
        if not role:
            raise AwsError("NoInstanceRole", "the instance has no IAM role (instance profile)")
        doc = json.loads(self.get(base + role[0]))
        if doc.get("Code") != "Success":
            raise AwsError("NoCredentials", f"IMDS gave no credentials for role {role[0]}: {doc.get('Code')}")
        expires = datetime.strptime(doc["Expiration"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp() \
            if doc.get("Expiration") else 0.0
        self._creds = Credentials(doc["AccessKeyId"], doc["SecretAccessKey"], doc.get("Token", ""), expires)
        return self._creds


# ---------------------------------------------------------------- the calls

class Client:
    """Signed HTTPS calls to one region's endpoints (https://<service>.<region>.amazonaws.com)."""

    def __init__(self, region: str, credentials, timeout: float = 20, tries: int = 3, connect_to=None):
        """credentials: a function that returns Credentials (Imds.credentials). connect_to: where a test's stand-in
        listens, (address, port, tls); the request is still signed for, and names, the AWS host."""
        if not re.fullmatch(r"[a-z]{2}(-[a-z]+)+-\d", region or ""):
            raise ValueError(f"region {region!r} is not an AWS region such as us-east-1")
        self.region, self.credentials, self.timeout, self.tries = region, credentials, timeout, tries
        self.connect_to = connect_to

    def _post(self, service: str, host_prefix: str, headers: dict, body: bytes) -> tuple[int, bytes]:
        url = f"https://{host_prefix}.{self.region}.amazonaws.com/"
        for attempt in range(self.tries):
            signed = sign("POST", url, headers, body, self.credentials(), self.region, service)
            host = f"{host_prefix}.{self.region}.amazonaws.com"
            if self.connect_to:
                address, port, tls = self.connect_to
                conn = (http.client.HTTPSConnection if tls else http.client.HTTPConnection)(address, port,
                                                                                             timeout=self.timeout)
            else:
                conn = http.client.HTTPSConnection(host, timeout=self.timeout)
            try:
                conn.putrequest("POST", "/", skip_host=True, skip_accept_encoding=True)
                for name, value in signed.items():
                    conn.putheader(name, value)
                conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                answer = conn.getresponse()
                status, data = answer.status, answer.read()
            except (OSError, http.client.HTTPException) as e:
                if attempt + 1 == self.tries:
                    raise AwsError("RequestFailed", f"{url}: {e}") from None
                time.sleep(2 ** attempt)
                continue
            finally:
                conn.close()
            if (status >= 500 or RETRIED.search(data.decode(errors="replace"))) and attempt + 1 < self.tries:
                time.sleep(2 ** attempt)
                continue
            return status, data
        raise AssertionError("unreachable")

    # Auto Scaling: the Query API (form-encoded, XML answers).
    def _autoscaling(self, action: str, params: dict[str, str]) -> ET.Element:
        body = urllib.parse.urlencode({"Action": action, "Version": AUTOSCALING_VERSION, **params}).encode()
        status, data = self._post("autoscaling", "autoscaling",
                                  {"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"}, body)
        try:
            root = ET.fromstring(data)
        except ET.ParseError:
            raise AwsError("BadAnswer", f"autoscaling {action} answered {status} with no XML") from None
        if status != 200:
            code = root.findtext(".//a:Error/a:Code", namespaces=_AS_NS) or root.findtext(".//Code") or str(status)
            message = root.findtext(".//a:Error/a:Message", namespaces=_AS_NS) or root.findtext(".//Message") or ""
            raise AwsError(code, message, status)
        return root

    def describe_groups(self, names: list[str]) -> dict[str, dict]:
        """Each named group that exists: {"desired", "min", "max", "instances": {id: lifecycle state}}."""
        params = {f"AutoScalingGroupNames.member.{i}": n for i, n in enumerate(names, start=1)}
        found, token = {}, ""
        while True:
            root = self._autoscaling("DescribeAutoScalingGroups", {**params, **({"NextToken": token} if token else {})})
            for g in root.iterfind(".//a:AutoScalingGroups/a:member", _AS_NS):
                instances = {i.findtext("a:InstanceId", namespaces=_AS_NS): i.findtext("a:LifecycleState", namespaces=_AS_NS)
                             for i in g.iterfind("a:Instances/a:member", _AS_NS)}
                found[g.findtext("a:AutoScalingGroupName", namespaces=_AS_NS)] = {
                    "desired": int(g.findtext("a:DesiredCapacity", "0", _AS_NS)),
                    "min": int(g.findtext("a:MinSize", "0", _AS_NS)), "max": int(g.findtext("a:MaxSize", "0", _AS_NS)),
                    "instances": instances}
            token = root.findtext(".//a:NextToken", "", _AS_NS)
            if not token:
                return found

    def set_desired_capacity(self, group: str, desired: int) -> None:
        self._autoscaling("SetDesiredCapacity", {"AutoScalingGroupName": group, "DesiredCapacity": str(desired),
                                                 "HonorCooldown": "false"})

    def terminate_instance(self, instance_id: str, decrement: bool) -> None:
        self._autoscaling("TerminateInstanceInAutoScalingGroup",
                          {"InstanceId": instance_id, "ShouldDecrementDesiredCapacity": str(decrement).lower()})

    # SSM: the JSON 1.1 protocol.
    def get_parameter(self, name: str) -> str:
        """A parameter's value, decrypted (a SecureString's)."""
        body = json.dumps({"Name": name, "WithDecryption": True}).encode()
        status, data = self._post("ssm", "ssm", {"Content-Type": "application/x-amz-json-1.1",
                                                 "X-Amz-Target": "AmazonSSM.GetParameter"}, body)
        try:
            doc = json.loads(data or b"{}")
        except ValueError:
            raise AwsError("BadAnswer", f"ssm GetParameter answered {status} with no JSON") from None
        if status != 200:
            code = str(doc.get("__type", status)).rsplit("#", 1)[-1]
            raise AwsError(code, str(doc.get("message") or doc.get("Message") or ""), status)
        return doc["Parameter"]["Value"]
