"""The scripts the program runs on a node, and the installer its boot runs, in real bash in a scratch root.

The tools they call are stand-ins that behave like the real ones, exit codes included:
curl serves a folder as the S3 bucket (exit 22 on a missing object, 7 when it cannot
connect), systemd-run runs the installer at once (or leaves it running, to test a wait
that runs out), cloud-init answers `status` as the real one does: done once its result file
exists (which boot() writes after the installer, as cloud-init's last stage does), running
before, or what a test chooses (disabled). The
installer is the real cloud-init/install.sh and the bootstrap the real node/bootstrap.sh,
with two small steps of the test's own, bundled as the program bundles node/.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from to_node import commands as node_commands
from to_node import software as node_software
from to_node.software import SOURCE_DIR, NodeRelease
from tests.tools import require_tool

ENV = {"GPU_SWARM_IMAGE": "ubuntu", "GPU_SWARM_KIND": "NVIDIA-GPU"}
STEPS = ("step-a", "step-b")
STEP = """#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
name=$(basename "$0" .sh)
[ "${FAKE_FAIL_STEP:-}" != "$name" ] || die "E: $name broke"
if [ -e "$GPU_SWARM_STATE/$name.did" ]; then skip "$name already done"; fi
touch "$GPU_SWARM_STATE/$name.did"
log "$name did its work"
"""


class Node:
    """A scratch root, its fake tools, and a bucket folder the fake curl serves."""

    def __init__(self, tmp: Path, monkeypatch):
        self.tmp, self.root, self.bin, self.bucket = tmp, tmp / "root", tmp / "bin", tmp / "bucket"
        for d in (self.root, self.bin, self.bucket):
            d.mkdir()
        self.calls = tmp / "calls"
        self.source = tmp / "node"
        self.source.mkdir()
        for name in ("bootstrap.sh", "common.sh", "versions.env"):
            shutil.copy(node_software.SOURCE_DIR / name, self.source / name)
        for step in STEPS:
            (self.source / f"{step}.sh").write_text(STEP)
        monkeypatch.setattr(node_software, "SOURCE_DIR", self.source)
        self.fake("curl", f"""
