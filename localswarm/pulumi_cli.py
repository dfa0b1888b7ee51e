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
"""
from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

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
    return Path(os.environ.get("GPU_SWARM_PULUMI_ROOT", "/var/lib/localswarm/pulumi"))


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
    try:
        return bool(json.loads((root() / "world-aws.json").read_text()).get("machines"))
    except (OSError, ValueError):
        return False


def prepare_host(stack_file: Path) -> None:
    """What the machines reach, before the CLI makes any: the bridge, the registry, the S3 stand-in (as
    `program up` has them, localswarm/program.py), and the program's preview reads images from that registry."""
    import yaml
    from localswarm import node_image, program
    from localswarm.host import CLI, RehearsalError, check_host
    from localswarm.nodes import REGISTRY
    from localswarm.stack_config import config_text
    from settings import image_registry
    if program.load_state().get("resources"):
        raise RehearsalError(f"a `program up` rehearsal is up; run `{CLI} down` first")
    check_host()
    say = lambda m: print(f"rehearsal: {m}", flush=True)  # noqa: E731
    node_image.ensure_image(say)
    config = {k: config_text(v) for k, v in (yaml.safe_load(stack_file.read_text()).get("config") or {}).items()}
    program._infrastructure(config, say)
    image_registry.ENDPOINTS["docker.io"] = f"http://{REGISTRY}"


def report(stack: str) -> list[str]:
    """The rehearsal's report, from `pulumi stack output --json` (localswarm/pulumi_report.py)."""
    from localswarm import pulumi_report
    shown = subprocess.run([cli(), "stack", "output", "--json", "--stack", stack], cwd=root() / "project",
                           env=environment(), capture_output=True, text=True, check=True)
    return pulumi_report.render(json.loads(shown.stdout))


def run(args: list[str], stack: str, stack_file: Path | None = None, **popen) -> subprocess.CompletedProcess:
    """`pulumi <args> --stack <stack>` in the rehearsal; popen: subprocess.run's (capture_output, say)."""
    pulumi, env, work = cli(), environment(), project_dir(stack, stack_file)
    if args and args[0] in MAKES:
        prepare_host(work / f"Pulumi.{stack}.yaml")
    subprocess.run([pulumi, "stack", "select", "--create", stack, "--non-interactive"], cwd=work, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    extra, server = [], None
    if args and args[0] in RUNS_PROGRAM:
        server, address = language_server()
        extra = ["--client", address]
    try:
        return subprocess.run([pulumi, *args, "--stack", stack, "--non-interactive", *extra], cwd=work,
                              env=env, **popen)
    finally:
        if server is not None:
            server.stop(grace=None)
