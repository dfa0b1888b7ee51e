"""Pulumi's real CLI on the unchanged program, in the rehearsal: `localswarm pulumi preview --stack prod`.

The CLI (built by scripts/setup.sh from its Go module, tools/pulumi/) runs its own engine. What
it cannot get here is its Python language host, whose Go module the proxy refuses. So the
program runs the way Pulumi's automation API runs an inline program: Pulumi's own
LanguageServer (pulumi.automation._server) serves the language protocol in this process, runs
`__main__.py` when the engine asks, and the CLI is told its address with `--client`. The config
the program reads, the registrations, the plan, the diff and the output are the CLI's.

The providers are the rehearsal's own plugins (localswarm/provider_plugin.py), first on PATH
for the CLI only; PULUMI_HOME and the state (a local file backend with a passphrase) live under
the rehearsal's state folder, so a user's Pulumi setup is never read or shadowed. The project
folder the CLI reads holds copies of Pulumi.yaml and the stack's file: the CLI writes the
passphrase's salt into its copy, not into the user's file.

What the CLI's display does not say, each `up`, `destroy` or `refresh` here writes to last-run.json
in that folder: the commands that ran a script on a node (host, seconds, in the order they
finished: the command plugin's actions.jsonl) and the most nodes of each pool the swarm had
drained at once while it ran. `--bump-node-software` stands in for an edit of node/: the program
builds a bundle with one more changed byte, on this run and every later one, as an edit stays.
"""
from __future__ import annotations

import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

from localswarm import lane

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / ".tools" / "bin"
PLUGINS = REPO / "localswarm" / "plugins"
# The rehearsal's state holds only the fake AWS's secrets; the passphrase protects nothing real.
PASSPHRASE = "gpu-swarm-rehearsal"
VERSION = (REPO / "tools" / "pulumi" / "VERSION").read_text().strip()
RUNS_PROGRAM = ("up", "preview", "update")
MAKES = ("up", "update", "destroy", "refresh")  # steps that act on the rehearsal's machines


def cli() -> str:
    """The pinned CLI: a `pulumi` on PATH of that version, as a user's would be, else the one setup built."""
    found = shutil.which("pulumi")
    if found:
        try:
            out = subprocess.run([found, "version"], capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out.lstrip("v") == VERSION:
            return found
    built = TOOLS / "pulumi"
    if not built.exists():
        raise SystemExit(f"no Pulumi CLI {VERSION}: run scripts/setup.sh, which builds it into {built.relative_to(REPO)}")
    return str(built)


def root() -> Path:
    """Where the CLI's home, state and project folder live (GPU_SWARM_PULUMI_ROOT: a test's own)."""
    return Path(os.environ.get("GPU_SWARM_PULUMI_ROOT") or lane.NAMESPACED_STATE / "pulumi")


def environment() -> dict:
    home = root()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PULUMI_")}
    env.update({
        "PATH": f"{PLUGINS}{os.pathsep}{env.get('PATH', '')}",
        "PULUMI_HOME": str(home / "home"),
        "PULUMI_BACKEND_URL": f"file://{home / 'state'}",
        "PULUMI_CONFIG_PASSPHRASE": PASSPHRASE,
        "PULUMI_SKIP_UPDATE_CHECK": "true",
        "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION": "true",  # nothing is downloaded: no network here
        "PULUMI_AUTOMATION_API_SKIP_VERSION_CHECK": "true",
    })
    return env


def project_dir(stack: str, stack_file: Path | None = None) -> Path:
    """The folder the CLI reads: Pulumi.yaml and the stack's file as the user has them. The stack's file is
    copied again whenever the user's changed since the last copy, so a `config set` in the rehearsal lasts
    until the user edits their own file; the passphrase's salt that the CLI added is kept."""
    home = root()
    work = home / "project"
    for d in (work, home / "state", home / "home"):
        d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO / "Pulumi.yaml", work / "Pulumi.yaml")
    source = stack_file or REPO / f"Pulumi.{stack}.yaml"
    if not source.exists():
        raise SystemExit(f"no stack file {source.name} in {source.parent.name}/")
    target, copied = work / f"Pulumi.{stack}.yaml", work / f".Pulumi.{stack}.yaml.copied"
    text = source.read_text()
    if not target.exists() or not copied.exists() or copied.read_text() != text:
        salt = [line for line in (target.read_text().splitlines() if target.exists() else [])
                if line.startswith("encryptionsalt:")]
        target.write_text("\n".join(salt + [text]))
        copied.write_text(text)
    return work


