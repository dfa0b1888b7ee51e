"""Compose GPU requests (`deploy.resources.reservations.devices`, `gpus:`) become swarm reservations at preview.

One row per rule, in both directions: what is rewritten (and into what), what is left out with
a warning, and what is refused with the key named and the fix. The example files under
stacks/examples/ are the shapes users write; their rewritten text is snapshot-tested, since
it is what `docker stack deploy` receives, and the real docker CLI must accept it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from textwrap import dedent

import pytest
import yaml

from swarm.stack_files import StackFileError, validate_stack_file

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "stacks" / "examples").glob("*.yml"))
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
KIND = "NVIDIA-GPU"
SHARED = "NVIDIA-GPU-SHARED"
ONE_SIZE = {"training": 8}
TWO_SIZES = {"training": 8, "infer": 4, "infer-b": 4}


def svc(body: str, deploy: str = "") -> str:
    """One service `train`; body and deploy are YAML at the service's and deploy's level."""
    text = "services:\n  train:\n    image: nvidia/cuda:12.6.3-base-ubuntu24.04\n"
    text += "".join(f"    {line}\n" for line in dedent(body).strip("\n").splitlines()) if body else ""
    if deploy:
        text += "    deploy:\n" + "".join(f"      {line}\n" for line in dedent(deploy).strip("\n").splitlines())
    return text


def devices(entry: str, extra_deploy: str = "") -> str:
    """A service whose deploy.resources.reservations.devices is [entry] (flow YAML)."""
    return svc("", extra_deploy + f"resources:\n  reservations:\n    devices:\n      - {entry}\n")


def check(text: str, pools=ONE_SIZE, shared: str | None = None):
    return validate_stack_file(text, kind=KIND, max_gpus_per_node=max(pools.values(), default=0),
                               shared_kind=shared, pool_sizes=pools, source="stacks/x.yml")


def reservation(info, service: str = "train") -> list:
    doc = yaml.safe_load(info.content)
    return doc["services"][service]["deploy"]["resources"]["reservations"]["generic_resources"]


def spec(value: int, kind: str = KIND) -> list:
    return [{"discrete_resource_spec": {"kind": kind, "value": value}}]


# ---------------------------------------------------------------- rewritten

REWRITTEN = [
    # (id, stack text, pools, the reservation it becomes, fragments of the rewrite notes)
    ("count-1", devices("{driver: nvidia, count: 1, capabilities: [gpu]}"), ONE_SIZE, 1, ["count 1"]),
    ("count-quoted", devices("{driver: nvidia, count: '2', capabilities: [gpu]}"), ONE_SIZE, 2, ["count 2"]),
    ("count-all", devices("{driver: nvidia, count: all, capabilities: [gpu]}"), ONE_SIZE, 8,
     ["count all (every GPU of one node: 8 (training))"]),
    ("no-count-is-all", devices("{capabilities: [gpu]}"), ONE_SIZE, 8, ["count all"]),
    ("no-driver", devices("{count: 1, capabilities: [gpu]}"), ONE_SIZE, 1, []),
    ("nvidia-capability", devices("{count: 1, capabilities: [gpu, nvidia]}"), ONE_SIZE, 1, []),
    # moby's nvidia driver takes any of its capabilities as the request for a GPU, `gpu` or not
    ("driver-capabilities-only", devices("{driver: nvidia, count: 1, capabilities: [compute, utility]}"), ONE_SIZE,
     1, ["count 1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]),
    ("driver-capability-without-driver", devices("{count: 2, capabilities: [video]}"), ONE_SIZE, 2, []),
    ("count-all-pinned-to-a-pool",
     devices("{count: all, capabilities: [gpu]}", "placement:\n  constraints: [node.labels.gpu-swarm.pool == infer]\n"),
     TWO_SIZES, 4, ["count all"]),
    ("count-all-pinned-by-gpu-count",
     devices("{count: all, capabilities: [gpu]}", "placement:\n  constraints: ['node.engine.labels.gpu.count==8']\n"),
     TWO_SIZES, 8, []),
    ("count-all-pool-excluded",
     devices("{count: all, capabilities: [gpu]}",
             "placement:\n  constraints: [node.labels.gpu-swarm.pool != training]\n"), TWO_SIZES, 4, []),
    ("gpus-all", svc("gpus: all"), ONE_SIZE, 8, ["services.train.gpus: count all"]),
    ("gpus-list", svc("gpus:\n  - driver: nvidia\n    count: 2"), ONE_SIZE, 2, ["services.train.gpus: count 2"]),
    ("gpus-list-without-count", svc("gpus: [{driver: nvidia}]"), ONE_SIZE, 8, ["count all"]),
    ("count-fits-largest", devices("{count: 8, capabilities: [gpu]}"), TWO_SIZES, 8, []),
]


@pytest.mark.parametrize("text, pools, value, notes", [r[1:] for r in REWRITTEN], ids=[r[0] for r in REWRITTEN])
def test_gpu_requests_become_a_reservation_of_the_kind(text, pools, value, notes):
    info = check(text, pools)
    assert reservation(info) == spec(value)  # kind and value nested under discrete_resource_spec
    assert "devices" not in yaml.safe_load(info.content)["services"]["train"]["deploy"]["resources"]["reservations"]
    assert "gpus" not in yaml.safe_load(info.content)["services"]["train"]
    assert info.services[0].gpus == value
    for note in notes:
        assert any(note in r for r in info.rewrites), (note, info.rewrites)
    assert info.diff.startswith("--- stacks/x.yml (as written") and "+              value: " in info.diff


def test_driver_capabilities_travel_as_nvidia_driver_capabilities():
    info = check(devices("{driver: nvidia, count: 1, capabilities: [gpu, utility, video, compute, video]}"))
    doc = yaml.safe_load(info.content)["services"]["train"]
    assert doc["environment"] == {"NVIDIA_DRIVER_CAPABILITIES": "utility,video,compute"}
    assert any("NVIDIA_DRIVER_CAPABILITIES=utility,video,compute" in r for r in info.rewrites)
    # In a list-style environment the entry is added as a list item; the service's own value wins.
    listed = check(svc("environment:\n  - A=1", "resources:\n  reservations:\n    devices:\n"
                                                "      - {count: 1, capabilities: [gpu, video]}\n"))
    assert yaml.safe_load(listed.content)["services"]["train"]["environment"] == [
        "A=1", "NVIDIA_DRIVER_CAPABILITIES=video"]
    own = check(svc("environment: {NVIDIA_DRIVER_CAPABILITIES: all}",
                    "resources:\n  reservations:\n    devices:\n      - {count: 1, capabilities: [gpu, video]}\n"))
    assert yaml.safe_load(own.content)["services"]["train"]["environment"] == {"NVIDIA_DRIVER_CAPABILITIES": "all"}


# ---------------------------------------------------------------- ignored, with a warning, and left out

IGNORED = [
    # (id, stack text, the key left out, fragments of the warning)
    ("runtime-nvidia",
     devices("{count: 1, capabilities: [gpu]}").replace("    deploy:", "    runtime: nvidia\n    deploy:"),
     ("runtime",), ["services.train.runtime: nvidia is ignored", "`docker stack deploy` refuses the key"]),
    ("visible-devices-map",
     svc("environment:\n  NVIDIA_VISIBLE_DEVICES: all\n  KEEP: '1'", "resources:\n  reservations:\n    devices:\n"
                                                                      "      - {count: 1, capabilities: [gpu]}\n"),
     ("environment", "NVIDIA_VISIBLE_DEVICES"), ["environment.NVIDIA_VISIBLE_DEVICES: ignored on gpu-swarm",
                                                 "runtime guard sets this variable"]),
    ("visible-devices-list",
     svc("environment:\n  - NVIDIA_VISIBLE_DEVICES=0,1\n  - KEEP=1", "resources:\n  reservations:\n    devices:\n"
                                                                      "      - {count: 2, capabilities: [gpu]}\n"),
     ("environment", "NVIDIA_VISIBLE_DEVICES"), ["left out of the deployed file"]),
    ("visible-devices-with-generic-resources",
     svc("environment:\n  NVIDIA_VISIBLE_DEVICES: all", "resources:\n  reservations:\n    generic_resources:\n"
         "      - discrete_resource_spec: {kind: NVIDIA-GPU, value: 1}\n"),
     ("environment", "NVIDIA_VISIBLE_DEVICES"), ["ignored on gpu-swarm"]),
    ("device-options", devices("{count: 1, capabilities: [gpu], options: {virtualization: 'false'}}"),
     ("deploy", "options"), ["devices[0].options: ignored"]),
]


@pytest.mark.parametrize("text, key, fragments", [r[1:] for r in IGNORED], ids=[r[0] for r in IGNORED])
def test_keys_gpu_swarm_ignores_are_left_out_with_the_reason(text, key, fragments):
    info = check(text)
    service = yaml.safe_load(info.content)["services"]["train"]
    if key[0] == "environment":
        env = service["environment"]
        assert not any(str(e).startswith(key[1]) for e in env), env
        assert any(str(e).startswith("KEEP") for e in env) or len(env) == 0
    elif key[0] == "deploy":
        assert key[1] not in str(service["deploy"])
    else:
        assert key[0] not in service
    for fragment in fragments:
        assert any(fragment in w for w in info.warnings), (fragment, info.warnings)


# ---------------------------------------------------------------- refused, naming the key and the fix

REFUSED = [
    # (id, stack text, pools, fragments of the one problem)
    ("driver-amd", devices("{driver: amd, count: 1, capabilities: [gpu]}"), ONE_SIZE,
     ["reservations.devices[0].driver: is 'amd'", "NVIDIA GPUs only", "driver: nvidia"]),
    ("capabilities-empty", devices("{driver: nvidia, count: 1, capabilities: []}"), ONE_SIZE,
     ["devices[0].capabilities: [] does not ask for a GPU", "add `gpu`"]),
    ("capabilities-missing", devices("{driver: nvidia, count: 1}"), ONE_SIZE,
     ["devices[0].capabilities: missing", "[gpu]"]),
    ("capability-unknown", devices("{count: 1, capabilities: [gpu, tpu]}"), ONE_SIZE,
     ["'tpu' is not a capability of NVIDIA's driver"]),
    ("device-ids", devices("{driver: nvidia, device_ids: ['0', '3'], capabilities: [gpu]}"), ONE_SIZE,
     ["devices[0].device_ids: swarm cannot pin devices", "the scheduler picks which GPUs", "`count: 2`",
      "node.engine.labels.gpu.product == NVIDIA-H100-80GB-HBM3", "gpu.memory", "node.labels.gpu-swarm.pool"]),
    ("device-ids-in-gpus", svc("gpus:\n  - device_ids: [GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cfb]"), ONE_SIZE,
     ["services.train.gpus[0].device_ids: swarm cannot pin devices", "`count: 1`"]),
    # docker joins the ids into NVIDIA_VISIBLE_DEVICES: one text of four ids is four GPUs
    ("device-ids-joined", devices("{driver: nvidia, device_ids: ['0,1,2,3'], capabilities: [gpu]}"), ONE_SIZE,
     ["devices[0].device_ids: swarm cannot pin devices", "`count: 4`"]),
    ("device-ids-all", devices("{driver: nvidia, device_ids: [all], capabilities: [gpu]}"), ONE_SIZE,
     ["`count: all`"]),
    ("device-ids-cdi", devices("{driver: cdi, device_ids: ['nvidia.com/gpu=0', 'nvidia.com/gpu=1']}"), ONE_SIZE,
     ["`count: 2`"]),
    ("count-zero", devices("{count: 0, capabilities: [gpu]}"), ONE_SIZE,
     ["devices[0].count: expected a whole number of GPUs >= 1, or `all`, got 0"]),
    ("count-text", devices("{count: some, capabilities: [gpu]}"), ONE_SIZE, ["got 'some'"]),
    ("count-too-large", devices("{count: 9, capabilities: [gpu]}"), TWO_SIZES,
     ["devices[0].count: 9 GPUs per task, but the largest node has 8", "8 (training), 4 (infer, infer-b)",
      "Pending forever"]),
    ("count-all-ambiguous", devices("{count: all, capabilities: [gpu]}"), TWO_SIZES,
     ["devices[0].count: `all` means every GPU of the node", "8 (training), 4 (infer, infer-b) GPUs",
      "count: 8", "node.labels.gpu-swarm.pool == training"]),
    ("gpus-all-ambiguous", svc("gpus: all"), TWO_SIZES, ["services.train.gpus: `all` means every GPU"]),
    ("count-all-constrained-away",
     devices("{count: all, capabilities: [gpu]}", "placement:\n  constraints: [node.labels.gpu-swarm.pool == cpu]\n"),
     TWO_SIZES, ["constraints leave no node with whole GPUs"]),
    ("only-shared-pools", devices("{count: 1, capabilities: [gpu]}"), {}, ["no node offers whole GPUs",
                                                                          "every pool shares its GPUs"]),
    ("devices-and-gpus",
     devices("{count: 1, capabilities: [gpu]}").replace("    deploy:", "    gpus: all\n    deploy:"),
     ONE_SIZE, ["services.train: asks for GPUs twice", "keep one"]),
    ("two-requests", svc("", "resources:\n  reservations:\n    devices:\n      - {count: 1, capabilities: [gpu]}\n"
                             "      - {count: 1, capabilities: [gpu]}\n"), ONE_SIZE,
     ["devices[1]: one GPU request per service", "total count"]),
    ("devices-and-generic-resources",
     svc("", "resources:\n  reservations:\n    devices: [{count: 1, capabilities: [gpu]}]\n    generic_resources:\n"
             "      - discrete_resource_spec: {kind: NVIDIA-GPU, value: 1}\n"), ONE_SIZE,
     ["also reserves NVIDIA-GPU under generic_resources"]),
    ("devices-not-a-list", svc("", "resources:\n  reservations:\n    devices: {count: 1}\n"), ONE_SIZE,
     ["reservations.devices: expected a list of device requests"]),
    ("device-not-a-mapping", devices("gpu"), ONE_SIZE, ["devices[0]: expected a mapping"]),
    ("device-unknown-key", devices("{count: 1, capabilities: [gpu], gpu_count: 2}"), ONE_SIZE,
     ["devices[0].gpu_count: not a key of a device request"]),
    ("gpus-number", svc("gpus: 2"), ONE_SIZE, ["services.train.gpus: expected `all` or a list", "got 2"]),
    ("runtime-other", svc("runtime: runsc"), ONE_SIZE, ["services.train.runtime: swarm services cannot choose",
                                                        "'runsc'"]),
    ("runtime-nvidia-alone", svc("runtime: nvidia"), ONE_SIZE,
     ["services.train.runtime: nvidia, but the service reserves no GPU", "count: 1", "remove `runtime`"]),
    ("visible-devices-alone", svc("environment:\n  NVIDIA_VISIBLE_DEVICES: all"), ONE_SIZE,
     ["environment.NVIDIA_VISIBLE_DEVICES: all asks for GPUs, but the service reserves none"]),
    ("visible-devices-from-shell", svc("environment:\n  - NVIDIA_VISIBLE_DEVICES"), ONE_SIZE,
     ["NVIDIA_VISIBLE_DEVICES: (from the shell) asks for GPUs"]),
    ("swarm-variable", devices("{count: 1, capabilities: [gpu]}").replace(
        "    deploy:",
        "    environment:\n      DOCKER_RESOURCE_NVIDIA-GPU: GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cfb\n    deploy:"),
     ONE_SIZE, ["sets DOCKER_RESOURCE_NVIDIA-GPU, the variable swarm itself sets"]),
]


@pytest.mark.parametrize("text, pools, fragments", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_requests_swarm_cannot_honour_are_refused_with_the_fix(text, pools, fragments):
    with pytest.raises(StackFileError) as err:
        check(text, pools, shared=SHARED if not pools else None)
    assert len(err.value.problems) == 1, err.value.problems
    for fragment in fragments:
        assert fragment in err.value.problems[0], f"{fragment!r} not in:\n{err.value.problems[0]}"


def test_only_shared_pools_point_to_a_slot():
    with pytest.raises(StackFileError, match="reserve one slot of a shared GPU instead .*kind NVIDIA-GPU-SHARED"):
        check(svc("gpus: all"), {}, shared=SHARED)


def test_void_visible_devices_without_a_request_asks_for_none_and_stays():
    text = svc("environment:\n  NVIDIA_VISIBLE_DEVICES: void")
    info = check(text)
    assert info.content is text and not info.warnings and not info.rewrites


# ---------------------------------------------------------------- the deployed text

def test_a_file_without_compose_requests_is_deployed_byte_for_byte():
    text = (REPO / "stacks" / "gpu-smoke.yml").read_text()
    info = check(text)
    assert info.content == text and info.diff == "" and info.rewrites == ()


def test_values_reach_swarm_as_written():
    """docker's loader reads 1e3 as 1000 and 0755 as 493; a load-and-dump round trip would quote them."""
    text = dedent("""\
        x-common: &common
          environment:
            RATE: 1e3
            MODE: 0755
            NAME: "quoted"
          labels: {team: ml}
        services:
          train:
            <<: *common
            image: x
            command: |
              python train.py \\
                --epochs 3
            gpus: all
          web:
            <<: *common
            image: nginx:1.27
        """)
    info = check(text)
    assert "RATE: 1e3\n" in info.content and "MODE: 0755\n" in info.content and 'NAME: "quoted"' in info.content
    assert "command: |\n" in info.content
    before, after = yaml.safe_load(text), yaml.safe_load(info.content)
    del before["services"]["train"]["gpus"]
    assert after["services"]["train"].pop("deploy") == {"resources": {"reservations": {"generic_resources": spec(8)}}}
    assert after == before  # nothing else changed, and `web`, which shares the anchor, reserves nothing


