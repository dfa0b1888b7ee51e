"""A GPU service's CUDA requirement against its pools' driver, read from a real registry at preview.

The registry is docker-registry (distribution 2.8) on loopback; images are pushed to it over
the Registry HTTP API as localswarm pushes them. Credentials are checked by a small token
server and proxy of ours in front of it, speaking the Docker registry token flow (or Basic).
"""
from __future__ import annotations

import base64
import http.server
import io
import json
import socket
import tarfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from textwrap import dedent

import pulumi
import pytest

import settings
from localswarm import registry as local_registry
from localswarm.monitoring_stack import push_image
from settings import SettingsError, cuda_checks, image_registry, load_settings
from settings.cuda_drivers import max_cuda, parse_requirement
from tests.conftest import run_program, stack_config, use_mocks
from tests.tools import docker_registry

# As nvidia/cuda's images publish it: the version, then the forward-compatibility alternatives.
REQUIRE_13_1 = ("cuda>=13.1 brand=unknown,driver>=535,driver<536 brand=tesla,driver>=535,driver<536 "
                "brand=nvidia,driver>=570,driver<571")
REQUIRE_12_4 = "cuda>=12.4 brand=tesla,driver>=470,driver<471 brand=nvidia,driver>=535,driver<536"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """docker-registry on loopback: its host:port."""
    with docker_registry(tmp_path_factory.mktemp("registry")) as address:
        yield address


def _rootfs(text: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = text.encode()
        info = tarfile.TarInfo("etc/image")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def push(addr: str, repository: str, tag: str, env: list[str]) -> str:
    return push_image(repository, tag, _rootfs(repository + tag), {"Env": ["PATH=/usr/bin", *env]}, addr)


def push_index(addr: str, repository: str, tag: str, media_type: str, platforms: dict[str, str]) -> str:
    """An index/manifest list over manifests already pushed: {architecture: digest}."""
    manifests = []
    for arch, digest in platforms.items():
        with urllib.request.urlopen(urllib.request.Request(
                f"http://{addr}/v2/{repository}/manifests/{digest}",
                headers={"Accept": image_registry.MANIFEST_TYPES[3]})) as answer:
            size = len(answer.read())
        manifests.append({"mediaType": image_registry.MANIFEST_TYPES[3], "digest": digest, "size": size,
                          "platform": {"architecture": arch, "os": "linux"}})
    body = json.dumps({"schemaVersion": 2, "mediaType": media_type, "manifests": manifests}).encode()
    local_registry._ask("PUT", f"http://{addr}/v2/{repository}/manifests/{tag}", body, {"Content-Type": media_type})
    return local_registry._digest(body)


class AuthFront:
    """A registry that wants credentials: our token server and a proxy to docker-registry, on loopback.

    mode "bearer": a 401 names the token realm; /token gives a token for user:password (Basic), and
    the proxy forwards only requests that carry it. mode "basic": the proxy wants user:password."""

    USER, PASSWORD = "puller", "s3cret-pass"

    def __init__(self, upstream: str, mode: str):
        self.mode, self.upstream, self.token_requests, self.paths = mode, upstream, [], []
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                basic = "Basic " + base64.b64encode(f"{front.USER}:{front.PASSWORD}".encode()).decode()
                given = self.headers.get("Authorization")
                if self.path.startswith("/token"):
                    front.token_requests.append(dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query)))
                    if given != basic:
                        return self._answer(401, b'{"errors": [{"code": "UNAUTHORIZED"}]}', {})
                    return self._answer(200, json.dumps({"token": "t0ken-for-puller"}).encode(), {})
                wanted = "Bearer t0ken-for-puller" if front.mode == "bearer" else basic
                front.paths.append((self.path, given == wanted))
                if given != wanted:
                    challenge = (f'Bearer realm="http://{front.addr}/token",service="front.test",'
                                 f'scope="repository:{self.path.split("/")[2]}:pull"'
                                 if front.mode == "bearer" else 'Basic realm="front.test"')
                    return self._answer(401, b'{"errors": [{"code": "UNAUTHORIZED"}]}',
                                        {"WWW-Authenticate": challenge})
                request = urllib.request.Request(f"http://{front.upstream}{self.path}",
                                                 headers={"Accept": self.headers.get("Accept", "*/*")})
                try:
                    with urllib.request.urlopen(request) as answer:
                        return self._answer(answer.status, answer.read(), {
                            k: v for k, v in answer.headers.items() if k in ("Content-Type", "Docker-Content-Digest")})
                except urllib.error.HTTPError as exc:
                    return self._answer(exc.code, exc.read(), {})

            def _answer(self, code, body, headers):
                self.send_response(code)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoints(monkeypatch):
    """ENDPOINTS as the test sets them: loopback registries over plain HTTP."""
    table = {}
    monkeypatch.setattr(image_registry, "ENDPOINTS", table)
    return table


