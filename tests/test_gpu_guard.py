"""The runtime guard (node/gpu-swarm-runtime + node/gpu_guard.py) on real OCI bundle files, in real sh.

The delegate runtime is a script that records the arguments and config.json it was
handed, exit codes included; the guard's decisions are also checked one by one.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import require_tool

REPO = Path(__file__).resolve().parent.parent
FRONT = REPO / "node" / "gpu-swarm-runtime"
sys.path.insert(0, str(REPO / "node"))
import gpu_guard  # noqa: E402  (as on a node: its one sibling, guard_files, beside it)
import guard_files  # noqa: E402

A = "GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cfb"
B = "GPU-558ebd1d-bf3c-6536-ecae-e740b71254de"
SETTINGS = {"DELEGATE": "/usr/bin/nvidia-container-runtime", "KIND": "NVIDIA-GPU", "SHARED_KIND": "NVIDIA-GPU-SHARED",
            "SLOTS_PER_GPU": "4", "GPUS": f"{A},{B}", "ALLOW_DOCKER_RUN_GPUS": "true"}
CUDA_IMAGE_ENV = ["PATH=/usr/local/nvidia/bin:/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=all",
                  "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]


def spec(*env: str, hooks=None, annotations=None) -> dict:
    """A bundle's config.json as dockerd writes it (trimmed)."""
    out = {"ociVersion": "1.1.0", "process": {"args": ["sleep", "infinity"], "env": list(env), "cwd": "/"},
           "root": {"path": "/var/lib/docker/overlay2/x/merged"}, "linux": {"namespaces": []}}
    if hooks:
        out["hooks"] = hooks
    if annotations:
        out["annotations"] = annotations
    return out


def env_of(s: dict) -> dict:
    return dict(e.split("=", 1) for e in s["process"]["env"])


def decide(s: dict, **settings) -> dict:
    return gpu_guard.guard(copy.deepcopy(s), {**SETTINGS, **settings}).spec


def test_a_task_that_reserved_nothing_gets_no_gpu_whatever_its_image_says():
    env = env_of(decide(spec(*CUDA_IMAGE_ENV)))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"  # the rest is left alone


def test_a_task_gets_exactly_the_gpus_swarm_assigned():
    whole = {"SHARED_KIND": "", "SLOTS_PER_GPU": "0"}  # a pool that does not share
    env = env_of(decide(spec(*CUDA_IMAGE_ENV, f"DOCKER_RESOURCE_NVIDIA-GPU={A}"), **whole))
    assert env["NVIDIA_VISIBLE_DEVICES"] == A and env["DOCKER_RESOURCE_NVIDIA-GPU"] == A
    decision = gpu_guard.guard(spec(f"DOCKER_RESOURCE_NVIDIA-GPU={A},{B}", "NVIDIA_VISIBLE_DEVICES=all"),
                               {**SETTINGS, **whole})
    assert env_of(decision.spec)["NVIDIA_VISIBLE_DEVICES"] == f"{A},{B}"
    assert decision.claims == [A, B] and decision.mps_gpu is None  # what the ledger records


def test_on_a_node_that_shares_its_gpus_a_whole_gpu_variable_is_refused():
    """Such a pool advertises slots only, so swarm never sets the whole-GPU variable there."""
    with pytest.raises(gpu_guard.Refused, match="this node shares its GPUs"):
        decide(spec(f"DOCKER_RESOURCE_NVIDIA-GPU={A}"))


