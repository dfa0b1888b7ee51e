"""What Compose says, in what swarm accepts: every service key is passed on, translated, dropped with a
warning that says what is lost, or refused with the fix.

`docker stack deploy` refuses some Compose keys outright (profiles, develop, pull_policy, a
top-level name, depends_on's long form, version 2) and silently drops others ("Ignoring
unsupported options": shm_size, ipc, network_mode, restart, ...). A dropped shm_size leaves a
task with a 64 MiB /dev/shm, in which NCCL and PyTorch's DataLoader workers fail or crawl. So
nothing reaches the manager that swarm would refuse or drop: like docker/cli's own
cli/compose/convert, one small function per concern, and the keys listed in one place.
Runs after compose_resolve.py; the GPU requests are compose_gpus.py's.
"""
from __future__ import annotations

import re
from typing import Callable

from swarm.compose_volumes import mount_target, volume_problems
from swarm.compose_yaml import BOOL, INT, STR, Scalar, Unresolved, plain, scalar

# Service keys swarm takes as they are (docker CLI 26.1.5's v3 schema, less what it ignores).
SWARM_KEYS = frozenset({
    "cap_add", "cap_drop", "command", "configs", "credential_spec", "deploy", "dns", "dns_search", "entrypoint",
    "environment", "extra_hosts", "healthcheck", "hostname", "image", "init", "isolation", "labels", "logging",
    "networks", "ports", "read_only", "secrets", "stdin_open", "stop_grace_period", "stop_signal", "sysctls",
    "tmpfs", "tty", "ulimits", "user", "volumes", "working_dir",
    # Compose GPU requests and env files: compose_gpus.py and stack_files.py read them.
    "gpus", "runtime", "env_file",
})
# Keys dropped with what the service loses, and why nothing is lost that swarm could keep.
DROPPED = {
    "container_name": "swarm names each task <stack>_<service>.<n>; other services reach this one by its service "
                      "name on the stack's network",
    "expose": "services on the stack's network reach each other's containers on any port",
    "depends_on": "swarm starts every service at once and restarts a task whose dependency is not up yet; give "
                  "the service a healthcheck or a retry so it waits by itself",
    "develop": "`docker compose watch` is for a developer's machine",
    "pull_policy": "swarm resolves the image to a digest at each deploy and every node pulls that digest",
    "platform": "each node pulls the image's variant for its own platform",
    "annotations": "swarm has no container annotations; use labels",
    "memswap_limit": "swarm sets no swap limit",
}
# Keys swarm cannot honour at all, with what to do instead.
REFUSED = {
    "privileged": "swarm cannot run privileged tasks; add the capabilities the service needs with cap_add",
    "devices": "swarm cannot give a task devices; for GPUs reserve them (deploy.resources.reservations.devices "
               "with driver: nvidia), and the node's runtime gives the task their /dev/nvidia* nodes",
    "pid": "swarm tasks cannot join the host's or another container's PID namespace; remove it",
    "userns_mode": "swarm cannot set a user namespace mode; remove it",
    "security_opt": "swarm cannot set security options; remove it, or add capabilities with cap_add",
    "cgroup_parent": "swarm cannot place a task in another cgroup; remove it",
    "links": "services on the stack's network reach each other by service name; remove links",
    "external_links": "services on the stack's network reach each other by service name; remove external_links",
    "volumes_from": "swarm tasks cannot share another container's volumes; mount the same named volume in both",
    "mac_address": "swarm cannot set a MAC address; remove it",
    "domainname": "swarm cannot set a domain name; remove it",
    "cpu_count": "use deploy.resources.limits.cpus", "cpu_percent": "use deploy.resources.limits.cpus",
    "cpu_shares": "use deploy.resources.limits.cpus", "cpu_quota": "use deploy.resources.limits.cpus",
    "cpu_period": "use deploy.resources.limits.cpus", "cpuset": "use deploy.resources.limits.cpus",
    "oom_score_adj": "swarm cannot set it; remove it", "oom_kill_disable": "swarm cannot set it; remove it",
    "group_add": "swarm cannot add groups; make the image's user a member, or run as a user that is",
    "storage_opt": "swarm cannot set storage options; remove it",
}
# Keys turned into their swarm form: where they go.
TRANSLATED = ("restart", "shm_size", "ipc", "network_mode", "scale", "mem_limit", "mem_reservation", "cpus")
SHM = "/dev/shm"
HOST_NETWORK = "host"  # the key under networks: that stands for the node's own network stack
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_MINOR_FOR = {"generic_resources": 5, "external network name": 5, "tmpfs size": 6}


