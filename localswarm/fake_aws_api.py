"""The rehearsal's Auto Scaling and Systems Manager endpoints, as the node software calls them: signed, checked, answered.

What the scaler (DescribeAutoScalingGroups, SetDesiredCapacity, TerminateInstanceInAutoScalingGroup) and an
elastic node's join (GetParameter) send, answered as AWS answers: the Query API's XML for Auto Scaling, JSON 1.1
for SSM, their errors in their shapes. Each request must carry a SigV4 signature made with credentials that the
fake IMDS handed an instance (localswarm/fake_imds.py), within five minutes of now, for the endpoint's region and
service; the caller's role must allow the action on the resource (localswarm/fake_iam.py iam_allows, over the
policies the program made), or the answer is AccessDenied in IAM's words. The group's behaviour is
localswarm/fake_groups.py's. `handle` is pure over a state dict; the rehearsal keeps that dict in a file (Store),
shared by `localswarm pulumi up` (which makes groups, templates, parameters and roles) and the server that answers the
machines (localswarm/object_store.py serves these host names beside S3's).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import urllib.parse
import uuid
from datetime import datetime, timezone
from pathlib import Path
from xml.sax.saxutils import escape

from localswarm import fake_groups
from localswarm.fake_account import ACCOUNT_ID, AwsError
from localswarm.fake_iam import iam_allows
from swarm.node_module import load

_sigv4 = load("aws_api.py", "gpu_swarm_node_aws_api")  # the node's signer, whose own test holds it to AWS's suite
AS_NS = "http://autoscaling.amazonaws.com/doc/2011-01-01/"
HOST = re.compile(r"(?P<service>autoscaling|ssm)\.(?P<region>[a-z]{2}(-[a-z]+)+-\d)\.amazonaws\.com(:\d+)?")
_AUTH = re.compile(r"AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<day>\d{8})/(?P<region>[^/]+)/(?P<service>[^/]+)/"
                   r"aws4_request, ?SignedHeaders=(?P<signed>[a-z0-9;-]+), ?Signature=(?P<signature>[0-9a-f]{64})")
SKEW_S = 300  # SigV4: "Signature expired" past 5 minutes (AWS General Reference, "Signing AWS API requests")


def empty_state() -> dict:
    return {"groups": {}, "templates": {}, "parameters": {}, "roles": {}, "profiles": {}, "credentials": {},
            "machines": {}}


class Store:
    """The state dict in a JSON file, changed under an exclusive lock: `localswarm pulumi up` and the server share it."""

    def __init__(self, path: Path):
        self.path = path

    @contextlib.contextmanager
    def changing(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{self.path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self.read()
            yield state
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=1))
            os.chmod(tmp, 0o600)  # it holds the instances' credentials and the join parameters
            tmp.replace(self.path)

    def read(self) -> dict:
        try:
            return {**empty_state(), **json.loads(self.path.read_text())}
        except (OSError, ValueError):
            return empty_state()


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.status, self.code, self.message = status, code, message


def _caller(state: dict, method: str, path: str, query: str, headers: dict, body: bytes, service: str,
            region: str, now: datetime) -> dict:
    """The credentials' record of a correctly signed request, or ApiError as AWS refuses it."""
    lower = {k.lower(): v for k, v in headers.items()}
    found = _AUTH.fullmatch(lower.get("authorization", ""))
    if not found:
        raise ApiError(403, "MissingAuthenticationToken", "Request is missing Authentication Token")
    creds = state["credentials"].get(found["key"])
    if creds is None:
        raise ApiError(403, "InvalidClientTokenId", "The security token included in the request is invalid.")
    if (found["region"], found["service"]) != (region, service):
        raise ApiError(403, "SignatureDoesNotMatch", f"Credential should be scoped to a valid region, not "
                                                     f"'{found['region']}', and to service {service}")
    stamp = lower.get("x-amz-date", "")
    try:
        signed_at = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        raise ApiError(403, "IncompleteSignature", "X-Amz-Date is missing or malformed") from None
    if abs((now - signed_at).total_seconds()) > SKEW_S:
        raise ApiError(403, "SignatureDoesNotMatch", f"Signature expired: {stamp} is now earlier than "
                                                     f"{(now).strftime('%Y%m%dT%H%M%SZ')} - 5 min.")
    if creds.get("token") and lower.get("x-amz-security-token") != creds["token"]:
        raise ApiError(403, "InvalidClientTokenId", "The security token included in the request is invalid.")
    names = found["signed"].split(";")
    if "host" not in names or any(n not in lower for n in names):
        raise ApiError(403, "SignatureDoesNotMatch", "a signed header is missing from the request")
    request, _ = _sigv4.canonical_request(method, path, query, {n: lower[n] for n in names},
                                          hashlib.sha256(body).hexdigest())
    scope = f"{found['day']}/{region}/{service}/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(request.encode()).hexdigest()}"
    want = hmac.new(_sigv4.signing_key(creds["secret"], found["day"], region, service), to_sign.encode(),
                    hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, found["signature"]):
        raise ApiError(403, "SignatureDoesNotMatch", "The request signature we calculated does not match the "
                                                     "signature you provided.")
    return creds


def _authorize(state: dict, creds: dict, action: str, resource: str) -> None:
    role = creds["role"]
    documents = list((state["roles"].get(role) or {}).get("policies", {}).values())
    if not iam_allows(documents, action, resource):
        raise ApiError(403, "AccessDenied" if action.startswith("autoscaling:") else "AccessDeniedException",
                       f"User: arn:aws:sts::{ACCOUNT_ID}:assumed-role/{role}/{creds.get('instance', '')} is not "
                       f"authorized to perform: {action} on resource: {resource} because no identity-based policy "
                       f"allows the {action} action")


