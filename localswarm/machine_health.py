"""`localswarm node gpu-fault|gpu-heal|spot-notice|maintenance-notice HOSTNAME` on the machines of Pulumi's CLI.

Nothing here starts a watcher or a reconciler: each machine runs its own, as its user data installed
them (gpu-swarm-health.service on every node, gpu-swarm-reconciler.service on the managers). A fault is
written into the machine's stand-in hardware (machines.set_gpu_fault), which its NVML stand-in reads at
once; a notice goes where the IMDS that answers the machine reads it (fake_imds.instance_notice_file).
The watcher then reports as it would on EC2, and the reconciler drains the node.
"""
from __future__ import annotations

import json

from localswarm import fake_imds, machines, pulumi_cli
from localswarm.host import RehearsalError
from localswarm.standins import hardware

DEFAULT_XID = 79  # "GPU has fallen off the bus"


def find(hostname: str) -> machines.Machine:
    """The CLI's machine whose node has this hostname."""
    records = {r["hostname"]: r for r in pulumi_cli.world().get("machines", {}).values()}
    if hostname not in records:
        raise RehearsalError(f"no machine of Pulumi's CLI is {hostname}; its machines are "
                             f"{', '.join(sorted(records)) or 'none'} (`pulumi stack output inventory` names them)")
    return machines.Machine(records[hostname]["machine"], records[hostname]["index"])


def _watched(m: machines.Machine, hostname: str, action: str) -> None:
    active = machines.run(m, ["systemctl", "is-active", "gpu-swarm-health.service"], check=False).stdout.strip()
    if active != "active":
        raise RehearsalError(f"{hostname}'s health watcher (gpu-swarm-health.service) is {active or 'not there'}, "
                             f"so nothing would act on a {action}")


def gpu_fault(hostname: str, gpu: str | None = None, xid: int = DEFAULT_XID) -> dict:
    m = find(hostname)
    gpus = [g["uuid"] for g in hardware.load(str(machines.hardware_file(m)))["gpus"]]
    gpu = gpu or (gpus[0] if gpus else None)
    if gpu not in gpus:
        raise RehearsalError(f"{hostname} has no GPU {gpu}; its GPUs are {', '.join(gpus) or 'none'}")
    if not 0 <= xid <= 1023:
        raise RehearsalError(f"--xid {xid} is not an XID (0 to 1023)")
    _watched(m, hostname, "gpu-fault")
    machines.set_gpu_fault(m, gpu, {"xid": xid})
    return {"node": hostname, "gpu": gpu, "xid": xid}


def gpu_heal(hostname: str) -> dict:
    """Every GPU's fault and every notice cleared; the watcher says healthy once its health.recoverySeconds passed."""
    m = find(hostname)
    described = hardware.load(str(machines.hardware_file(m)))["gpus"]
    healed = sorted(g["uuid"] for g in described if g.get("fault"))
    for uuid in healed:
        machines.set_gpu_fault(m, uuid, None)
    cleared = fake_imds.clear_instance_notices(fake_imds.RECORDS, m.address)
    return {"node": hostname, "healed": healed, "notices_cleared": cleared}


def _notice(m: machines.Machine, kind: str, body) -> None:
    file = fake_imds.instance_notice_file(fake_imds.RECORDS, m.address, kind)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(body) + "\n")
    tmp.replace(file)  # the IMDS answers the old notice or the new one, never half of one


def spot_notice(hostname: str, action: str = "terminate") -> dict:
    m = find(hostname)
    said = fake_imds.instance_record(fake_imds.RECORDS, m.address).get("instance-life-cycle", "")
    if said != "spot":  # as its watcher asks IMDS
        raise RehearsalError(f"{hostname} is no spot instance (IMDS's instance-life-cycle says {said or 'nothing'}): "
                             f"EC2 sends it no spot notice and its watcher asks for none; `maintenance-notice` is "
                             f"what any instance can get")
    _watched(m, hostname, "spot-notice")
    notice = fake_imds.spot_action(action)
    _notice(m, "spot-instance-action", notice)
    return {"node": hostname, **notice}


def maintenance_notice(hostname: str, code: str = "system-reboot", starts_in_s: int = 60) -> dict:
    m = find(hostname)
    _watched(m, hostname, "maintenance-notice")
    event = fake_imds.scheduled_event(hostname, code, starts_in_s)
    _notice(m, "maintenance-scheduled", [event])
    return {"node": hostname, **event}


def gpu_load(hostname: str, container: str, kind: str, mib: int, utilization: int = 80) -> dict:
    """A task's container "allocates" mib MiB on its GPU and keeps it busy: its first process appears among
    its GPU's compute processes in the machine's stand-in hardware, as NVML lists a CUDA process. The pid is
    the machine's own (its engine's answer): the exporter there maps it to the task through its cgroup."""
    from localswarm import api, pulumi_host
    from swarm.gpu_kind import resource_env_name
    m = find(hostname)
    try:
        info = api.get(pulumi_host.docker_socket(m), f"/containers/{container}/json")
    except (OSError, api.ApiError) as e:
        raise RehearsalError(f"{hostname}: no container {container} ({e})") from None
    pid = info["State"]["Pid"]
    prefix = resource_env_name(kind) + "="
    held = [v for e in info["Config"]["Env"] or [] if e.startswith(prefix) for v in e[len(prefix):].split(",") if v]
    if not held or not pid:
        raise RehearsalError(f"{hostname}: container {container[:12]} holds no {kind} GPU or is not running")
    file = machines.hardware_file(m)
    description = hardware.load(str(file))
    gpu = next((g for g in description["gpus"] if g["uuid"] == held[0]), None)
    if gpu is None:
        raise RehearsalError(f"{hostname}: {held[0]} is not among its GPUs")
    gpu["processes"] = [p for p in gpu.get("processes", []) if p["pid"] != pid] + [{"pid": pid, "used_mib": mib}]
    gpu["utilization"] = {"gpu": utilization, "memory": utilization // 2}
    machines.write_hardware(m, description)
    return {"node": hostname, "container": container[:12], "gpu": held[0], "pid": pid, "mib": mib}