def test_an_aliased_service_is_rewritten_on_its_own():
    text = "services:\n  a: &a\n    image: x\n    gpus: all\n  b: *a\n"
    info = check(text)
    doc = yaml.safe_load(info.content)
    assert reservation(info, "a") == reservation(info, "b") == spec(8)
    assert "gpus" not in doc["services"]["a"] and "gpus" not in doc["services"]["b"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_stacks_rewrite_to_their_snapshot(path):
    """What `docker stack deploy` gets for each example, as a reviewable file. UPDATE_SNAPSHOTS=1 rewrites them."""
    info = check(path.read_text())
    snapshot = SNAPSHOTS / f"compose-{path.stem}.yml"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        snapshot.write_text(info.content)
    assert snapshot.exists(), f"no snapshot {snapshot.name}: run UPDATE_SNAPSHOTS=1 pytest {__file__}"
    assert info.content == snapshot.read_text()
    assert info.rewrites and info.diff


def test_the_rewrite_is_the_same_bytes_in_another_process():
    """Another interpreter with another hash seed: set and dict order must not leak into the text."""
    code = ("import hashlib, sys; sys.path.insert(0, sys.argv[1]); from swarm.stack_files import validate_stack_file; "
            "print(*(hashlib.sha256(validate_stack_file(open(p).read(), kind='NVIDIA-GPU', max_gpus_per_node=8, "
            "pool_sizes={'training': 8}, source='stacks/x.yml').content.encode()).hexdigest() for p in sys.argv[2:]))")
    runs = {subprocess.run([sys.executable, "-c", code, str(REPO), *map(str, EXAMPLES)], capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2", "3")}
    here = " ".join(__import__("hashlib").sha256(check(p.read_text()).content.encode()).hexdigest() for p in EXAMPLES)
    assert runs == {here + "\n"}


def _docker_cli() -> str:
    from tests.rehearsal_tools import require_engine
    return require_engine().docker


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_docker_cli_refuses_the_example_and_accepts_its_rewrite(path):
    """The real `docker stack config` (the loader `docker stack deploy` uses), no swarm needed."""
    docker = _docker_cli()

    def load(text: str) -> subprocess.CompletedProcess:
        return subprocess.run([docker, "stack", "config", "-c", "-"], input=text, capture_output=True, text=True,
                              env={**os.environ, "HF_TOKEN": "hf_x"})

    refused = load(path.read_text())
    assert refused.returncode != 0 and "is not allowed" in refused.stderr, refused.stderr
    accepted = load(check(path.read_text()).content)
    assert accepted.returncode == 0, accepted.stderr
    assert f"kind: {KIND}" in accepted.stdout


# ---------------------------------------------------------------- through the program, at preview

def test_the_program_deploys_the_rewrite_shows_it_at_preview_and_a_second_up_changes_nothing(monkeypatch):
    import hashlib

    import pulumi

    from tests.conftest import request_inputs, run_program, stack_config, unwrap
    from tests.test_plan import plan

    said = []
    monkeypatch.setattr(pulumi.log, "info", lambda msg, resource=None, *a, **k: said.append(("info", msg)))
    monkeypatch.setattr(pulumi.log, "warn", lambda msg, resource=None, *a, **k: said.append(("warn", msg)))
    config = stack_config("prod", stacks=[{"name": "vllm", "file": "stacks/examples/vllm.yml"}])
    run = run_program(config, stack="prod")

    # prod's whole-GPU pool is `training` (p5.48xlarge, 8 GPUs); `inference` shares its GPUs.
    expected = validate_stack_file((REPO / "stacks" / "examples" / "vllm.yml").read_text(), kind=KIND,
                                   max_gpus_per_node=8, shared_kind=SHARED, pool_sizes={"training": 8},
                                   source="stacks/examples/vllm.yml")
    sha = hashlib.sha256(expected.content.encode()).hexdigest()
    deploy = unwrap(request_inputs(run.monitor.requests["gpu-swarm-stack-vllm-deploy"]))
    assert deploy["stdin"] == expected.content and sha[:16] in deploy["create"]
    assert "devices" not in deploy["stdin"] and "runtime" not in deploy["stdin"]
    assert run.exports["stacks"] == {"vllm": {"file": "stacks/examples/vllm.yml", "sha256": sha,
                                              "rewrites": list(expected.rewrites),
                                              "warnings": list(expected.warnings)}}
    infos = [m for kind, m in said if kind == "info" and m.startswith("stack vllm:")]
    assert len(infos) == 1 and expected.diff in infos[0] and "value: 2" in infos[0]
    assert [m for kind, m in said if kind == "warn" and m.startswith("stack vllm:")] == [
        f"stack vllm: {w}" for w in expected.warnings]
    assert (REPO / "stacks" / "examples" / "vllm.yml").read_text().count("runtime: nvidia") == 1  # untouched

    assert plan(config, config, stack="prod").changed() == set()


def test_count_all_over_pools_of_two_sizes_is_refused_at_preview_with_the_sizes():
    from settings import SettingsError, load_settings
    from tests.conftest import stack_config, use_mocks

    use_mocks(stack_config("dev", gpuPools=[{"name": "t4", "instanceType": "g4dn.xlarge", "count": 1},
                                            {"name": "quad", "instanceType": "g4dn.12xlarge", "count": 1}],
                           stacks=[{"name": "train", "file": "stacks/examples/pytorch-ddp.yml"}]))
    with pytest.raises(SettingsError) as err:
        load_settings()
    (problem,) = err.value.problems
    assert problem.startswith("gpu-swarm:stacks[0].file: stacks/examples/pytorch-ddp.yml: services.trainer.deploy."
                              "resources.reservations.devices[0].count: `all` means every GPU")
    assert "4 (quad), 1 (t4) GPUs" in problem and "node.labels.gpu-swarm.pool == quad" in problem
