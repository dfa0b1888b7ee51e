"""Stack files that would mis-schedule GPUs are refused at preview, with the fix in the message."""
from pathlib import Path
from textwrap import dedent

import re

import pytest

from swarm.stack_files import StackFileError, validate_stack_file

KIND = "NVIDIA-GPU"
REPO = Path(__file__).resolve().parent.parent


def service(deploy: str = "", extra: str = "", image: str = "nvidia/cuda:12.6.3-base-ubuntu24.04") -> str:
    """A one-service stack; `deploy` and `extra` are YAML indented for the service level."""
    text = f"services:\n  train:\n    image: {image}\n"
    if extra:
        text += "".join(f"    {line}\n" for line in dedent(extra).strip("\n").splitlines())
    if deploy:
        text += "    deploy:\n" + "".join(f"      {line}\n" for line in dedent(deploy).strip("\n").splitlines())
    return text


def gpu_reservation(kind: str = KIND, value="1") -> str:
    return dedent(f"""\
        resources:
          reservations:
            generic_resources:
              - discrete_resource_spec:
                  kind: "{kind}"
                  value: {value}
        """)


MISINDENTED = """
    resources:
      reservations:
        generic_resources:
          - discrete_resource_spec:
            kind: "NVIDIA-GPU"
            value: 1
"""

BAD = [
    # (id, stack text, max GPUs per node, fragments the message must contain)
    ("bad-yaml", "services:\n  a: [unclosed\n", 8, ["not valid YAML"]),
    ("not-a-mapping", "- just\n- a list\n", 8, ["top-level `services:`"]),
    ("no-services", "version: '3.8'\n", 8, ["has no services"]),
    ("empty-services", "services: {}\n", 8, ["has no services"]),
    ("service-not-mapping", "services:\n  a: nginx\n", 8, ["services.a: must be a mapping"]),
    ("no-image", "services:\n  a:\n    command: ['true']\n", 8, ["has no `image`", "cannot build"]),
    (
        "misindented",
        service(MISINDENTED),
        8,
        ["beside `discrete_resource_spec`", "Indent them under it", "- discrete_resource_spec:\n                kind: \"NVIDIA-GPU\""],
    ),
    ("null-spec", service("resources:\n  reservations:\n    generic_resources:\n      - discrete_resource_spec:\n"), 8, ["needs `discrete_resource_spec:`"]),
    ("wrong-kind", service(gpu_reservation(kind="gpu")), 8, ["is 'gpu'", "advertise 'NVIDIA-GPU'", "gpu-swarm:gpuKind"]),
    ("value-too-large", service(gpu_reservation(value="4")), 2, ["4 GPUs per replica", "has 2 per node", "Pending"]),
    ("value-zero", service(gpu_reservation(value="0")), 8, ["whole number of GPUs >= 1, got 0"]),
    ("value-negative", service(gpu_reservation(value="-1")), 8, ["got -1"]),
    ("value-float", service(gpu_reservation(value="1.5")), 8, ["got 1.5"]),
    ("value-text", service(gpu_reservation(value="all")), 8, ["got 'all'"]),
    ("value-bool", service(gpu_reservation(value="true")), 8, ["got True"]),
    (
        "named-resource",
        service("resources:\n  reservations:\n    generic_resources:\n      - named_resource_spec:\n          kind: NVIDIA-GPU\n          value: GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cfb\n"),
        8,
        ["named_resource_spec", "reserves a count", "discrete_resource_spec"],
    ),
    ("generic-not-list", service("resources:\n  reservations:\n    generic_resources:\n      kind: NVIDIA-GPU\n"), 8, ["must be a list"]),
    (
        "reserved-twice",
        service(gpu_reservation() + "      - discrete_resource_spec:\n          kind: NVIDIA-GPU\n          value: 1\n"),
        8,
        ["reserved twice"],
    ),
    # Compose GPU requests and the old nvidia-docker keys: tests/test_compose_gpus.py has every rule.
    ("visible-devices-list", service(extra="environment:\n  - NVIDIA_VISIBLE_DEVICES=0,1\n"), 8,
     ["NVIDIA_VISIBLE_DEVICES: 0,1 asks for GPUs", "reserves none"]),
    ("runtime-key", service(extra="runtime: nvidia\n"), 8, ["cannot choose a runtime", "reserves no GPU"]),
    ("bad-replicas", service("replicas: two\n"), 8, ["deploy.replicas", "got 'two'"]),
    ("env-file", service(extra="env_file: .env\n"), 8, ["services.train.env_file", "under `environment:`"]),
    (
        "config-from-file",
        service() + "configs:\n  app:\n    file: ./app.toml\n",
        8,
        ["configs.app.file", "'./app.toml' would be missing", "external: true"],
    ),
    ("secret-from-file", service() + "secrets:\n  token:\n    file: token.txt\n", 8, ["secrets.token.file", "docker secret create token"]),
]