class Translation:
    """What one file's translation found: problems (nothing deployed), warnings and changes (shown at preview).

    is_file(path) says whether a relative bind source is a file beside the stack file (None: not known)."""

    def __init__(self, is_file: Callable[[str], bool] | None = None):
        self.is_file = is_file
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.changes: list[str] = []
        self.dropped: dict[tuple[str, str], list[str]] = {}  # (key, why) -> services, said once per file

    def drop(self, service: str, key: str, why: str) -> None:
        self.dropped.setdefault((key, why), []).append(service)

    def said(self) -> None:
        for (key, why), services in self.dropped.items():
            self.warnings.append(f"{key} (services {', '.join(services)}): left out, swarm does not use it: {why}")


def to_swarm(doc: dict, t: Translation) -> None:
    """Edit the resolved file in place into what `docker stack deploy` takes without refusing or ignoring."""
    _top_level(doc, t)
    for name, service in (doc.get("services") or {}).items():
        if not isinstance(service, dict):
            continue
        where = f"services.{name}"
        context = _build(where, str(name), service, t)
        for key in list(service):
            if key == "build":
                continue  # with no image: refused by stack_files.py, which says what to do
            if key in REFUSED:
                t.problems.append(f"{where}.{key}: {REFUSED[key]}")
            elif key in DROPPED:
                del service[key]
                t.drop(str(name), key, DROPPED[key])
            elif key not in SWARM_KEYS and key not in TRANSLATED and not key.startswith("x-"):
                t.problems.append(f"{where}.{key}: not a setting swarm services have (docker stack deploy refuses "
                                  "or ignores it); remove it")
        _restart(where, service, t)
        _resources(where, service, t)
        _typed(service)
        _shm(where, service, t)
        _network_mode(where, doc, service, t)
        _ports(where, service, t)
        t.problems += volume_problems(where, doc, service, context, t.is_file)
    _ports_taken_twice(doc.get("services") or {}, t)
    t.said()


def _build(where: str, name: str, service: dict, t: Translation) -> str | None:
    """Leave out `build` beside an `image`, saying where the image must be; returns the build context."""
    if "build" not in service or "image" not in service:
        return None
    build = service.pop("build")
    context = str(build.get("context", ".") if isinstance(build, dict) else build)
    t.warnings.append(
        f"{where}.build: left out: `docker stack deploy` cannot build, so every node the service lands on pulls "
        f"the image {str(service['image'])!r} from its registry. Build and push it to a registry that every node "
        f"can pull from before `pulumi up` (docker compose build {name} && docker compose push {name}), naming "
        "that registry in `image:` (registry.example.com/team/app:1.0); a tag only this machine has is pulled "
        "from Docker Hub, and its tasks are rejected once the cluster is built")
    return context


def _top_level(doc: dict, t: Translation) -> None:
    version = str(doc.get("version", "")).strip()
    if version and not version.startswith("3"):
        t.problems.append(f"version: {version!r} is Compose file format {version.split('.')[0]}, which swarm does not "
                          "read; remove the `version` line (the Compose spec needs none) and run the file with "
                          "docker compose to check it")
    if "name" in doc:
        t.warnings.append(f"name: {doc.pop('name')!r} left out: the stack is named by its `name` in gpu-swarm:stacks")
    if "include" in doc:
        t.problems.append("include: swarm cannot include other files; copy their services in, or use `extends`")


# Where swarm's loader wants text and Compose takes a boolean (`HF_HUB_DISABLE_TELEMETRY: true`), and where it
# wants a number that interpolation left as text (`published: "${PORT:-8080}"`), values are given the type swarm
# wants, as Compose's own loader casts them by its schema.
_TEXT_MAPS = (("environment",), ("labels",), ("deploy", "labels"), ("sysctls",), ("extra_hosts",),
              ("logging", "options"))