def direct(endpoints, addr):
    endpoints[addr] = f"http://{addr}"
    return addr


# ----------------------------------------------------------------------------- reading the image's config

def test_a_tag_and_a_digest_read_the_same_config(registry, endpoints):
    direct(endpoints, registry)
    digest = push(registry, "nvidia/cuda", "12.4.1-base", [f"NVIDIA_REQUIRE_CUDA={REQUIRE_12_4}"])
    reg = image_registry.Registry()
    by_tag = reg.image_config(f"{registry}/nvidia/cuda:12.4.1-base")
    assert by_tag.digest == digest and f"NVIDIA_REQUIRE_CUDA={REQUIRE_12_4}" in by_tag.env
    assert image_registry.Registry().image_config(f"{registry}/nvidia/cuda@{digest}") == by_tag
    assert image_registry.Registry().image_config(f"{registry}/nvidia/cuda:12.4.1-base@{digest}") == by_tag


def test_docker_hub_names_read_from_the_hub_endpoint(registry, endpoints):
    endpoints["docker.io"] = f"http://{registry}"
    push(registry, "nvidia/cuda", "13.1.0-base-ubuntu24.04", [f"NVIDIA_REQUIRE_CUDA={REQUIRE_13_1}"])
    push(registry, "library/ubuntu", "24.04", [])
    reg = image_registry.Registry()
    assert f"NVIDIA_REQUIRE_CUDA={REQUIRE_13_1}" in reg.image_config("nvidia/cuda:13.1.0-base-ubuntu24.04").env
    assert reg.image_config("ubuntu:24.04").env == ("PATH=/usr/bin",)  # library/ubuntu, as docker reads it


@pytest.mark.parametrize("media_type", image_registry.MANIFEST_TYPES[:2], ids=["oci-index", "docker-list"])
def test_an_index_gives_its_linux_amd64_image(registry, endpoints, media_type):
    direct(endpoints, registry)
    arm = push(registry, "multi/app", "arm", ["NVIDIA_REQUIRE_CUDA=cuda>=99.0"])
    amd = push(registry, "multi/app", "amd", [f"NVIDIA_REQUIRE_CUDA={REQUIRE_12_4}"])
    index = push_index(registry, "multi/app", "1.0", media_type, {"arm64": arm, "amd64": amd})
    found = image_registry.Registry().image_config(f"{registry}/multi/app:1.0")
    assert found.digest == amd and f"NVIDIA_REQUIRE_CUDA={REQUIRE_12_4}" in found.env
    assert image_registry.Registry().image_config(f"{registry}/multi/app@{index}").digest == amd


@pytest.mark.parametrize("mode", ["bearer", "basic"])
def test_a_registry_that_wants_credentials_is_read_with_them(registry, endpoints, mode):
    push(registry, "private/train", "2", [f"NVIDIA_REQUIRE_CUDA={REQUIRE_13_1}"])
    front = AuthFront(registry, mode)
    try:
        direct(endpoints, front.addr)
        image = f"{front.addr}/private/train:2"
        with pytest.raises(image_registry.RegistryRefused, match="registryCredentials"):
            image_registry.Registry().image_config(image)
        with pytest.raises(image_registry.RegistryRefused, match="refused"):
            image_registry.Registry({front.addr: ("puller", "wrong")}).image_config(image)
        found = image_registry.Registry({front.addr: (front.USER, front.PASSWORD)}).image_config(image)
        assert f"NVIDIA_REQUIRE_CUDA={REQUIRE_13_1}" in found.env
        if mode == "bearer":
            assert front.token_requests[-1] == {"scope": "repository:private/train:pull", "service": "front.test"}
    finally:
        front.close()