@pytest.mark.parametrize("text,max_gpus,fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_stack_files_are_refused_with_the_fix(text, max_gpus, fragments):
    with pytest.raises(StackFileError) as err:
        validate_stack_file(text, kind=KIND, max_gpus_per_node=max_gpus, source="stacks/x.yml")
    message = str(err.value)
    assert message.startswith("stacks/x.yml: ")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_all_problems_are_listed_at_once():
    text = service(gpu_reservation(kind="gpu"), extra="runtime: nvidia\n", image="''")
    with pytest.raises(StackFileError) as err:
        validate_stack_file(text, kind=KIND, max_gpus_per_node=1)
    assert len(err.value.problems) == 3


GOOD = [
    ("one-gpu", service("replicas: 3\n" + gpu_reservation()), [("train", 3, 1)]),
    ("quoted-value", service(gpu_reservation(value='"2"')), [("train", 1, 2)]),
    ("cpu-only", "services:\n  web:\n    image: nginx:1.27\n", [("web", 1, 0)]),
    ("global", service("mode: global\n" + gpu_reservation()), [("train", None, 1)]),
    ("visible-devices-void", service(extra="environment:\n  NVIDIA_VISIBLE_DEVICES: void\n"), [("train", 1, 0)]),
    ("other-env", service(gpu_reservation(), extra="environment:\n  - CUDA_MODULE_LOADING=LAZY\n"), [("train", 1, 1)]),
    ("external-config", service() + "configs:\n  app:\n    external: true\n", [("train", 1, 0)]),
]


@pytest.mark.parametrize("text,expected", [g[1:] for g in GOOD], ids=[g[0] for g in GOOD])
def test_good_stack_files_report_their_services(text, expected):
    info = validate_stack_file(text, kind=KIND, max_gpus_per_node=2)
    assert [(s.name, s.replicas, s.gpus) for s in info.services] == expected


def test_the_shipped_smoke_stack_passes():
    path = REPO / "stacks" / "gpu-smoke.yml"
    info = validate_stack_file(path.read_text(), kind=KIND, max_gpus_per_node=1, source=str(path))
    (gpu,) = info.gpu_services
    assert gpu.image.startswith("nvidia/cuda:") and gpu.gpus == 1 and gpu.replicas == 2


def test_kind_comes_from_the_caller():
    text = service(gpu_reservation(kind="AMD-GPU"))
    assert validate_stack_file(text, kind="AMD-GPU", max_gpus_per_node=1).services[0].gpus == 1
    with pytest.raises(StackFileError):
        validate_stack_file(text, kind=KIND, max_gpus_per_node=1)


# --- shared GPUs and the swarm's own variable ------------------------------------------


def reserving(kind: str, value) -> str:
    return (f"services:\n  infer:\n    image: x\n    deploy:\n      resources:\n        reservations:\n"
            f"          generic_resources:\n            - discrete_resource_spec:\n"
            f"                kind: {kind}\n                value: {value}\n")


@pytest.mark.parametrize("text, whole_max, message", [  # noqa: E501
    (reserving("NVIDIA-GPU-SHARED", 2), 8, "2 slots of NVIDIA-GPU-SHARED per replica; reserve 1"),
    (reserving("NVIDIA-GPU", 1), 0, "every pool shares its GPUs"),
    (reserving("OTHER", 1), 8, "advertise 'NVIDIA-GPU' (gpu-swarm:gpuKind) and 'NVIDIA-GPU-SHARED'"),
    (reserving("NVIDIA-GPU", 1).replace("                value: 1\n",
                                        "                value: 1\n            - discrete_resource_spec:\n"
                                        "                kind: NVIDIA-GPU-SHARED\n                value: 1\n"),
     8, "whole GPUs or one slot of a shared GPU, not both"),
])
def test_shared_reservations_are_checked(text, whole_max, message):
    with pytest.raises(StackFileError, match=re.escape(message)):
        validate_stack_file(text, kind="NVIDIA-GPU", max_gpus_per_node=whole_max, shared_kind="NVIDIA-GPU-SHARED")


def test_a_shared_kind_no_pool_advertises_is_refused():
    with pytest.raises(StackFileError, match=re.escape("advertise 'NVIDIA-GPU' (gpu-swarm:gpuKind);")):
        validate_stack_file(reserving("NVIDIA-GPU-SHARED", 1), kind="NVIDIA-GPU", max_gpus_per_node=8)


def test_one_slot_is_a_gpu_service():
    info = validate_stack_file(reserving("NVIDIA-GPU-SHARED", 1), kind="NVIDIA-GPU", max_gpus_per_node=0,
                               shared_kind="NVIDIA-GPU-SHARED")
    (service,) = info.gpu_services
    assert (service.gpus, service.slots) == (0, 1)


@pytest.mark.parametrize("environment", [
    "      DOCKER_RESOURCE_NVIDIA-GPU: GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cfb\n",
    "      - DOCKER_RESOURCE_NVIDIA-GPU-SHARED=x\n",
])
def test_the_swarms_own_gpu_variable_is_refused_in_a_service(environment):
    text = f"services:\n  x:\n    image: x\n    environment:\n{environment}"
    with pytest.raises(StackFileError, match="the variable swarm itself sets"):
        validate_stack_file(text, kind="NVIDIA-GPU", max_gpus_per_node=8)