def test_a_slot_the_node_does_not_advertise_is_refused():
    with pytest.raises(gpu_guard.Refused, match="not a slot of a GPU of this node"):
        decide(spec(f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={A}-s4"))  # slots s0..s3
    assert gpu_guard.guard(spec(f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={A}-s3"), SETTINGS).claims == [f"{A}-s3"]


UUIDS = [A, A.upper().replace("GPU-", "GPU-"), "MIG-" + A[4:], "MIG-GPU-" + A[4:] + "/1/0", "GPU-" + A[4:-1],
         A + "0", "GPU-" + A[4:].replace("-", "", 1) + "-", "gpu-" + A[4:], "MIG-GPU-" + A[4:] + "/1", "MIG-GPU-" +
         A[4:] + "/x/0", A.replace("a", "g"), A + "\n", "GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cf\u0661", "", "all",
         "GPU-be74ca1f", "MIG-GPU-" + A[4:] + "/\u0661/0"]


@pytest.mark.parametrize("value", UUIDS)
def test_the_guard_reads_uuids_and_slots_as_the_rest_of_the_project_does(value):
    """The guard checks them by hand (no re at every container start); gpu_resources holds the rule."""
    import gpu_resources
    assert gpu_guard.is_uuid(value) == bool(gpu_resources.UUID_RE.fullmatch(value))
    for slot in (f"{value}-s2", f"{value}-s", f"{value}-s\u0662", f"{value}-s12"):
        match = gpu_resources.SLOT_RE.fullmatch(slot)
        assert gpu_guard.slot_of(slot) == ((match["gpu"], int(match["slot"])) if match else None)


def test_config_json_is_read_and_written_as_the_json_package_would():
    """Without `import json`: its import costs more than the rest of a create (see the module's docstring)."""
    import json
    loads, dumps = guard_files.codec()
    assert loads is not json.loads  # the C codec is there, on the Pythons we run on
    text = json.dumps({"process": {"env": ["A=\u00e9", "B=<&>\\\""], "args": [], "n": -1.5e300, "t": True, "z": None},
                       "linux": {"uidMappings": [], "x": 10 ** 20}})
    assert loads(text) == json.loads(text) and dumps(loads(text)) == json.dumps(json.loads(text))
    assert loads(" \n" + text + "\n") == json.loads(text)
    for bad in ("", "{", "{} {}", '{"a": 01}', "[1,]"):
        with pytest.raises(ValueError):
            loads(bad)


def test_without_the_c_codec_the_json_package_does_the_same(monkeypatch):
    import json
    monkeypatch.setitem(sys.modules, "_json", None)
    assert guard_files.codec() == (json.loads, json.dumps)


@pytest.mark.parametrize("value, message", [
    ("all", "is not a GPU swarm assigned"),
    ("0", "is not a GPU swarm assigned"),
    ("GPU-be74ca1f", "is not a GPU swarm assigned"),  # the truncated UUIDs of old guides
    ("GPU-00000000-0000-0000-0000-000000000000", "which this node does not have"),
])
def test_a_gpu_variable_swarm_did_not_set_is_refused(value, message):
    with pytest.raises(gpu_guard.Refused, match=message):
        decide(spec(f"DOCKER_RESOURCE_NVIDIA-GPU={value}"), SHARED_KIND="", SLOTS_PER_GPU="0")


@pytest.mark.parametrize("variable", ["DOCKER_RESOURCE_NVIDIA-GPU", "DOCKER_RESOURCE_NVIDIA-GPU-SHARED"])
def test_a_swarm_variable_the_service_also_set_is_refused(variable):
    value = A if variable.endswith("GPU") else f"{A}-s0"
    # The service's own entry comes first, swarm's last (as dockerd builds the environment).
    with pytest.raises(gpu_guard.Refused, match="set by the service as well as by swarm"):
        decide(spec(f"{variable}={value}", f"{variable}={value}"))


def test_cdi_annotations_cannot_bring_gpus_past_the_guard():
    out = decide(spec(annotations={"cdi.k8s.io/x": "nvidia.com/gpu=all", "org.opencontainers.image.title": "x"}))
    assert out["annotations"] == {"org.opencontainers.image.title": "x"}
    assert env_of(out)["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_docker_run_gpus_passes_as_the_administrator_asked_unless_refused():
    hook = {"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["nvidia-container-runtime-hook",
                                                                                       "prestart"]}]}
    asked = spec("NVIDIA_VISIBLE_DEVICES=all", hooks=hook)
    assert decide(asked) == asked
    assert env_of(decide(asked, ALLOW_DOCKER_RUN_GPUS="false"))["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_a_slot_of_a_shared_gpu_becomes_that_gpu_with_its_share():
    out = decide(spec(*CUDA_IMAGE_ENV, f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={B}-s3"))
    env = env_of(out)
    assert env["NVIDIA_VISIBLE_DEVICES"] == B and env["DOCKER_RESOURCE_NVIDIA-GPU"] == B
    assert (env["GPU_SWARM_GPU"], env["GPU_SWARM_SLOT"], env["GPU_SWARM_SHARE"]) == (B, f"{B}-s3", "1/4")
    assert not [k for k in env if k.startswith("CUDA_MPS_")] and "mounts" not in out  # time-slicing: no MPS


# ---------------------------------------------------------------- MPS pools

MPS = {"SHARING": "mps", "MPS_DIR": "/run/gpu-swarm/mps", "MPS_MEMORY_MIB": "19968", "MPS_THREAD_PERCENT": "25"}
PIPE = f"/run/gpu-swarm/mps/{B}/pipe"


def test_an_mps_slot_gets_its_gpus_daemon_and_its_share_of_memory_and_threads():
    decision = gpu_guard.guard(spec(*CUDA_IMAGE_ENV, f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={B}-s2"), {**SETTINGS, **MPS})
    env = env_of(decision.spec)
    assert env["NVIDIA_VISIBLE_DEVICES"] == B and decision.mps_gpu == B and decision.claims == [f"{B}-s2"]
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == PIPE
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=19968M"  # device 0: the one GPU the task sees
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    (mount,) = decision.spec["mounts"]
    # where the task looks for its pipe: the relay's folder (mps_relay.py), read-only, never the daemon's pipe
    assert mount["destination"] == PIPE and mount["source"] == f"/run/gpu-swarm/mps/{B}/tasks"
    assert "ro" in mount["options"] and "rw" not in mount["options"]
    again = gpu_guard.guard(decision.spec, {**SETTINGS, **MPS}).spec  # the guard's own mount, seen again: kept
    assert again["mounts"] == [mount]


@pytest.mark.parametrize("source", [PIPE, "/tmp/my-pipe"])
def test_a_slot_task_cannot_put_its_own_folder_where_its_mps_socket_goes(source):
    """The daemon's own pipe takes control commands; another folder would hide the relay's socket."""
    mounts = [{"destination": PIPE, "type": "bind", "source": source, "options": ["rbind"]}]
    with pytest.raises(gpu_guard.Refused, match="where the node's MPS daemons listen|remove the mount"):
        decide({**spec(f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={B}-s0"), "mounts": mounts}, **MPS)


@pytest.mark.parametrize("asked, limit", [("0=4G", "0=4096M"), ("8192M", "0=8192M"), ("512MB", "0=512M"),
                                          ("0=19968M", "0=19968M")])
def test_a_stack_may_ask_for_less_memory_than_the_slots_share(asked, limit):
    env = env_of(decide(spec(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={asked}", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=10",
                             f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={B}-s0"), **MPS))
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == limit
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"  # fewer threads than the ceiling: its own choice


@pytest.mark.parametrize("variable, value, message", [
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=20G", "a slot of this GPU has 19968 MiB"),
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4G,1=4G", "ask for at most 0=19968M"),
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "lots", "ask for at most"),
    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0M", "ask for at most"),
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0", "from 1 to 100"),
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "150", "from 1 to 100"),
    # the daemon's ceiling (gpu-swarm-mps) would cap it without a word: said at the start instead
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100", "may use at most 25 % of its threads"),
    ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "26", "ask for at most 25, or leave it unset"),
])
def test_an_mps_slot_cannot_take_more_than_its_share(variable, value, message):
    with pytest.raises(gpu_guard.Refused, match=message):
        decide(spec(f"{variable}={value}", f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={B}-s0"), **MPS)


# Host paths that reach the MPS folder (MPS["MPS_DIR"]), by the real path: a prefix test of the text
# passed the parent, the /var/run symlink, /run and / (measured on an H200: a task that mounted the parent
# raised every slot's ceiling through the daemon's control_privileged).
REACHES = ["/run/gpu-swarm/mps", PIPE, f"/run/gpu-swarm/mps/{A}/pipe/", "/run/gpu-swarm/mps/../mps/x",
           "//run//gpu-swarm/./mps", f"/run/gpu-swarm/mps/{A}/{guard_files.MPS_TASK_DIR}/..",
           "/run/gpu-swarm", "/run/gpu-swarm/", "/run", "/", "/var/run", "/var/run/gpu-swarm",
           "/var/run/gpu-swarm/mps", f"/var/run/gpu-swarm/mps/{B}/pipe", "/var/../run/gpu-swarm",
           "/proc", "/proc/1/root", "/proc/self/root/run"]
ELSEWHERE = ["/run/gpu-swarm-other", "/run/gpu-swarm/mpsx", "/run/gpu-swarm/gpu-claims.d", "/var", "/var/lib/x",
             "/tmp", "/srv/data", "/var/lib/docker/containers/c0ffee/hosts", "/procs"]


@pytest.mark.parametrize("source", REACHES)
def test_no_mount_that_reaches_the_mps_folder_starts_whoever_asks(source):
    assert Path("/var/run").resolve() == Path("/run"), "these rows need /var/run -> /run, as on every node"
    mounts = [{"destination": "/mps", "type": "bind", "source": source, "options": ["rbind"]}]
    # nothing reserved; another GPU's slot; a slot of B, the GPU whose relay folder the guard mounts
    for env in ([], [f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={A}-s0"], [f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={B}-s0"]):
        with pytest.raises(gpu_guard.Refused, match="where the node's MPS daemons listen"):
            decide({**spec(*env), "mounts": mounts}, **MPS)


@pytest.mark.parametrize("source", ELSEWHERE)
def test_mounts_elsewhere_pass(source):
    ok = [{"destination": "/host", "type": "bind", "source": source, "options": ["rbind"]}]
    assert decide({**spec(), "mounts": ok}, **MPS)["mounts"] == ok


def test_only_its_own_gpus_relay_folder_reaches_a_slot_task():
    relay = f"/run/gpu-swarm/mps/{B}/{guard_files.MPS_TASK_DIR}"
    mounts = [{"destination": "/again", "type": "bind", "source": relay, "options": ["rbind", "ro"]}]
    assert decide({**spec(f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={B}-s1"), "mounts": mounts}, **MPS)["mounts"][0] == \
        mounts[0]
    for env in ([], [f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={A}-s1"]):
        with pytest.raises(gpu_guard.Refused, match="where the node's MPS daemons listen"):
            decide({**spec(*env), "mounts": mounts}, **MPS)


BINDS = r"""
import json, subprocess, sys
sys.path.insert(0, sys.argv[2])
import gpu_guard
t = sys.argv[1]
def sh(cmd):
    subprocess.run(["sh", "-euc", cmd], check=True)
sh(f"mkdir -p {t}/run/gpu-swarm/mps/GPU-x/pipe {t}/srv/gs {t}/srv2/b {t}/p {t}/vol/_data {t}/other {t}/run/gpu-swarm-x"
   f" && mount --bind {t}/run/gpu-swarm {t}/srv/gs && mount --bind {t}/srv/gs {t}/srv2/b"
   f" && mount --bind {t}/run/gpu-swarm/mps/GPU-x/pipe {t}/p && mount --bind {t}/run {t}/vol/_data"
   f" && ln -s run/gpu-swarm {t}/link && ln -s ../srv2/b/mps {t}/other/deep")
settings = {"DELEGATE": "/x", "KIND": "NVIDIA-GPU", "SHARED_KIND": "NVIDIA-GPU-SHARED", "SHARING": "mps",
            "MPS_DIR": f"{t}/run/gpu-swarm/mps", "MPS_MEMORY_MIB": "1024", "MPS_THREAD_PERCENT": "25"}
out = {}
for source in sys.argv[3:]:
    spec = {"process": {"env": []}, "mounts": [{"destination": "/m", "type": "bind", "source": t + source}]}
    try:
        gpu_guard.guard(spec, settings)
        out[source] = "started"
    except gpu_guard.Refused as e:
        out[source] = "refused" if "where the node's MPS daemons listen" in str(e) else str(e)
print(json.dumps(out))
"""


@pytest.mark.parametrize("source, decided", [
    ("/srv/gs", "refused"),  # a bind of the MPS folder's parent, where the guard sees it (the host's mount table)
    ("/srv/gs/mps/GPU-x/pipe", "refused"),
    ("/srv", "refused"),  # holds that bind
    ("/srv2/b/mps", "refused"),  # a bind of the bind
    ("/p", "refused"),  # a bind of a pipe folder: a part of the MPS folder
    ("/vol/_data", "refused"),  # a Docker local volume of type none, o=bind, device=/run
    ("/link/mps", "refused"),  # a symlink to it
    ("/other/deep/GPU-x", "refused"),  # a symlink into the bind of the bind
    ("/other", "started"), ("/run/gpu-swarm-x", "started"), ("/srv2", "refused"),
])
def test_a_bind_of_the_mps_folder_or_of_a_folder_above_it_is_refused_too(tmp_path, source, decided):
    """Real binds, in a mount namespace of the test's own (the host's mount table is shared)."""
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", BINDS,
                           str(tmp_path), str(REPO / "node"), source], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {source: decided}


@pytest.mark.parametrize("env, message", [
    ([f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={A}-s0,{B}-s1"], "may hold one slot"),
    ([f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={A}-s0", f"DOCKER_RESOURCE_NVIDIA-GPU={B}"], "whole GPUs and a shared slot"),
    (["DOCKER_RESOURCE_NVIDIA-GPU-SHARED=GPU-00000000-0000-0000-0000-000000000000-s0"], "not a slot of a GPU of this"),
    ([f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={A}"], "not a slot"),
])
def test_slots_that_are_not_one_slot_of_this_node_are_refused(env, message):
    with pytest.raises(gpu_guard.Refused, match=message):
        decide(spec(*env))


@pytest.mark.parametrize("env, settings", [
    (CUDA_IMAGE_ENV, {}), ([f"DOCKER_RESOURCE_NVIDIA-GPU={A}"], {"SHARED_KIND": ""}),
    ([f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={A}-s1"], {}), ([f"DOCKER_RESOURCE_NVIDIA-GPU-SHARED={A}-s1"], MPS)])
def test_the_guard_is_idempotent(env, settings):
    once = decide(spec(*env, annotations={"cdi.k8s.io/x": "y"}), **settings)
    assert decide(once, **settings) == once


# ---------------------------------------------------------------- the runtime, in real sh


class Runtime:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.bundle = tmp / "bundle"
        self.bundle.mkdir()
        self.calls = tmp / "calls.jsonl"
        delegate = tmp / "delegate"
        # A runc stand-in: records its argv and the config.json it would create from.
        delegate.write_text(f"""#!/bin/sh
python3 -c 'import json, sys, os; b = sys.argv[sys.argv.index("--bundle") + 1] if "--bundle" in sys.argv else "."
c = open(os.path.join(b, "config.json")).read() if os.path.exists(os.path.join(b, "config.json")) else ""
open("{self.calls}", "a").write(json.dumps({{"argv": sys.argv[1:], "config": c}}) + chr(10))' "$@"
exit "${{FAKE_EXIT:-0}}"
""")
        delegate.chmod(0o755)
        self.config = tmp / "runtime.env"
        self.ledger = tmp / "run" / "claims"
        # A pool of whole GPUs; tests of shared pools write their own settings.
        settings = {**SETTINGS, "DELEGATE": str(delegate), "GUARD": str(REPO / "node" / "gpu_guard.py"),
                    "GUARD_PYTHON": sys.executable, "SHARED_KIND": "", "SLOTS_PER_GPU": "0",
                    "LEDGER": str(self.ledger)}
        self.config.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))

    def write(self, s: dict) -> None:
        (self.bundle / "config.json").write_text(json.dumps(s, indent=2))

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", str(FRONT), "--gpu-swarm-config", str(self.config), *args],
                              capture_output=True, text=True, env={**os.environ, **env}, timeout=30)

    def delegated(self) -> list[dict]:
        return [json.loads(line) for line in self.calls.read_text().splitlines()] if self.calls.exists() else []


@pytest.fixture
def runtime(tmp_path) -> Runtime:
    return Runtime(tmp_path)


CREATE = ["--root", "/run/docker/runtime-runc/moby", "--log", "/run/x/log.json", "--log-format", "json",
          "--systemd-cgroup", "create", "--bundle", "BUNDLE", "--pid-file", "/run/x/init.pid", "c0ffee"]


def create_args(runtime: Runtime) -> list[str]:
    return [str(runtime.bundle) if a == "BUNDLE" else a for a in CREATE]


def test_create_rewrites_the_bundle_then_hands_the_same_call_on(runtime):
    runtime.write(spec(*CUDA_IMAGE_ENV))
    result = runtime.run(*create_args(runtime))
    assert result.returncode == 0, result.stderr
    (call,) = runtime.delegated()
    assert call["argv"] == create_args(runtime)  # our own option is gone, the rest as dockerd sent it
    assert env_of(json.loads(call["config"]))["NVIDIA_VISIBLE_DEVICES"] == "void"


@pytest.mark.parametrize("args", [["start", "c0ffee"], ["--root", "/r", "state", "c0ffee"],
                                  ["--root", "/r", "--log", "/l", "delete", "--force", "c0ffee"],
                                  ["kill", "c0ffee", "9"], ["--version"]])
def test_every_other_call_goes_straight_on_without_python(runtime, args):
    runtime.config.write_text(runtime.config.read_text().replace(f"GUARD_PYTHON={sys.executable}",
                                                                 "GUARD_PYTHON=/nonexistent/python"))
    result = runtime.run(*args)
    assert result.returncode == 0, result.stderr
    assert [c["argv"] for c in runtime.delegated()] == [args]


def test_the_delegates_exit_code_is_the_runtimes(runtime):
    runtime.write(spec(f"DOCKER_RESOURCE_NVIDIA-GPU={A}"))
    assert runtime.run(*create_args(runtime), FAKE_EXIT="3").returncode == 3
    assert runtime.run("delete", "c0ffee", FAKE_EXIT="5").returncode == 5


def test_a_refused_container_is_not_created_and_says_why(runtime):
    runtime.write(spec("DOCKER_RESOURCE_NVIDIA-GPU=all"))
    result = runtime.run(*create_args(runtime))
    assert result.returncode == 1
    assert result.stderr.startswith("gpu-swarm guard: DOCKER_RESOURCE_NVIDIA-GPU=all is not a GPU swarm assigned")
    assert "the container was not started" in result.stderr
    assert runtime.delegated() == []


@pytest.mark.parametrize("damage, message", [
    (lambda r: (r.bundle / "config.json").write_text("{not json"), "cannot check this container"),
    (lambda r: (r.bundle / "config.json").unlink(), "cannot check this container"),
    (lambda r: r.config.write_text("KIND=NVIDIA-GPU\n"), "lacks DELEGATE, GUARD or GUARD_PYTHON"),
])
def test_anything_unreadable_fails_closed(runtime, damage, message):
    runtime.write(spec(*CUDA_IMAGE_ENV))
    damage(runtime)
    result = runtime.run(*create_args(runtime))
    assert result.returncode == 1 and message in result.stderr
    assert runtime.delegated() == []


def test_a_missing_settings_file_says_how_to_make_it(runtime, tmp_path):
    result = subprocess.run(["sh", str(FRONT), "--gpu-swarm-config", str(tmp_path / "nope.env"), "state", "x"],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "run the GPU agent" in result.stderr


def test_the_bundle_keeps_its_mode_and_a_second_create_changes_nothing(runtime):
    runtime.write(spec(f"DOCKER_RESOURCE_NVIDIA-GPU={A}", *CUDA_IMAGE_ENV))
    (runtime.bundle / "config.json").chmod(0o600)
    assert runtime.run(*create_args(runtime)).returncode == 0
    first = (runtime.bundle / "config.json").read_text()
    assert oct((runtime.bundle / "config.json").stat().st_mode & 0o777) == "0o600"
    assert runtime.run(*create_args(runtime)).returncode == 0
    assert (runtime.bundle / "config.json").read_text() == first
    assert [p.name for p in runtime.bundle.iterdir()] == ["config.json"]  # no temp file left


def test_the_front_passes_shellcheck_and_runs_under_dash():
    shellcheck = require_tool("shellcheck")
    result = subprocess.run([shellcheck, "-s", "sh", str(FRONT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    assert FRONT.read_text().startswith("#!/bin/sh\n") and os.access(FRONT, os.X_OK)


def test_a_refusal_is_written_where_containerd_reads_runtime_errors(runtime):
    """containerd reports a runc-style runtime's error from its --log file, not from stderr."""
    runtime.write(spec("DOCKER_RESOURCE_NVIDIA-GPU=all"))
    log = runtime.tmp / "log.json"
    args = [str(log) if a == "/run/x/log.json" else a for a in create_args(runtime)]
    assert runtime.run(*args).returncode == 1
    (entry,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert entry["level"] == "error"
    assert entry["msg"].startswith("gpu-swarm guard: DOCKER_RESOURCE_NVIDIA-GPU=all is not a GPU swarm assigned")
