"""localswarm/registry.py's push of the stand-in under Docker Hub names, through the Registry HTTP API v2,
against a real docker-registry on loopback (no engine on the host)."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import socket
import tarfile
import urllib.request

import pytest

from localswarm import registry
from localswarm.host import RehearsalError
from tests.tools import docker_registry


@pytest.fixture
def hub(tmp_path):
    """A docker-registry on 127.0.0.1, storing under tmp_path."""
    with docker_registry(tmp_path) as address:
        yield address


def fetch(address: str, path: str, accept: str = "*/*") -> bytes:
    request = urllib.request.Request(f"http://{address}/v2/{path}", headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read()


@pytest.mark.parametrize("name, repository", [
    ("nvidia/cuda:12.6.3-base-ubuntu24.04", ("nvidia/cuda", "12.6.3-base-ubuntu24.04")),
    ("busybox", ("library/busybox", "latest")),
    ("docker.io/library/ubuntu:24.04", ("library/ubuntu", "24.04")),
    ("pytorch/pytorch", ("pytorch/pytorch", "latest")),
])
def test_docker_hub_names_become_the_repositories_a_mirror_is_asked_for(name, repository):
    assert registry.hub_repository(name) == repository


@pytest.mark.parametrize("name", ["ghcr.io/org/app:1", "localhost:5000/app", "nvcr.io/nvidia/pytorch:24.01",
                                  "nvidia/cuda@sha256:" + "0" * 64])
def test_names_a_mirror_cannot_serve_are_refused(name):
    with pytest.raises(RehearsalError):
        registry.hub_repository(name)


def test_pushed_image_is_the_stand_in_under_each_name(hub):
    pushed = registry.push_standin_as(["nvidia/cuda:12.6.3-base-ubuntu24.04", "busybox"], registry=hub)
    assert pushed == ["nvidia/cuda:12.6.3-base-ubuntu24.04", "library/busybox:latest"]
    manifest = json.loads(fetch(hub, "nvidia/cuda/manifests/12.6.3-base-ubuntu24.04", registry.MANIFEST_V2))
    assert manifest["mediaType"] == registry.MANIFEST_V2
    config = fetch(hub, f"nvidia/cuda/blobs/{manifest['config']['digest']}")
    assert "sha256:" + hashlib.sha256(config).hexdigest() == manifest["config"]["digest"]
    config = json.loads(config)
    assert "NVIDIA_VISIBLE_DEVICES=all" in config["config"]["Env"]  # as every nvidia/cuda image says
    assert "NVIDIA_REQUIRE_CUDA=cuda>=12.6" in config["config"]["Env"]  # as nvidia/cuda:12.6.3-* says
    assert config["config"]["Cmd"] == registry.STANDIN_CMD
    layer = fetch(hub, f"nvidia/cuda/blobs/{manifest['layers'][0]['digest']}")
    tar = gzip.decompress(layer)
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(tar).hexdigest()]
    names = tarfile.open(fileobj=io.BytesIO(tar)).getnames()
    assert {"bin/busybox", "usr/bin/nvidia-smi", "usr/bin/gpu-standin", "bin/sh"} <= set(names)
    busybox = json.loads(fetch(hub, "library/busybox/manifests/latest", registry.MANIFEST_V2))
    assert busybox["layers"] == manifest["layers"]  # the same stand-in, without nvidia/cuda's requirement
    busybox_env = json.loads(fetch(hub, f"library/busybox/blobs/{busybox['config']['digest']}"))["config"]["Env"]
    assert busybox_env == registry.STANDIN_ENV
    # A second push finds its blobs there and only puts the manifest again.
    assert registry.push_standin_as(["nvidia/cuda:12.6.3-base-ubuntu24.04"], registry=hub) == [pushed[0]]


def test_an_unreachable_registry_is_named(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RehearsalError, match="does not answer"):
        registry.push_standin_as(["busybox"], registry=f"127.0.0.1:{port}")