def handle(state: dict, method: str, host: str, target: str, headers: dict, body: bytes,
           now: datetime | None = None, launch=None, terminate=None) -> tuple[int, str, bytes]:
    """One request to https://<host><target>: (status, content type, body). launch(group, instance_id) and
    terminate(instance_id) are what the group's converge does to machines (None: nothing)."""
    now = now or datetime.now(timezone.utc)
    found = HOST.fullmatch(host.lower())
    service = found["service"] if found else ""
    try:
        if not found:
            raise ApiError(400, "UnknownEndpoint", f"no stand-in for {host}")
        parts = urllib.parse.urlsplit(target)
        creds = _caller(state, method, parts.path or "/", parts.query, headers, body, service, found["region"], now)
        if service == "ssm":
            return _ssm(state, creds, headers, body, found["region"])
        return _autoscaling(state, creds, body, found["region"], launch, terminate)
    except ApiError as e:
        if service == "ssm":
            return e.status, "application/x-amz-json-1.1", json.dumps({"__type": e.code, "message": e.message}).encode()
        return e.status, "text/xml", (
            f'<ErrorResponse xmlns="{AS_NS}"><Error><Type>Sender</Type><Code>{escape(e.code)}</Code>'
            f"<Message>{escape(e.message)}</Message></Error><RequestId>{uuid.uuid4()}</RequestId></ErrorResponse>"
        ).encode()


def _ssm(state: dict, creds: dict, headers: dict, body: bytes, region: str) -> tuple[int, str, bytes]:
    target = {k.lower(): v for k, v in headers.items()}.get("x-amz-target", "")
    if target != "AmazonSSM.GetParameter":
        raise ApiError(400, "InvalidAction", f"the stand-in answers AmazonSSM.GetParameter, not {target}")
    request = json.loads(body or b"{}")
    name = str(request.get("Name", ""))
    _authorize(state, creds, "ssm:GetParameter", f"arn:aws:ssm:{region}:{ACCOUNT_ID}:parameter{name}")
    parameter = state["parameters"].get(name)
    if parameter is None:
        raise ApiError(400, "ParameterNotFound", f"Parameter {name} not found.")
    value = parameter["value"] if request.get("WithDecryption") or parameter["type"] != "SecureString" else \
        "<encrypted>"
    return 200, "application/x-amz-json-1.1", json.dumps({"Parameter": {
        "Name": name, "Type": parameter["type"], "Value": value, "Version": 1,
        "ARN": f"arn:aws:ssm:{region}:{ACCOUNT_ID}:parameter{name}"}}).encode()


def _autoscaling(state: dict, creds: dict, body: bytes, region: str, launch, terminate) -> tuple[int, str, bytes]:
    form = dict(urllib.parse.parse_qsl(body.decode()))
    action, groups = form.get("Action", ""), state["groups"]
    try:
        if action == "DescribeAutoScalingGroups":
            _authorize(state, creds, "autoscaling:DescribeAutoScalingGroups", "*")
            names = [v for k, v in sorted(form.items()) if k.startswith("AutoScalingGroupNames.member.")]
            return _xml(action, "<AutoScalingGroups>" + "".join(_group_xml(g) for g in
                                                                fake_groups.describe(groups, names))
                        + "</AutoScalingGroups>")
        if action == "SetDesiredCapacity":
            name = form.get("AutoScalingGroupName", "")
            _authorize(state, creds, "autoscaling:SetDesiredCapacity", fake_groups.group_arn(name, region))
            fake_groups.set_desired_capacity(groups, name, int(form.get("DesiredCapacity", "-1")))
            _converge(groups, name, launch, terminate)
            return _xml(action, "")
        if action == "TerminateInstanceInAutoScalingGroup":
            instance = form.get("InstanceId", "")
            name = next((g["name"] for g in groups.values() if instance in g["instances"]), "")
            if name:  # an instance of no group is refused as AWS refuses it (fake_groups), whoever asks
                _authorize(state, creds, "autoscaling:TerminateInstanceInAutoScalingGroup",
                           fake_groups.group_arn(name, region))
            activity = fake_groups.terminate_instance(groups, instance,
                                                      form.get("ShouldDecrementDesiredCapacity") == "true")
            _converge(groups, activity["AutoScalingGroupName"], launch, terminate)
            return _xml(action, "<Activity>" + "".join(f"<{k}>{escape(str(v))}</{k}>" for k, v in activity.items())
                        + "</Activity>")
    except AwsError as e:
        code, _, message = str(e).partition(": ")
        raise ApiError(400, code, message) from None
    raise ApiError(400, "InvalidAction", f"The action {action} is not valid for this web service.")


def _converge(groups: dict, name: str, launch, terminate) -> None:
    if launch is not None and name in groups:
        fake_groups.converge(groups, name, launch, terminate or (lambda _: None))


def _group_xml(g: dict) -> str:
    instances = "".join(
        "<member>" + "".join(f"<{k}>{escape(str(v).lower() if isinstance(v, bool) else str(v))}</{k}>"
                             for k, v in i.items()) + "</member>" for i in g["Instances"])
    fields = "".join(f"<{k}>{escape(str(g[k]))}</{k}>" for k in ("AutoScalingGroupName", "AutoScalingGroupARN",
                                                                  "MinSize", "MaxSize", "DesiredCapacity"))
    return f"<member>{fields}<Instances>{instances}</Instances></member>"


def _xml(action: str, result: str) -> tuple[int, str, bytes]:
    return 200, "text/xml", (f'<{action}Response xmlns="{AS_NS}"><{action}Result>{result}</{action}Result>'
                             f"<ResponseMetadata><RequestId>{uuid.uuid4()}</RequestId></ResponseMetadata>"
                             f"</{action}Response>").encode()