_TEXT_LISTS = (("command",), ("entrypoint",), ("healthcheck", "test"), ("dns",), ("dns_search",), ("cap_add",),
               ("cap_drop",), ("tmpfs",))
_NUMBERS = (("deploy", "replicas"), ("deploy", "restart_policy", "max_attempts"),
            ("deploy", "placement", "max_replicas_per_node"), ("deploy", "update_config", "parallelism"),
            ("deploy", "rollback_config", "parallelism"), ("healthcheck", "retries"))


def _typed(service: dict) -> None:
    def at(path):
        node = service
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return node
    for path in _TEXT_MAPS:  # swarm reads numbers here as Compose does, and refuses only booleans
        found = at(path)
        if isinstance(found, dict):
            for key, value in found.items():
                found[key] = _text(value) if getattr(value, "tag", None) == BOOL else value
    for path in _TEXT_LISTS:  # `${PORT}` in a command is text, whatever it reads as
        found = at(path)
        if isinstance(found, list):
            found[:] = [_text(v) for v in found]
    for path in _NUMBERS:
        parent = at(path[:-1])
        if isinstance(parent, dict) and path[-1] in parent:
            parent[path[-1]] = _number(parent[path[-1]])
    for port in service.get("ports") or ():
        if isinstance(port, dict):
            for key in ("published", "target"):
                if key in port:
                    port[key] = _number(port[key])


def _text(value):
    if not isinstance(value, Scalar) or value.tag == STR or value.is_null:
        return value
    text = str(value).lower() if value.tag == BOOL else str(value)  # as Compose writes a boolean: true, false
    return Scalar(text, STR, '"')


def _number(value):
    return Scalar(str(value), INT) if isinstance(value, Scalar) and str(value).strip().isdigit() else value


def _restart(where: str, service: dict, t: Translation) -> None:
    if "restart" not in service:
        return
    value = str(service.pop("restart")).strip()
    policy, _, attempts = value.partition(":")
    condition = {"no": "none", "false": "none", "always": "any", "unless-stopped": "any",
                 "on-failure": "on-failure"}.get(policy)
    if condition is None or (attempts and not attempts.isdigit()):
        t.problems.append(f"{where}.restart: {value!r} is not a restart policy; use no, always, on-failure[:N] or "
                          "unless-stopped")
        return
    deploy = _mapping(service, "deploy")
    if "restart_policy" in deploy:
        t.warnings.append(f"{where}.restart: left out, deploy.restart_policy says how swarm restarts the tasks")
        return
    rule = {"condition": scalar(condition)}
    if attempts:
        rule["max_attempts"] = scalar(int(attempts))
    deploy["restart_policy"] = rule
    t.changes.append(f"{where}.restart: {value} -> deploy.restart_policy: {plain(rule)}")


def _resources(where: str, service: dict, t: Translation) -> None:
    """scale, mem_limit, mem_reservation and cpus: the Compose forms of what swarm keeps under deploy."""
    if "scale" in service:
        scale = service.pop("scale")
        deploy = _mapping(service, "deploy")
        if "replicas" not in deploy:
            deploy["replicas"] = scale
            t.changes.append(f"{where}.scale: {scale} -> deploy.replicas")
    for key, section, field in (("mem_limit", "limits", "memory"), ("cpus", "limits", "cpus"),
                                ("mem_reservation", "reservations", "memory")):
        if key in service:
            value = service.pop(key)
            resources = _mapping(_mapping(service, "deploy"), "resources")
            target = _mapping(resources, section)
            if field not in target:
                target[field] = Scalar(str(value), "tag:yaml.org,2002:str", '"')
                t.changes.append(f"{where}.{key}: {value} -> deploy.resources.{section}.{field}")