def test_one_run_reads_each_config_once_and_asks_for_one_token(registry, endpoints):
    digest = push(registry, "private/serve", "1", ["NVIDIA_REQUIRE_CUDA=cuda>=12.2"])
    front = AuthFront(registry, "bearer")
    try:
        direct(endpoints, front.addr)
        reg = image_registry.Registry({front.addr: (front.USER, front.PASSWORD)})
        for image in (f"{front.addr}/private/serve:1", f"{front.addr}/private/serve@{digest}",
                      f"{front.addr}/private/serve:1"):
            assert reg.image_config(image).digest == digest
        blobs = [path for path, _ in front.paths if "/blobs/" in path]
        assert len(blobs) == 1 and len(front.token_requests) == 1
        assert [path for path, authorized in front.paths if not authorized] == ["/v2/private/serve/manifests/1"]
    finally:
        front.close()


def test_a_registry_that_does_not_answer_is_given_up_after_one_short_timeout(endpoints):
    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    addr = direct(endpoints, f"127.0.0.1:{silent.getsockname()[1]}")
    reg = image_registry.Registry(timeout=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(image_registry.RegistryUnreachable, match="did not answer"):
            reg.image_config(f"{addr}/a/b:1")
        first = time.monotonic() - start
        start = time.monotonic()
        with pytest.raises(image_registry.RegistryUnreachable):
            reg.image_config(f"{addr}/c/d:2")
        assert first < 3 and time.monotonic() - start < 0.1
    finally:
        silent.close()


# ----------------------------------------------------------------------------- the table and the requirement

def test_the_requirement_is_read_as_the_toolkit_reads_it():
    assert max_cuda(580) == (13, 0) and max_cuda(570) == (12, 8) and max_cuda(550) == (12, 4)
    assert not parse_requirement(REQUIRE_13_1).met_by(580) and parse_requirement(REQUIRE_13_1).met_by(590)
    assert parse_requirement(REQUIRE_12_4).met_by(550) and not parse_requirement(REQUIRE_12_4).met_by(545)
    # The forward-compatibility alternative: a 535 driver starts a 13.1 image that carries cuda-compat.
    assert parse_requirement(REQUIRE_13_1).met_by(535)
    with pytest.raises(ValueError, match="cuda>>12"):
        parse_requirement("cuda>>12")
    with pytest.raises(ValueError, match="add its row"):
        max_cuda(999)


# ----------------------------------------------------------------------------- at preview, through load_settings

STACK = dedent("""\
    services:
      train:
        image: {image}
        environment: {environment}
        deploy:
          resources:
            reservations:
              devices:
                - driver: nvidia
                  count: 1
                  capabilities: [gpu]
    """)


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "stacks").mkdir()
    monkeypatch.setattr(settings.reader, "PROJECT_DIR", tmp_path)
    return tmp_path


@pytest.fixture
def said(monkeypatch):
    lines = []
    monkeypatch.setattr(pulumi.log, "warn", lambda msg, *a, **k: lines.append(msg))
    return lines


def preview(project, image, environment="{}", **overrides):
    (project / "stacks" / "train.yml").write_text(STACK.format(image=image, environment=environment))
    use_mocks(stack_config("dev", stacks=[{"name": "train", "file": "stacks/train.yml"}], **overrides),
              tuple(f"gpu-swarm:{k}" for k in overrides))
    host = image.split("/")[0]  # each test's image names its loopback registry
    image_registry.ENDPOINTS[host] = f"http://{host}"
    return load_settings()


def test_an_image_newer_than_the_driver_is_refused_with_the_numbers(project, registry, said):
    push(registry, "nvidia/cuda", "13.1.0-base", [f"NVIDIA_REQUIRE_CUDA={REQUIRE_13_1}"])
    with pytest.raises(SettingsError) as err:
        preview(project, f"{registry}/nvidia/cuda:13.1.0-base")
    (problem,) = [p for p in err.value.problems if "CUDA" in p]
    for part in ("gpu-swarm:stacks[0].file: stacks/train.yml: services.train:",
                 f"{registry}/nvidia/cuda:13.1.0-base needs CUDA 13.1", "no pool it can land on runs it",
                 "t4 (driver 580, CUDA up to 13.0)", "built for CUDA 13.0 or older", "NVIDIA_DRIVER_BRANCH"):
        assert part in problem, problem


def test_an_image_the_driver_runs_is_accepted_and_each_image_read_once(project, registry, said, monkeypatch):
    digest = push(registry, "nvidia/cuda", "12.4.1-base", [f"NVIDIA_REQUIRE_CUDA={REQUIRE_12_4}"])
    reads = []
    real = image_registry.Registry.image_config
    monkeypatch.setattr(image_registry.Registry, "image_config", lambda s, i: reads.append(i) or real(s, i))
    (stack,) = preview(project, f"{registry}/nvidia/cuda@{digest}").stacks
    assert stack.name == "train" and not said and reads == [f"{registry}/nvidia/cuda@{digest}"]