def _program() -> None:
    # The project's own entry point, unchanged, with the repository as its folder (it reads stacks/, node/).
    os.chdir(REPO)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    runpy.run_path(str(REPO / "__main__.py"), run_name="__main__")


def language_server():
    """Pulumi's own language runtime for inline programs, serving the unchanged program; (server, address)."""
    import grpc
    from pulumi.automation._server import LanguageServer
    from pulumi.runtime.proto import language_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", 400 * 1024 * 1024)])
    language_pb2_grpc.add_LanguageRuntimeServicer_to_server(LanguageServer(_program), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def holds_machines() -> bool:
    """Whether machines that the CLI's rehearsal made are still there (its aws plugin's world)."""
    return bool(world().get("machines"))


def prepare_host(stack_file: Path) -> dict:
    """What the machines reach, before the CLI makes any (localswarm/pulumi_host.py); the program's preview
    reads images from that registry. Returns the config the rehearsal sets in its copy of the stack file."""
    import yaml
    from localswarm import node_image, pulumi_host
    from localswarm.host import check_host
    from localswarm.nodes import REGISTRY
    from localswarm.stack_config import config_text
    from settings import image_registry
    check_host()
    say = lambda m: print(f"rehearsal: {m}", flush=True)  # noqa: E731
    node_image.ensure_image(say)
    config = {k: config_text(v) for k, v in (yaml.safe_load(stack_file.read_text()).get("config") or {}).items()}
    extra = pulumi_host.prepare(config, say)
    image_registry.ENDPOINTS["docker.io"] = f"http://{REGISTRY}"
    return extra


def report(stack: str) -> list[str]:
    """The rehearsal's report, from `pulumi stack output --json` (localswarm/pulumi_report.py); with
    monitoring on, where its tunnel's addresses answer in the rehearsal (localswarm/monitoring_stack.py)."""
    from localswarm import monitoring_stack, pulumi_report
    shown = subprocess.run([cli(), "stack", "output", "--json", "--stack", stack], cwd=root() / "project",
                           env=environment(), capture_output=True, text=True, check=True)
    outputs = json.loads(shown.stdout)
    access = monitoring_stack.program_access(outputs, nodes())
    return pulumi_report.render(outputs) + ([monitoring_stack.render_access(access)] if access else [])


def bumps(more: bool = False) -> int:
    """How many edits of node/ the rehearsal stands in for; one more with `more`, kept for later runs."""
    path = root() / "node-bumps"
    try:
        n = int(path.read_text())
    except (OSError, ValueError):
        n = 0
    if more:
        n += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{n}\n")
    return n


def world(package: str = "aws") -> dict:
    try:
        return json.loads((root() / f"world-{package}.json").read_text())
    except (OSError, ValueError):
        return {}


def nodes() -> list:
    """The CLI's machines as localswarm/placement.py reads them (and those of its elastic pools' groups)."""
    from localswarm import pulumi_host
    return pulumi_host.view_nodes(world().get("machines", {}))


def held_stack() -> str | None:
    """The stack of the CLI's last run that acted on machines."""
    try:
        return last_run().get("stack")
    except (OSError, ValueError):
        return None


def status(stack: str) -> dict:
    """What the swarm of the CLI's machines says: nodes, GPUs, services and tasks (localswarm/placement.py)."""
    import yaml
    from localswarm import placement
    from localswarm.host import CLI, RehearsalError, find_engine
    if not holds_machines():
        raise RehearsalError(f"Pulumi's CLI holds no rehearsal machines; make some with `{CLI} pulumi up`")
    config = (yaml.safe_load((root() / "project" / f"Pulumi.{stack}.yaml").read_text()) or {}).get("config") or {}
    kind = config.get("gpu-swarm:gpuKind") or "NVIDIA-GPU"
    return placement.collect(nodes(), find_engine(), kind, config.get("gpu-swarm:sharedGpuKind") or f"{kind}-SHARED")


def _plain(value):
    """A value of `pulumi stack export --show-secrets` with its secrets opened: the export writes each as
    {<the SDK's signature key>: <the secret's signature>, "plaintext": <the value as JSON>}."""
    from pulumi.runtime import rpc
    if isinstance(value, dict) and rpc._special_sig_key in value and "plaintext" in value:
        return _plain(json.loads(value["plaintext"]))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def exported(stack: str) -> list[dict]:
    """The stack's state as `pulumi stack export --show-secrets` has it, secrets opened: each resource's
    urn, type, id, inputs, outputs, and `delete` when a failed replacement left it to delete."""
    shown = subprocess.run([cli(), "stack", "export", "--show-secrets", "--stack", stack], cwd=project_dir(stack),
                           env=environment(), capture_output=True, text=True, check=True)
    return _plain(json.loads(shown.stdout)["deployment"].get("resources") or [])


def last_run() -> dict:
    return json.loads((root() / "last-run.json").read_text())


def _actions_since(offset: int) -> list[dict]:
    try:
        with open(root() / "actions.jsonl") as log:
            log.seek(offset)
            return [json.loads(line) for line in log if line.strip()]
    except OSError:
        return []


@contextmanager
def _ctrl_c_for_the_cli():
    """A Ctrl-C at the terminal reaches the whole foreground group: the CLI, which cancels as Pulumi does
    (its steps in flight end and are saved; a second Ctrl-C stops it at once), and this process, which
    serves the CLI's language host and so must keep waiting. Without this, subprocess.run would kill the
    CLI 0.25 s after the first Ctrl-C, and leave its steps in flight as pending operations in the state.
    A handler, not SIG_IGN, which the CLI would inherit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run(args: list[str], stack: str, stack_file: Path | None = None, *, bump_software: bool = False,
        **popen) -> subprocess.CompletedProcess:
    """`pulumi <args> --stack <stack>` in the rehearsal; popen: subprocess.run's (capture_output, say)."""
    from localswarm import placement, pulumi_host
    pulumi, env, work = cli(), environment(), project_dir(stack, stack_file)
    makes = bool(args) and args[0] in MAKES
    settings = prepare_host(work / f"Pulumi.{stack}.yaml") if makes else {}
    subprocess.run([pulumi, "stack", "select", "--create", stack, "--non-interactive"], cwd=work, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    for key, value in settings.items():  # the rehearsal's stand-ins, in its copy only (prepare_host)
        subprocess.run([pulumi, "config", "set", "--stack", stack, "--non-interactive", key, value], cwd=work,
                       env=env, check=True, stdout=subprocess.DEVNULL)
    extra, server, source = [], None, None
    if args and args[0] in RUNS_PROGRAM:
        n = bumps(more=bump_software)
        source = pulumi_host.bumped_software(n) if n else None
        server, address = language_server()
        extra = ["--client", address]
    log = root() / "actions.jsonl"
    offset = log.stat().st_size if log.exists() else 0
    watcher = placement.DrainWatcher(nodes) if makes else None
    if watcher:
        watcher.start()
    started = time.monotonic()
    try:
        with _ctrl_c_for_the_cli():
            done = subprocess.run([pulumi, *args, "--stack", stack, "--non-interactive", *extra], cwd=work,
                                  env=env, **popen)
    finally:
        if server is not None:
            server.stop(grace=None)
        if source:
            pulumi_host.restore_software(source)
        if watcher:
            watcher.stop()
    if makes:
        (root() / "last-run.json").write_text(json.dumps({
            "stack": stack, "args": args, "returncode": done.returncode, "seconds": round(time.monotonic() - started, 1),
            "commands": _actions_since(offset), "peak_drained_per_pool": watcher.peak}, indent=1) + "\n")
    return done