def _shm(where: str, service: dict, t: Translation) -> None:
    """shm_size as a tmpfs at /dev/shm of that size; ipc: host as one without a limit."""
    size = service.pop("shm_size", None)
    ipc = service.pop("ipc", None)
    ipc_text = str(ipc).strip() if ipc is not None else ""
    if ipc_text.startswith(("service:", "container:")):
        t.problems.append(f"{where}.ipc: {ipc_text}: swarm tasks cannot share another container's IPC namespace; "
                          "remove it (a tmpfs at /dev/shm, from shm_size, gives each task its own shared memory)")
        return
    if size is None and ipc_text != "host":
        if ipc_text and ipc_text not in ("private", "shareable"):
            t.problems.append(f"{where}.ipc: {ipc_text!r} is not an IPC mode")
        return
    volumes = service.setdefault("volumes", [])
    if any(mount_target(v) == SHM for v in volumes):
        t.warnings.append(f"{where}.shm_size: left out, the service mounts {SHM} itself")
        return
    mount = {"type": scalar("tmpfs"), "target": scalar(SHM)}
    if size is not None:
        n = parse_bytes(size)
        if n is None:
            t.problems.append(f"{where}.shm_size: {size!r} is not a size; write it as 8g, 512m or a number of bytes")
            return
        mount["tmpfs"] = {"size": scalar(n)}
        t.changes.append(f"{where}.shm_size: {size} -> volumes: tmpfs at {SHM} of {n} bytes (swarm ignores "
                         "shm_size, which would leave the task a 64 MiB /dev/shm)")
    if ipc_text == "host":
        t.warnings.append(
            f"{where}.ipc: host is left out: a swarm task cannot join the node's IPC namespace. What GPU work uses "
            f"it for is a large {SHM} (NCCL, PyTorch DataLoader workers), so the task gets a tmpfs at {SHM}"
            + (" of shm_size" if size is not None else
               " with the kernel's default limit, half the node's memory (set shm_size to bound it)")
            + "; processes in different containers do not share memory through it")
        if size is None:
            t.changes.append(f"{where}.ipc: host -> volumes: tmpfs at {SHM}")
    volumes.append(mount)


def parse_bytes(value) -> int | None:
    """Compose's byte sizes: a number of bytes, or 8g, 512m, 1.5gb, 2GiB (units of 1024, any case)."""
    text = str(value)
    if getattr(value, "tag", INT) == INT and text.isdigit():
        return int(text)
    match = _BYTES.match(text)
    if not match:
        return None
    return int(float(match[1]) * 1024 ** " kmgt".index(match[2].lower() or " "))


def _network_mode(where: str, doc: dict, service: dict, t: Translation) -> None:
    if "network_mode" not in service:
        return
    mode = str(service.pop("network_mode")).strip()
    if mode == "bridge":
        t.warnings.append(f"{where}.network_mode: bridge left out: a stack's services share its overlay network")
        return
    if mode != "host":
        t.problems.append(f"{where}.network_mode: {mode!r}: swarm tasks join networks, not another container's or "
                          "none; remove it, or use `host` for the node's own network")
        return
    if service.get("networks"):
        t.problems.append(f"{where}.network_mode: host with `networks`: a task on the host's network joins no "
                          "other; keep one of the two")
        return
    service["networks"] = [scalar(HOST_NETWORK)]
    networks = _mapping(doc, "networks")
    networks.setdefault(HOST_NETWORK, {"external": Scalar("true", "tag:yaml.org,2002:bool"),
                                       "name": scalar("host")})
    if service.pop("ports", None):
        t.warnings.append(f"{where}.ports: left out: on the host's network the service listens on the node's own "
                          "ports, so there is nothing to publish")
    t.changes.append(f"{where}.network_mode: host -> networks: [{HOST_NETWORK}], the swarm's external network "
                     "`host` (the task uses the node's network stack)")


def _ports(where: str, service: dict, t: Translation) -> None:
    """A port published on one address of the host: swarm has no such thing, it would publish on all of them."""
    for i, port in enumerate(service.get("ports") or ()):
        ip = port.get("host_ip") if isinstance(port, dict) else _host_ip(str(port))
        if ip:
            t.problems.append(
                f"{where}.ports[{i}]: published on {ip} only, but swarm publishes a port on every address of every "
                "node (its routing mesh), so it would be open to the network. Leave the port unpublished and reach "
                "the service from another service of the stack by its name, or through an SSH tunnel to a manager; "
                "or publish it without an address, behind the security group")


