"""Provider plugins for Pulumi's real CLI in the rehearsal: `pulumi-resource-aws`, `-command` and `-tls`.

The CLI starts a plugin as an executable found on PATH (localswarm/plugins/, put first on PATH
only by localswarm/pulumi_cli.py) and speaks Pulumi's provider protocol to it over gRPC: the
plugin prints the port it serves on as its first line of stdout (pulumi/sdk/go/common/resource/
plugin/plugin.go reads it so). It reports the version the program pins, so the engine sees the
provider the program asked for.

What they answer is the rehearsal's fake AWS (localswarm/fake_aws.py), the same answers the
tests' mocks give: lookups (Invoke), the inputs with what the real provider's validators refuse
(Check, localswarm/schema_checks.py), and the real provider's replace
rules (Diff, components/provider_facts.py). Outside a preview, Create, Update, Delete and Read
(the refresh of `refresh: always`) act on the rehearsal's machines through
localswarm/plugin_cloud.py.
"""
from __future__ import annotations

import json
import sys
import threading
from concurrent import futures

import grpc
from google.protobuf import empty_pb2, json_format, struct_pb2
from pulumi.runtime import rpc
from pulumi.runtime.proto import plugin_pb2, provider_pb2, provider_pb2_grpc

VERSIONS = {"aws": "7.51.1", "command": "1.2.1", "tls": "5.6.2"}  # requirements.txt's pins
# The provider protocol's markers (pulumi/sdk/go/common/resource/plugin/rpc.go), as the SDK names them.
SECRET_SIG, SECRET_VALUE = rpc._special_sig_key, rpc._special_secret_sig


def plain(value):
    """A protocol value without its secret wrappers, as the rehearsal's handlers read inputs (one rule:
    localswarm/local_cloud.py's)."""
    from localswarm.local_cloud import _plain
    return _plain(value)


def _dict(message: struct_pb2.Struct) -> dict:
    return json_format.MessageToDict(message) if message is not None else {}


def _struct(value: dict) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(value)
    return out


def resource_type(urn: str) -> str:
    """urn:pulumi:<stack>::<project>::<parent types $>…<type>::<name> -> <type>."""
    return urn.split("::")[2].split("$")[-1]