def test_nvidia_disable_require_in_the_image_or_the_service_skips_the_check(project, registry, said):
    push(registry, "nvidia/cuda", "13.1.0-compat", [f"NVIDIA_REQUIRE_CUDA={REQUIRE_13_1}", "NVIDIA_DISABLE_REQUIRE=1"])
    preview(project, f"{registry}/nvidia/cuda:13.1.0-compat")
    push(registry, "nvidia/cuda", "13.1.0-base", [f"NVIDIA_REQUIRE_CUDA={REQUIRE_13_1}"])
    preview(project, f"{registry}/nvidia/cuda:13.1.0-base", "{NVIDIA_DISABLE_REQUIRE: 'true'}")
    with pytest.raises(SettingsError, match="needs CUDA 13.1"):  # "false" keeps it, as the toolkit reads it
        preview(project, f"{registry}/nvidia/cuda:13.1.0-base", "{NVIDIA_DISABLE_REQUIRE: 'false'}")
    assert not said


def test_an_unreachable_registry_is_a_warning_and_preview_goes_on(project, registry, said):
    port = _free_port()  # nothing listens there
    (stack,) = preview(project, f"127.0.0.1:{port}/nvidia/cuda:13.1.0-base").stacks
    (warning,) = said
    assert stack.name == "train" and f"127.0.0.1:{port} did not answer" in warning and "goes on" in warning


def test_credentials_must_be_a_secret(project, registry):
    (project / "stacks" / "train.yml").write_text(STACK.format(image="ubuntu:24.04", environment="{}"))
    creds = {"nvcr.io": {"username": "$oauthtoken", "password": "nvapi-x"}}
    use_mocks(stack_config("dev", stacks=[{"name": "train", "file": "stacks/train.yml"}], registryCredentials=creds))
    with pytest.raises(SettingsError, match=r"registryCredentials: is stored in plain text; .*--secret"):
        load_settings()


def test_a_pool_on_an_older_driver_is_named_in_a_warning(project, registry, said, monkeypatch):
    # Every pool runs versions.env's branch today; the warning is for clusters whose pools differ.
    monkeypatch.setattr(cuda_checks, "pool_driver_branches", lambda pools, image: {
        **{p.name: 580 for p in pools}, "old": 570})
    push(registry, "nvidia/cuda", "12.9.1-base", ["NVIDIA_REQUIRE_CUDA=cuda>=12.9"])
    pools = [{"name": "t4", "instanceType": "g4dn.xlarge", "count": 1},
             {"name": "old", "instanceType": "g4dn.xlarge", "count": 1}]
    preview(project, f"{registry}/nvidia/cuda:12.9.1-base", gpuPools=pools)
    (warning,) = said
    assert "fail on the pools old (driver 570, CUDA up to 12.8)" in warning and "== t4" in warning


def test_the_program_refuses_at_preview_with_the_numbers(project, registry, endpoints, monkeypatch):
    """`pulumi preview` as the program runs it: nothing is registered, and the error has the numbers."""
    endpoints["docker.io"] = f"http://{registry}"
    push(registry, "nvidia/cuda", "13.1.0-runtime-ubuntu24.04", [f"NVIDIA_REQUIRE_CUDA={REQUIRE_13_1}"])
    (project / "stacks" / "train.yml").write_text(
        STACK.format(image="nvidia/cuda:13.1.0-runtime-ubuntu24.04", environment="{}"))
    config = stack_config("dev", stacks=[{"name": "train", "file": "stacks/train.yml"}])
    real_use = run_program.__globals__["use_mocks"]

    def use_then_point(*a, **k):  # conftest closes every registry; this one is ours
        monitor = real_use(*a, **k)
        image_registry.ENDPOINTS["docker.io"] = f"http://{registry}"
        return monitor

    monkeypatch.setitem(run_program.__globals__, "use_mocks", use_then_point)
    with pytest.raises(SettingsError) as err:
        run_program(config, stack="dev")
    assert "nvidia/cuda:13.1.0-runtime-ubuntu24.04 needs CUDA 13.1" in str(err.value)
    assert "t4 (driver 580, CUDA up to 13.0)" in str(err.value)