def _host_ip(port: str) -> str:
    """The address of a short port such as 127.0.0.1:8080:80 or [::1]:8080:80; "" when it names none."""
    if port.startswith("["):
        return port[1:port.index("]")] if "]" in port else ""
    parts = port.split(":")
    return parts[0] if len(parts) == 3 else ""


def _ports_taken_twice(services: dict, t: Translation) -> None:
    """A port that two services publish: swarm's routing mesh publishes it once for the whole swarm, so
    `docker stack deploy` creates the first service and fails on the second ("port is already in use")."""
    owners: dict[tuple[int, str], list[str]] = {}
    for name, service in services.items():
        for i, port in enumerate((service.get("ports") or []) if isinstance(service, dict) else ()):
            for key in _published(port):
                owners.setdefault(key, []).append(f"services.{name}.ports[{i}]")
    for (number, protocol), where in owners.items():
        if len({w.split(".")[1] for w in where}) > 1:
            t.problems.append(
                f"ports: {number}/{protocol} is published by {' and '.join(where)}; swarm's routing mesh publishes "
                "a port once for the whole swarm, so `docker stack deploy` would create the first service and fail "
                f"on the next (\"port '{number}' is already in use\"). Publish one of them on another port "
                f"(\"{number + 1}:<its target>\"), or leave it unpublished and reach it from the stack's network by "
                "its service name")


def _published(port) -> list[tuple[int, str]]:
    """(published port, protocol) of each port the entry publishes on the routing mesh; [] for none or host mode."""
    if isinstance(port, dict):
        if str(port.get("mode", "ingress")) == "host" or not str(port.get("published", "")).strip().isdigit():
            return []
        return [(int(str(port["published"])), str(port.get("protocol") or "tcp"))]
    if isinstance(port, Unresolved):
        return []
    spec, _, protocol = str(port).partition("/")
    parts = spec.rsplit(":", 2)
    if len(parts) < 2:
        return []  # a target only: swarm picks a free published port
    first, _, last = parts[-2].partition("-")
    if not first.isdigit() or (last and not last.isdigit()):
        return []
    return [(n, protocol or "tcp") for n in range(int(first), int(last or first) + 1)]


def _mapping(parent: dict, key: str) -> dict:
    if not isinstance(parent.get(key), dict):
        parent[key] = {}
    return parent[key]


def needed_version(doc: dict) -> int:
    """The lowest 3.x minor version that allows every key the translation and the GPU rewrite add."""
    need = 0
    for service in (doc.get("services") or {}).values():
        deploy = service.get("deploy") if isinstance(service, dict) else None
        reservations = ((deploy or {}).get("resources") or {}).get("reservations") if isinstance(deploy, dict) else None
        if isinstance(reservations, dict) and "generic_resources" in reservations:
            need = max(need, _MINOR_FOR["generic_resources"])
        for volume in (service.get("volumes") or []) if isinstance(service, dict) else ():
            if isinstance(volume, dict) and isinstance(volume.get("tmpfs"), dict):
                need = max(need, _MINOR_FOR["tmpfs size"])
    if any(isinstance(n, dict) and "name" in n for n in (doc.get("networks") or {}).values()):
        need = max(need, _MINOR_FOR["external network name"])
    return need


def raise_version(doc: dict, changes: list[str]) -> None:
    """A `version: "3.x"` below what the added keys need is raised to it; no version means the newest."""
    if "version" not in doc:
        return
    text = str(doc["version"]).strip()
    match = re.fullmatch(r"3(?:\.(\d+))?", text)
    if not match or match[1] is None:
        return  # "3" means the newest 3.x to swarm's loader
    need = needed_version(doc)
    if int(match[1]) < need:
        doc["version"] = Scalar(f"3.{need}", "tag:yaml.org,2002:str", '"')
        changes.append(f"version: {text} -> 3.{need}, the first that allows what gpu-swarm adds "
                       "(generic_resources from 3.5, tmpfs sizes from 3.6)")