class Provider(provider_pb2_grpc.ResourceProviderServicer):
    def __init__(self, package: str):
        self.package = package
        self.version = VERSIONS[package]
        self._cloud = None
        self._cloud_lock = threading.Lock()

    def cloud(self):
        """The rehearsal's cloud for this package, made on the first step that needs it (never in a preview)."""
        with self._cloud_lock:
            if self._cloud is None:
                from localswarm import plugin_cloud, pulumi_cli
                self._cloud = plugin_cloud.PluginCloud(self.package, pulumi_cli.root())
            return self._cloud

    def GetPluginInfo(self, request, context):
        return plugin_pb2.PluginInfo(version=self.version)

    def GetSchema(self, request, context):
        return provider_pb2.GetSchemaResponse(schema='{"name": "%s", "version": "%s"}' % (self.package, self.version))

    def CheckConfig(self, request, context):
        return provider_pb2.CheckResponse(inputs=request.news)

    def DiffConfig(self, request, context):
        return provider_pb2.DiffResponse()

    def Configure(self, request, context):
        # supportsPreview false: the engine previews a new resource from its inputs, without a Create.
        return provider_pb2.ConfigureResponse(acceptSecrets=True, acceptResources=True, supportsPreview=False)

    def Check(self, request, context):
        """The inputs as given, or what the real provider's validators refuse in them (schema_checks.py)."""
        from localswarm import schema_checks
        failures = schema_checks.check(resource_type(request.urn), plain(_dict(request.news)))
        return provider_pb2.CheckResponse(inputs=request.news, failures=[
            provider_pb2.CheckFailure(property=prop, reason=reason) for prop, reason in failures])

    def Diff(self, request, context):
        from components.provider_facts import KNOWN_TYPES, replaced_by
        typ = resource_type(request.urn)
        olds, news = plain(_dict(request.old_inputs or request.olds)), plain(_dict(request.news))
        for key in request.ignoreChanges:
            if key in olds:
                news[key] = olds[key]
            else:
                news.pop(key, None)
        changed = sorted(k for k in set(olds) | set(news) if olds.get(k) != news.get(k))
        known = typ in KNOWN_TYPES or typ.startswith("command:remote:")
        replaces = sorted(replaced_by(typ, olds, news)) if known and changed else []
        return provider_pb2.DiffResponse(
            changes=provider_pb2.DiffResponse.DIFF_SOME if changed else provider_pb2.DiffResponse.DIFF_NONE,
            diffs=changed, replaces=replaces, deleteBeforeReplace=False)

    def Read(self, request, context):
        from localswarm import fake_aws
        typ = resource_type(request.urn)
        if typ == "aws:ec2/capacityReservation:CapacityReservation":  # Resource.get of one AWS has
            try:
                state = fake_aws.capacity_reservation_state(request.id)
            except Exception:  # noqa: BLE001 -- not found, as the provider reads an ended one
                # An empty read, as the provider's (terraform-provider-aws resourceCapacityReservationRead:
                # NotFound "removing from state", d.SetId("")): a refresh drops it, and the engine fails a
                # `get` of it itself ("resource '<id>' does not exist").
                return provider_pb2.ReadResponse()
            return provider_pb2.ReadResponse(id=request.id, properties=_struct(state), inputs=_struct(state))
        if typ == "aws:ec2/instance:Instance":
            # The refresh of `refresh: always`: a terminated machine is gone (an empty read), a stopped one stopped.
            state = self.cloud().instance_state(request.id)
            if state is None:
                return provider_pb2.ReadResponse()
            properties = {**_dict(request.properties), "instanceState": state}
            return provider_pb2.ReadResponse(id=request.id, properties=_struct(properties), inputs=request.inputs)
        # Everything else stays as the state holds it, as pulumi-command and pulumi-tls read theirs.
        return provider_pb2.ReadResponse(id=request.id, properties=request.properties, inputs=request.inputs)

    def Invoke(self, request, context):
        try:
            answer = self.cloud().invoke(request.tok, plain(_dict(request.args)))
        except Exception as exc:  # noqa: BLE001 -- the provider's error, as the program would see it
            return provider_pb2.InvokeResponse(failures=[provider_pb2.CheckFailure(reason=str(exc))])
        return provider_pb2.InvokeResponse(**{"return": _struct(answer)})

    def Create(self, request, context):
        if request.preview:
            return provider_pb2.CreateResponse(properties=request.properties)
        try:
            rid, outputs = self.cloud().create(request.urn, resource_type(request.urn), plain(_dict(request.properties)))
        except Exception as exc:  # noqa: BLE001 -- the step's error, as the engine prints a provider's
            context.abort(grpc.StatusCode.UNKNOWN, str(exc))
        return provider_pb2.CreateResponse(id=rid, properties=_struct(_jsonable(outputs)))

    def Update(self, request, context):
        if request.preview:
            return provider_pb2.UpdateResponse(properties=request.news)
        try:
            outputs = self.cloud().update(request.urn, resource_type(request.urn), request.id,
                                          plain(_dict(request.old_inputs)), plain(_dict(request.olds)),
                                          plain(_dict(request.news)))
        except Exception as exc:  # noqa: BLE001
            context.abort(grpc.StatusCode.UNKNOWN, str(exc))
        return provider_pb2.UpdateResponse(properties=_struct(_jsonable(outputs)))

    def Delete(self, request, context):
        try:
            self.cloud().delete(request.urn, resource_type(request.urn), request.id, plain(_dict(request.properties)))
        except Exception as exc:  # noqa: BLE001
            context.abort(grpc.StatusCode.UNKNOWN, str(exc))
        return empty_pb2.Empty()

    def Cancel(self, request, context):
        return empty_pb2.Empty()

    def Attach(self, request, context):
        return empty_pb2.Empty()


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def serve(package: str) -> None:
    if package == "aws":  # what AWS did since the last CLI run (a new image, a block extended or ended)
        from localswarm import aws_moves
        aws_moves.apply()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", 400 * 1024 * 1024)])
    provider_pb2_grpc.add_ResourceProviderServicer_to_server(Provider(package), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)  # the engine reads the port from the first line
    server.wait_for_termination()


if __name__ == "__main__":
    serve(sys.argv[1])