out=""; url=""
while [ $# -gt 0 ]; do case "$1" in -o) out=$2; shift 2 ;; -*) shift ;; *) url=$1; shift ;; esac; done
[ -z "${{FAKE_CURL_RC:-}}" ] || {{ echo "curl: ($FAKE_CURL_RC) Failed to connect" >&2; exit "$FAKE_CURL_RC"; }}
src={self.bucket}/"${{url##*/}}"
[ -f "$src" ] || {{ echo "curl: (22) The requested URL returned error: 404" >&2; exit 22; }}
cp "$src" "$out" """)
        self.fake("systemd-run", f"""
[ "${{FAKE_INSTALL:-run}}" != hang ] || {{ touch {tmp}/unit-active; exit 0; }}
while [ $# -gt 0 ] && [ "${{1#-}}" != "$1" ]; do case "$1" in --unit) shift 2 ;; *) shift ;; esac; done
"$@" >/dev/null 2>&1 || true""")
        self.fake("systemctl", f'case "$1" in is-active) [ -e {tmp}/unit-active ] ;; *) exit 0 ;; esac')
        result = self.path(node_commands.CLOUD_INIT_RESULT)
        self.fake("cloud-init", f"""[ "$1" = status ] || exit 2
if [ -n "${{FAKE_CLOUD_INIT_STATUS:-}}" ]; then echo "status: $FAKE_CLOUD_INIT_STATUS";
elif [ -e {result} ]; then echo "status: done"; else echo "status: running"; fi""")
        self.fake("docker", "exit 0")
        self.sha = self.publish()

    def fake(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >>{self.calls}\n{body}\n')
        path.chmod(0o755)

    def path(self, node_path: str) -> Path:
        return Path(str(self.root) + node_path)

    def publish(self) -> str:
        """The bundle of the test's node/ folder, in the fake bucket; returns its sha256."""
        sha = node_software.bundle_sha256()
        (self.bucket / f"{sha}.tar").write_bytes(node_software.bundle())
        return sha

    def release(self, env: dict | None = None, sha: str | None = None) -> NodeRelease:
        sha = sha or self.sha
        return NodeRelease(f"https://b.s3.us-east-1.amazonaws.com/node-software/{sha}.tar", sha, env or ENV, STEPS)

    def env(self, **extra: str) -> dict:
        p = self.path
        return {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}",
                "GPU_SWARM_RELEASE_ENV": str(p(node_software.RELEASE_ENV_PATH)),
                "GPU_SWARM_SOFTWARE": str(p(node_software.SOFTWARE_DIR)), "GPU_SWARM_STATE": str(p(node_software.STATE_DIR)),
                "GPU_SWARM_LOG": str(p(node_software.BOOTSTRAP_LOG)),
                "GPU_SWARM_VERSIONS": str(p(node_software.NODE_VERSIONS_ENV)),
                "GPU_SWARM_NODE_ENV": str(p(node_software.NODE_ENV_PATH)), **extra}

    def boot(self, release: NodeRelease | None = None, **extra: str) -> subprocess.CompletedProcess:
        """What cloud-init does at first boot: install, then end its last stage (the result file),
        whether the install failed or not."""
        installed = self.install(release, **extra)
        self.cloud_init_ended()
        return installed

    def install(self, release: NodeRelease | None = None, **extra: str) -> subprocess.CompletedProcess:
        """cloud-init's part of the boot that runs the node's install: write the release's files, run the installer."""
        for f in (release or self.release()).files():
            target = self.path(f.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(f.content)
            target.chmod(int(f.mode, 8))
        return subprocess.run([str(self.path(node_software.INSTALLER_PATH))], capture_output=True, text=True,
                              env=self.env(**extra), timeout=60)

    def cloud_init_ended(self) -> None:
        result = self.path(node_commands.CLOUD_INIT_RESULT)
        result.parent.mkdir(parents=True, exist_ok=True)
        result.write_text(json.dumps({"v1": {"datasource": "DataSourceEc2", "errors": []}}))

    def run(self, script: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=self.env(**extra), timeout=60)

    def wait(self, ask_every_s: int = 30, **extra: str) -> subprocess.CompletedProcess:
        return self.run(node_commands.wait_for_boot(env=ENV, expected_gpus=0, root=str(self.root),
                                                    install_timeout_s=2, ask_every_s=ask_every_s), **extra)

    def upgrade(self, release: NodeRelease, **extra: str) -> subprocess.CompletedProcess:
        return self.run(node_commands.upgrade(release, expected_gpus=0, root=str(self.root), timeout_s=2), **extra)

    def installs(self) -> int:
        return sum(line.startswith("systemd-run ") for line in self.calls.read_text().splitlines()) \
            if self.calls.exists() else 0

    def did(self, step: str) -> bool:
        return self.path(f"{node_software.STATE_DIR}/{step}.did").exists()


@pytest.fixture
def node(tmp_path, monkeypatch) -> Node:
    return Node(tmp_path, monkeypatch)


# ---------------------------------------------------------------- the installer (cloud-init/install.sh)


def test_the_installer_downloads_checks_installs_and_applies_the_release(node):
    release = node.release()
    result = node.boot(release)
    assert result.returncode == 0, result.stderr
    installed = node.path(node_software.SOFTWARE_DIR)
    assert node_software.software_hash(installed) == node_software.software_hash(node.source)
    assert (installed / ".bundle").read_text().strip() == node.sha
    assert node.path(node_software.APPLIED).read_text().strip() == release.id
    assert node.path(node_software.BOOTSTRAP_DONE).exists() and node.did("step-a") and node.did("step-b")
    timings = json.loads(node.path(node_software.INSTALL_TIMINGS).read_text())
    assert timings["fetch-bundle"]["status"] == "done"


def test_a_second_install_keeps_the_bundle_and_its_steps_skip_their_done_work(node):
    assert node.boot().returncode == 0
    result = node.boot()
    assert result.returncode == 0, result.stderr
    assert "is installed" in result.stderr
    assert json.loads(node.path(node_software.INSTALL_TIMINGS).read_text())["fetch-bundle"]["status"] == "skipped"
    steps = json.loads(node.path(node_software.BOOTSTRAP_TIMINGS).read_text())
    assert {s["status"] for s in steps.values()} == {"skipped"}


def test_a_bundle_that_is_not_the_pinned_one_never_runs(node):
    tampered = node.bucket / f"{node.sha}.tar"
    tampered.write_bytes(tampered.read_bytes().replace(b"did its work", b"rm -rf / now"))
    result = node.boot()
    assert result.returncode == 1
    assert f"expected {node.sha}" in result.stderr
    assert not node.path(node_software.SOFTWARE_DIR).exists() and not node.did("step-a")
    assert node.path(node_software.BOOTSTRAP_FAILED).read_text().strip() == "fetch-bundle"


@pytest.mark.parametrize("curl_rc, missing, message", [("7", False, "cannot download"), ("", True, "cannot download")])
def test_a_bundle_it_cannot_download_fails_the_install_and_says_from_where(node, curl_rc, missing, message):
    if missing:
        (node.bucket / f"{node.sha}.tar").unlink()
    result = node.boot(FAKE_CURL_RC=curl_rc) if curl_rc else node.boot()
    assert result.returncode == 1 and message in result.stderr and "https://b.s3" in result.stderr
    assert node.path(node_software.BOOTSTRAP_FAILED).read_text().strip() == "fetch-bundle"


def test_a_failed_step_fails_the_install_and_names_the_step(node):
    result = node.boot(FAKE_FAIL_STEP="step-b")
    assert result.returncode == 1
    assert node.path(node_software.BOOTSTRAP_FAILED).read_text().strip() == "step-b"
    assert not node.path(node_software.APPLIED).exists()
    assert "E: step-b broke" in node.path(node_software.BOOTSTRAP_LOG).read_text()


def test_the_installer_passes_shellcheck():
    require_tool("shellcheck")
    proc = subprocess.run(["shellcheck", str(node_software.CLOUD_INIT_DIR / "install.sh")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout


# ---------------------------------------------------------------- wait_for_boot


def _cloud_init_status(node: Node, *, errors=()) -> None:
    path = node.path(node_commands.CLOUD_INIT_STATUS)
    path.parent.mkdir(parents=True, exist_ok=True)
    stages = {s: {"start": 100.0, "finished": 100.5, "errors": []} for s in ("init-local", "init", "modules-config")}
    stages["modules-final"] = {"start": 101.0, "finished": 142.25, "errors": list(errors)}
    path.write_text(json.dumps({"v1": {**stages, "stage": None}}))


def test_a_good_boot_reports_its_steps_and_cloud_inits_time(node):
    assert node.boot().returncode == 0
    _cloud_init_status(node)
    result = node.wait()
    assert result.returncode == 0, result.stderr
    # First the release the node runs (what the program compares with its rollout's), then the timings.
    release, line = result.stdout.splitlines()
    assert node_commands.ran_release(result.stdout) == node.release().id and release == f"release {node.release().id}"
    timings = json.loads(line)
    assert set(timings) == {"fetch-bundle", "step-a", "step-b", "cloud-init"}
    assert timings["cloud-init"] == {"seconds": 42.25, "status": "done"}
    assert node.installs() == 0


@pytest.mark.parametrize("errors, said", [((), None), (("x failed",), "cloud-init reported errors")])
def test_cloud_init_errors_do_not_fail_a_good_install(node, errors, said):
    """Only the install's own markers decide; cloud-init's own errors are said."""
    assert node.boot().returncode == 0
    _cloud_init_status(node, errors=errors)
    result = node.wait()
    assert result.returncode == 0, result.stderr
    assert (said in result.stderr) if said else "cloud-init" not in result.stderr


def test_a_boot_that_outlives_the_wait_says_so(node):
    result = node.run(node_commands.wait_for_boot(env=ENV, expected_gpus=0, root=str(node.root), timeout_s=1))
    assert result.returncode == 1 and "still running after" in result.stderr


def test_the_wait_ends_when_cloud_init_ends_its_last_stage(node):
    """Polled every 0.1 s: the real `cloud-init status --wait` returned 0.3-0.5 s after the end."""
    assert node.install().returncode == 0  # cloud-init's last stage has not ended yet
    waiting = subprocess.Popen(["bash", "-c", node_commands.wait_for_boot(env=ENV, expected_gpus=0, root=str(node.root))],
                               env=node.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1)
    assert waiting.poll() is None  # cloud-init still running
    ended = time.monotonic()
    node.cloud_init_ended()
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 0, err
    assert time.monotonic() - ended < 2
    assert set(json.loads(out.splitlines()[-1])) == {"fetch-bundle", "step-a", "step-b"}


def test_a_cloud_init_that_will_never_end_its_last_stage_ends_the_wait(node):
    """Disabled (or crashed): no result file ever; cloud-init itself is asked every ask_every_s (30 s)."""
    started = time.monotonic()
    result = node.wait(ask_every_s=2, FAKE_CLOUD_INIT_STATUS="disabled")
    assert result.returncode == 1 and "the gpu-swarm install never ran" in result.stderr
    assert 1 <= time.monotonic() - started < 10  # bash's SECONDS ticks with the wall clock's whole seconds


def test_the_wait_asks_cloud_init_itself_only_every_ask_every_s(node):
    """One `cloud-init status` took 0.3-0.65 CPU-s of the boot the wait waits for: not every 0.1 s, nor every 5 s."""
    assert node.install().returncode == 0
    waiting = subprocess.Popen(["bash", "-c", node_commands.wait_for_boot(env=ENV, expected_gpus=0, root=str(node.root),
                                                                          ask_every_s=2)],
                               env=node.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(5)
    node.cloud_init_ended()
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 0, err
    asked = [line for line in node.calls.read_text().splitlines() if line.startswith("cloud-init status")]
    assert 1 <= len(asked) <= 3, asked  # at 2 s and 4 s (bash's SECONDS counts whole seconds)
    default = node_commands.wait_for_boot(env=ENV, expected_gpus=0)
    assert "ask=$((SECONDS + 30))" in default


def test_a_failed_boot_fails_with_the_nodes_log_and_the_next_up_installs_again(node):
    assert node.boot(FAKE_FAIL_STEP="step-b").returncode == 1
    first = node.wait()
    assert first.returncode == 1
    assert "the first boot failed: step step-b failed" in first.stderr and "E: step-b broke" in first.stderr
    assert "last 40 lines of /var/log/gpu-swarm/bootstrap.log" in first.stderr
    assert node.installs() == 0  # the first report only reports
    again = node.wait()  # the cause was fixed: the next `pulumi up`
    assert again.returncode == 0, again.stderr
    assert "retrying the install that failed at first boot" in again.stderr and node.installs() == 1
    assert node.did("step-b")


def test_a_boot_whose_install_never_ran_says_where_to_look(node):
    node.cloud_init_ended()  # cloud-init ran, without the user data
    result = node.wait()
    assert result.returncode == 1 and "the gpu-swarm install never ran" in result.stderr
    assert node_commands.CLOUD_INIT_LOG in result.stderr


def test_an_image_without_cloud_init_is_named(node):
    (node.bin / "cloud-init").unlink()
    bare = {**node.env(), "PATH": str(node.bin)}  # nothing but the fakes: no cloud-init at all
    result = subprocess.run(["/bin/bash", "-c", node_commands.wait_for_boot(env=ENV, expected_gpus=0,
                                                                           root=str(node.root))],
                            capture_output=True, text=True, env=bare)
    assert result.returncode == 1 and "this image has no cloud-init" in result.stderr


def test_a_node_advertising_the_wrong_gpu_count_fails(node):
    assert node.boot().returncode == 0
    daemon = node.path("/etc/docker/daemon.json")
    daemon.parent.mkdir(parents=True)
    daemon.write_text(json.dumps({"node-generic-resources": []}))
    env = {**ENV, "GPU_SWARM_SLOTS_PER_GPU": "4", "GPU_SWARM_SHARED_KIND": "NVIDIA-GPU-SHARED"}
    result = node.run(node_commands.wait_for_boot(env=env, expected_gpus=2, root=str(node.root)))
    assert result.returncode == 1 and "node advertises 0 NVIDIA-GPU-SHARED resources" in result.stderr
    assert "expected 8" in result.stderr


# ---------------------------------------------------------------- upgrade


def test_a_node_that_booted_with_the_release_only_says_so(node):
    release = node.release()
    assert node.boot(release).returncode == 0
    result = node.upgrade(release)
    assert result.returncode == 0, result.stderr
    assert f"this node runs release {release.id[:12]}" in result.stderr and node.installs() == 0


def test_an_upgrade_writes_what_the_boot_wrote_and_runs_the_same_installer(node):
    first = node.release()
    assert node.boot(first).returncode == 0
    (node.source / "step-a.sh").write_text(STEP + "# version 2\n")
    node.path(f"{node_software.STATE_DIR}/step-a.did").unlink()
    second = node.release(env={**ENV, "GPU_SWARM_SPOT": "true"}, sha=node.publish())
    result = node.upgrade(second)
    assert result.returncode == 0, result.stderr
    assert node.installs() == 1
    for f in second.files():
        assert node.path(f.path).read_text() == f.content, f.path
    assert node.path(node_software.APPLIED).read_text().strip() == second.id
    assert "# version 2" in node.path(f"{node_software.SOFTWARE_DIR}/step-a.sh").read_text()
    assert json.loads(result.stdout)["step-a"]["status"] == "done"
    # Its log reached `pulumi up` as it went.
    assert "  | " in result.stderr and "step-a did its work" in result.stderr


def test_a_failed_upgrade_fails_with_the_log_and_keeps_the_old_release_applied(node):
    first = node.release()
    assert node.boot(first).returncode == 0
    second = node.release(env={**ENV, "GPU_SWARM_SPOT": "true"})
    result = node.upgrade(second, FAKE_FAIL_STEP="step-b")
    assert result.returncode == 1
    assert "the upgrade failed: step step-b failed" in result.stderr and "E: step-b broke" in result.stderr
    assert node.path(node_software.APPLIED).read_text().strip() == first.id
    assert node.upgrade(second).returncode == 0  # the next `pulumi up`


def test_an_upgrade_that_outlives_its_wait_fails_clearly_and_a_second_waits_for_it(node):
    assert node.boot().returncode == 0
    second = node.release(env={**ENV, "GPU_SWARM_SPOT": "true"})
    result = node.upgrade(second, FAKE_INSTALL="hang")
    assert result.returncode == 1 and "run pulumi up again to wait for it" in result.stderr
    again = node.upgrade(second, FAKE_INSTALL="hang")
    assert "already running; waiting for it" in again.stderr and node.installs() == 1


PRICE = node_software.price_env(3.6726, market="spot", date="2026-12-01T21:24:00Z", instance_type="g6e.12xlarge",
                                gpus=4)


@pytest.mark.parametrize("script", ["wait", "upgrade", "health", "health-price", "price"])
def test_the_node_scripts_pass_shellcheck(script, node):
    require_tool("shellcheck")
    from settings import Health
    text = {"wait": lambda: node_commands.wait_for_boot(env=ENV, expected_gpus=1),
            "upgrade": lambda: node_commands.upgrade(node.release(), expected_gpus=1),
            "health": lambda: node_commands.health_settings(Health().node_env()),
            "health-price": lambda: node_commands.health_settings(Health().node_env(), price=PRICE),
            "price": lambda: node_commands.price_settings(PRICE)}[script]()
    proc = subprocess.run(["shellcheck", "-s", "bash", "-"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("script", ["wait", "upgrade", "health", "price"])
def test_every_path_the_scripts_write_carries_the_root_prefix(node, script):
    """So these tests, run as root, touch only their scratch folder and never this machine's /etc."""
    from settings import Health
    text = {"wait": lambda: node_commands.wait_for_boot(env=ENV, expected_gpus=0, root="/ROOT"),
            "upgrade": lambda: node_commands.upgrade(node.release(), expected_gpus=0, root="/ROOT"),
            "health": lambda: node_commands.health_settings(Health().node_env(), root="/ROOT", price=PRICE),
            "price": lambda: node_commands.price_settings(PRICE, root="/ROOT")}[script]()
    text = re.sub(r"<<'(\w+)'\n.*?\n\1\n", "", text, flags=re.S)  # heredoc bodies are content, not writes
    writes = re.findall(r"(?:>|mkdir -p|mv|touch|rm -f|chmod \d+|cat|tail -n \S+|systemd-run .*?) \"?(?:\$\(dirname )?"
                        r"'?(/[\w./-]+)", text)
    assert writes, "the pattern finds the writes"
    assert [w for w in writes if not w.startswith("/ROOT/")] == []


# ---------------------------------------------------------------- health settings, apart from node.env


def _health(node: Node, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", node_commands.health_settings(env, root=str(node.root))], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PATH": f"{node.bin}:{os.environ['PATH']}"})


def test_health_settings_restart_the_health_services_only_when_they_change(node):
    from settings import Health
    first = _health(node, Health().node_env())
    assert first.returncode == 0 and first.stdout.strip() == "changed", first.stderr
    written = node.path(node_software.HEALTH_ENV_PATH).read_text()
    assert "HEALTH_INTERVAL_SECONDS=10\n" in written and "HEALTH_IGNORE_XIDS=\n" in written
    assert "systemctl try-restart gpu-swarm-health.service" in node.calls.read_text()
    # Only the units this node has: here the watcher (a GPU node).
    node.fake("systemctl", '[ "$1 $2" != "cat gpu-swarm-reconciler.service" ]')
    node.calls.unlink()
    assert _health(node, Health(ignore_xids=(94, 95)).node_env()).stdout.strip() == "changed"
    assert "HEALTH_IGNORE_XIDS=94,95\n" in node.path(node_software.HEALTH_ENV_PATH).read_text()
    assert node.calls.read_text().splitlines() == [
        "systemctl cat gpu-swarm-health.service", "systemctl try-restart gpu-swarm-health.service",
        "systemctl cat gpu-swarm-reconciler.service"]
    again = _health(node, Health(ignore_xids=(94, 95)).node_env())
    assert again.stdout.strip() == "unchanged" and len(node.calls.read_text().splitlines()) == 3
    assert [p.name for p in node.path(node_software.HEALTH_ENV_PATH).parent.iterdir()] == ["health.env"]


def test_a_gpu_nodes_price_goes_with_its_health_settings_and_a_new_price_restarts_nothing(node):
    from settings import Health
    cost = node.path(node_software.COST_ENV_PATH)
    first = subprocess.run(["bash", "-c", node_commands.health_settings(Health().node_env(), root=str(node.root),
                                                                        price=PRICE)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PATH": f"{node.bin}:{os.environ['PATH']}"})
    assert first.returncode == 0 and first.stdout.split("\n")[:2] == ["price changed", "changed"], first.stderr
    assert "GPU_SWARM_PRICE_PER_HOUR=3.6726\n" in cost.read_text() and "GPU_SWARM_PRICE_GPUS=4\n" in cost.read_text()
    node.calls.unlink()
    moved = {**PRICE, "GPU_SWARM_PRICE_PER_HOUR": "3.9104"}  # the next day's spot price
    second = subprocess.run(["bash", "-c", node_commands.health_settings(Health().node_env(), root=str(node.root),
                                                                         price=moved)],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{node.bin}:{os.environ['PATH']}"})
    assert second.stdout.split("\n")[:2] == ["price changed", "unchanged"] and not node.calls.exists()
    assert "GPU_SWARM_PRICE_PER_HOUR=3.9104\n" in cost.read_text()
    alone = subprocess.run(["bash", "-c", node_commands.price_settings(moved, root=str(node.root))],
                           capture_output=True, text=True, timeout=60)
    assert alone.stdout == "price unchanged\n" and sorted(p.name for p in cost.parent.iterdir()) == [
        "cost.env", "health.env"]


def test_health_settings_are_what_the_watcher_and_the_reconciler_read():
    """The values the program writes parse, as environment defaults, in both node programs."""
    import importlib.util
    import sys
    from settings import Health
    env = Health(ignore_xids=(94, 95), critical_xids=(43,), check_interval_s=5, recovery_s=60,
                 max_drained_percent=25).node_env()
    sys.path.insert(0, str(SOURCE_DIR))
    try:
        programs = {}
        for name in ("gpu_health", "swarm_reconciler"):
            spec = importlib.util.spec_from_file_location(f"{name}_env_check", SOURCE_DIR / f"{name}.py")
            programs[name] = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = programs[name]
            spec.loader.exec_module(programs[name])
    finally:
        sys.path.remove(str(SOURCE_DIR))
    watcher = programs["gpu_health"].parse_args([], env=env)
    assert (watcher.ignore_xids, watcher.critical_xids, watcher.interval, watcher.recovery_seconds) == (
        frozenset({94, 95}), frozenset({43}), 5, 60)
    assert programs["swarm_reconciler"].parse_args([], env=env).max_drained_percent == 25


def test_health_units_read_health_env():
    for unit in node_software.HEALTH_UNITS:
        assert f"EnvironmentFile=-{node_software.HEALTH_ENV_PATH}" in (SOURCE_DIR / unit).read_text()


def test_health_settings_pass_shellcheck():
    require_tool("shellcheck")
    from settings import Health
    proc = subprocess.run(["shellcheck", "-s", "bash", "-"], input=node_commands.health_settings(Health().node_env()),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# ---------------------------------------------------------------- who may log in


KEY_A = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAAAA pulumi"
KEY_B = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBBBB next@laptop"


def test_authorized_keys_become_exactly_the_given_keys(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-rsa AAAAold stale@key\n")
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name, body in (("getent", f'echo "ubuntu:x:1000:1000::{home}:/bin/bash"'), ("id", "echo ubuntu"),
                       ("install", "exit 0"), ("chown", "exit 0")):
        (fakes / name).write_text(f"#!/bin/sh\n{body}\n")
        (fakes / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fakes}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", node_commands.authorize_keys("ubuntu", [KEY_A, KEY_B, KEY_A])], env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    keys = home / ".ssh" / "authorized_keys"
    assert keys.read_text() == f"{KEY_A}\n{KEY_B}\n"
    assert oct(keys.stat().st_mode & 0o777) == "0o600"
    assert "2 key(s) may log in as ubuntu" in result.stdout


@pytest.mark.parametrize("user, keys, message", [
    ("root; reboot", [KEY_A], "not a Linux user name"),
    ("ubuntu", [], "at least one public key"),
    ("ubuntu", ["ssh-ed25519 AAAA\nssh-rsa BBBB"], "expected one OpenSSH public key line"),
    ("ubuntu", ["-----BEGIN OPENSSH PRIVATE KEY-----"], "expected one OpenSSH public key line"),
])
def test_bad_keys_are_refused(user, keys, message):
    with pytest.raises(ValueError, match=message):
        node_commands.authorize_keys(user, keys)




def test_a_key_comment_with_any_character_passes_preview_and_the_node_alike():
    """One rule for a public key line (settings.config_checks.public_key_problem): what preview
    accepts, the node's authorized_keys script accepts too, quotes and backslashes included."""
    from settings.config_checks import public_key_problem
    for comment in ("o'brien@laptop", 'a "quoted" one', "back\\slash", "ünïcode"):
        key = f"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAAAA {comment}"
        assert public_key_problem(key) is None, comment
        node_commands.authorize_keys("ubuntu", [key])  # raises if refused
