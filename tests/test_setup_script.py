"""scripts/setup.sh, localswarm/install-engine.sh and scripts/test.sh run for real in bash, in a
copy of the repo's layout under tmp_path with fake apt-get, pip, dpkg-deb and dockerd on PATH:
each step says when it starts and ends, how much it downloads, and why it failed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from to_node.software import min_versions

PINNED = min_versions()["DOCKER_VERSION"]
REPO = Path(__file__).resolve().parent.parent
COPIED = ("scripts/setup.sh", "scripts/steps.sh", "scripts/test.sh", "localswarm/install-engine.sh",
          "node/versions.env", "requirements.txt", "tools/pulumi/VERSION")
PULUMI = (REPO / "tools" / "pulumi" / "VERSION").read_text().strip()
STEP_END = re.compile(r"^(\w+): (\[\d/\d\] .+): (done|skipped) in (\d+\.\d) s")


class Checkout:
    """The scripts in a fake checkout, with a bin of fakes in front of the real PATH."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.prefix = root / "engine"
        for name in COPIED:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, root / name)
        self.env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}",
                    "GPU_SWARM_ENGINE_PREFIX": str(self.prefix)}
        self.fake("id", "echo 0")  # setup wants root; the fakes need none
        self.fake("dpkg-query", "echo 'install ok installed'")
        self.fake("dockerd", 'echo "Docker version 20.10.24+dfsg1, build 297e128"')  # too old
        self.fake("pulumi", f'echo "v{PULUMI}"')  # the user's own CLI, of the pinned version
        # The kernel's limits, as `sysctl -n` prints them (high enough unless a test says otherwise); a write is
        # only recorded. Its file goes under the checkout, not /etc.
        self.fake("sysctl", f"""if [ "$1" = -n ]; then case "$2" in
    *instances) echo "${{FAKE_INOTIFY_INSTANCES:-8192}}" ;; *) echo "${{FAKE_INOTIFY_WATCHES:-1048576}}" ;; esac
  else echo "sysctl $*" >> "{root}/sysctl.calls"; fi""")
        self.env["GPU_SWARM_SYSCTL_DIR"] = str(root / "sysctl.d")

    def fake(self, command: str, body: str, folder: Path | None = None) -> None:
        path = (folder or self.bin) / command
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)

    def engine(self, version: str = PINNED + "+dfsg4") -> None:
        """A new enough engine already unpacked under the prefix."""
        self.fake("dockerd", f'echo "Docker version {version}, build 411e817"', self.prefix / "usr" / "sbin")

    def venv(self, pip_body: str) -> None:
        self.fake("python", "true", self.root / ".venv" / "bin")
        self.fake("pip", pip_body, self.root / ".venv" / "bin")

    def run(self, script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(self.root / script), *args], env={**self.env, **(env or {})}, cwd=self.root,
                              capture_output=True, text=True, timeout=60)


@pytest.fixture
def checkout(tmp_path) -> Checkout:
    return Checkout(tmp_path)


def bash(script: str) -> subprocess.CompletedProcess:
    """SCRIPT after `set -euo pipefail` and steps.sh, as the setup scripts run."""
    return subprocess.run(["bash", "-c", f'set -euo pipefail\n. "{REPO}/scripts/steps.sh"\n'
                                         f"STEP_PREFIX=t STEP_COUNT=2\n{script}"],
                          capture_output=True, text=True, timeout=30)


def step_ends(output: str) -> list[tuple[str, str, str, float]]:
    return [(m[1], m[2], m[3], float(m[4])) for m in map(STEP_END.match, output.splitlines()) if m]


def test_steps_say_when_they_start_and_end_with_their_duration():
    result = bash('step_begin "first"\nsleep 0.3\nstep_done\nstep_begin "second"\nstep_skipped "already there"')
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "t: [1/2] first ..."
    assert lines[2] == "t: [2/2] second ..."
    assert re.fullmatch(r"t: \[2/2\] second: skipped in 0\.\d s \(already there\)", lines[3])
    (_, _, status, seconds), _ = step_ends(result.stdout)
    assert status == "done" and 0.3 <= seconds < 5


def test_quietly_passes_on_only_the_lines_asked_for():
    result = bash('step_begin "apt"\n'
                  "quietly --show '^Need to get' sh -c 'echo Unpacking x; echo Need to get 37.7 MB of archives.'\n"
                  "step_done")
    assert result.returncode == 0, result.stderr
    assert "t:   Need to get 37.7 MB of archives." in result.stdout.splitlines()
    assert "Unpacking" not in result.stdout + result.stderr


def test_quietly_shows_a_failing_commands_whole_output_and_stops_the_script():
    result = bash('step_begin "apt"\n'
                  "quietly --show '^Need' sh -c 'echo Need to get 1 MB; echo Unpacking x; echo E: broken >&2; exit 100'\n"
                  'echo "not reached"')
    assert result.returncode == 100
    assert "not reached" not in result.stdout
    assert "t:   Need to get 1 MB" in result.stdout
    assert re.search(r"t: \[1/2\] apt: failed in \d+\.\d s: .* exited with 100; its output:", result.stderr)
    assert "    Unpacking x" in result.stderr and "    E: broken" in result.stderr


def test_setup_reports_each_step_and_what_it_downloads(checkout):
    checkout.fake("dpkg-query", '[ "$3" = shellcheck ] || echo "install ok installed"')
    checkout.fake("apt-get", """echo "Reading package lists..."
case " $* " in *" install "*) echo "Need to get 1,234 kB of archives."
  echo "After this operation, 5,120 kB of additional disk space will be used."
  echo "Unpacking shellcheck (0.9.0-1) ..." ;; esac""")
    # No .venv yet: `python3 -m venv` makes one, with a pip that downloads two files.
    checkout.fake("pip", """echo "Collecting pulumi<4,>=3.200"
echo "  Downloading pulumi_aws-7.51.1-py3-none-any.whl (13.0 MB)"
echo "  Downloading iniconfig-2.3.1-py3-none-any.whl (7.6 kB)"
echo "  Using cached grpcio-1.85.1-cp311-cp311-manylinux2014_x86_64.whl (7.4 MB)"
echo "Successfully installed grpcio iniconfig pulumi_aws"
""", checkout.root)
    checkout.fake("python3", '[ "$*" = "-m venv .venv" ] && mkdir -p .venv/bin && cp pip .venv/bin/ && '
                             'ln -s /bin/true .venv/bin/python')
    checkout.engine()

    result = checkout.run("scripts/setup.sh")

    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "setup:   installing shellcheck" in lines
    assert "setup:   Need to get 1,234 kB of archives." in lines
    assert "setup:   After this operation, 5,120 kB of additional disk space will be used." in lines
    assert "setup:   created .venv" in lines
    assert "setup:   downloaded 2 files, 13.0 MB (and 1 files, 7.4 MB, from pip's cache)" in lines
    assert "Unpacking" not in result.stdout and "Reading package lists" not in result.stdout
    assert [(title, status) for _, title, status, _ in step_ends(result.stdout)] == [
        ("[1/6] Debian packages", "done"),
        ("[2/6] Python packages (requirements.txt) into .venv", "done"),
        (f"[3/6] Docker Engine {PINNED}", "skipped"),
        ("[4/6] rehearsal node image (Debian trixie, mmdebstrap)", "skipped"),
        (f"[5/6] Pulumi CLI {PULUMI} (its Go module, tools/pulumi/go.mod) into .tools/bin", "skipped"),
        ("[6/6] kernel limits for the rehearsal's machines (fs.inotify)", "skipped")]
    assert f"{checkout.bin}/pulumi is {PULUMI}" in result.stdout
    assert re.fullmatch(r"setup: done in \d+\.\d s", lines[-1])


def test_setup_says_what_it_skips(checkout):
    checkout.fake("apt-get", "exit 1")  # never called: everything is installed
    checkout.venv('echo "Requirement already satisfied: pulumi<4,>=3.200 in ./.venv/lib/python3.11/site-packages"')
    checkout.engine()

    result = checkout.run("scripts/setup.sh")

    assert result.returncode == 0, result.stdout + result.stderr
    assert [status for _, _, status, _ in step_ends(result.stdout)] == ["skipped"] * 6
    assert "fs.inotify.max_user_instances 8192, max_user_watches 1048576" in result.stdout
    assert f"{checkout.prefix}/usr/sbin/dockerd is Docker version {PINNED}+dfsg4" in result.stdout


def test_setup_builds_the_node_image_and_says_how_long_and_how_big(checkout):
    checkout.fake("apt-get", "exit 1")
    checkout.engine()
    # .venv's python: pip is satisfied; the image is not built (--check exits 1), then builds.
    checkout.fake("pip", 'echo "Requirement already satisfied: pulumi"', checkout.root / ".venv" / "bin")
    checkout.fake("python", """case "$*" in
  "-m localswarm.node_image --check") exit 1 ;;
  "-m localswarm.node_image")
    echo "base: mmdebstrap Debian trixie with 19 packages and their dependencies ..."
    echo "I: downloading packages with apt..."
    echo "base: done in 26.9 s, 475 MB in /var/cache/gpu-swarm/node-image/base-1"
    echo "node image ready in 27.5 s: node-2 over base-1, 475 MB in /var/cache/gpu-swarm/node-image" ;;
esac""", checkout.root / ".venv" / "bin")

    result = checkout.run("scripts/setup.sh")

    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "setup:   base: done in 26.9 s, 475 MB in /var/cache/gpu-swarm/node-image/base-1" in lines
    assert "I: downloading" not in result.stdout
    assert step_ends(result.stdout)[-3][1:3] == ("[4/6] rehearsal node image (Debian trixie, mmdebstrap)", "done")


def test_setup_shows_why_the_node_image_failed(checkout):
    checkout.fake("apt-get", "exit 1")
    checkout.engine()
    checkout.fake("pip", 'echo "Requirement already satisfied: pulumi"', checkout.root / ".venv" / "bin")
    checkout.fake("python", """case "$*" in
  *--check) exit 1 ;;
  *) echo "node image: mmdebstrap failed (exit 1); the end of base-1.log:"; echo "E: Release file expired"; exit 1 ;;
esac""", checkout.root / ".venv" / "bin")
    result = checkout.run("scripts/setup.sh")
    assert result.returncode == 1
    assert "    E: Release file expired" in result.stderr
    assert re.search(r"\[4/6\] rehearsal node image .*: failed in", result.stderr)


def test_setup_raises_the_inotify_limits_a_machine_boots_with_and_keeps_them(checkout):
    """At Linux's default 128 inotify instances per user, a rehearsal machine's PID 1 found none left in CI
    and exited; setup raises the low limit only, at once and in sysctl.d for the next boot."""
    _ready(checkout)
    result = checkout.run("scripts/setup.sh", env={"FAKE_INOTIFY_INSTANCES": "128"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert step_ends(result.stdout)[-1][1:3] == ("[6/6] kernel limits for the rehearsal's machines (fs.inotify)", "done")
    assert (checkout.root / "sysctl.calls").read_text() == "sysctl -w fs.inotify.max_user_instances=1024\n"
    kept = (checkout.root / "sysctl.d" / "90-gpu-swarm-rehearsal.conf").read_text().splitlines()
    assert kept[1:] == ["fs.inotify.max_user_instances=1024"] and kept[0].startswith("# scripts/setup.sh")


def _ready(checkout: Checkout) -> None:
    """Steps 1 to 4 have nothing to do."""
    checkout.fake("apt-get", "exit 1")
    checkout.venv('echo "Requirement already satisfied: pulumi"')
    checkout.engine()


def test_setup_builds_the_pinned_cli_from_its_go_module_and_then_skips_it(checkout):
    _ready(checkout)
    checkout.fake("pulumi", 'echo "v3.100.0"')  # a user's CLI of another version is left alone
    # go build, as the real one is called: in the tools module, -o the binary, the version stamped by -X.
    checkout.fake("go", f"""echo "go $*" >> "{checkout.root}/go.calls"; pwd >> "{checkout.root}/go.calls"
[ "$1" = build ] || exit 2
out=""; version=""
while [ $# -gt 0 ]; do case "$1" in -o) out=$2; shift ;; *Version=*) version=${{1##*Version=}} ;; esac; shift; done
echo "go: downloading github.com/pulumi/pulumi/pkg/v3 v{PULUMI}"
printf '#!/bin/sh\necho %s\n' "$version" > "$out"; chmod +x "$out"
""")
    first = checkout.run("scripts/setup.sh")
    assert first.returncode == 0, first.stdout + first.stderr
    assert step_ends(first.stdout)[-2][1:3] == (
        f"[5/6] Pulumi CLI {PULUMI} (its Go module, tools/pulumi/go.mod) into .tools/bin", "done")
    assert re.search(rf"setup:   .tools/bin/pulumi: v{re.escape(PULUMI)}, \S+", first.stdout)
    calls = (checkout.root / "go.calls").read_text().splitlines()
    assert calls[0].startswith("go build -trimpath") and calls[0].endswith("github.com/pulumi/pulumi/pkg/v3/cmd/pulumi")
    assert calls[1] == str(checkout.root / "tools" / "pulumi")
    assert "go: downloading" not in first.stdout  # Go's own lines stay in the log
    second = checkout.run("scripts/setup.sh")
    assert f".tools/bin/pulumi is {PULUMI}" in second.stdout
    assert len((checkout.root / "go.calls").read_text().splitlines()) == 2  # not built again


def test_setup_shows_why_the_cli_build_failed(checkout):
    _ready(checkout)
    checkout.fake("pulumi", "exit 127")
    checkout.fake("go", 'echo "go: github.com/pulumi/pulumi/pkg/v3@v3.0.0: reading https://proxy.golang.org: 403 Forbidden"'
                        "; exit 1")
    result = checkout.run("scripts/setup.sh")
    assert result.returncode == 1
    assert "403 Forbidden" in result.stderr
    assert re.search(r"\[5/6\] Pulumi CLI .*: failed in", result.stderr)


def test_setup_stops_with_pips_output_when_pip_fails(checkout):
    checkout.venv('echo "ERROR: No matching distribution found for pulumi<4,>=3.200"; exit 1')
    result = checkout.run("scripts/setup.sh")
    assert result.returncode == 1
    assert "No matching distribution found" in result.stderr
    assert "Docker Engine" not in result.stdout


def fake_forky(checkout: Checkout, dockerd_version: str = PINNED + "+dfsg4") -> None:
    """apt-get that downloads three .debs of 1 MB each, and dpkg-deb that unpacks a dockerd."""
    checkout.fake("apt-get", """echo "Get:1 http://deb.debian.org/debian forky InRelease"
case " $* " in *" download "*)
  for p in "$@"; do case "$p" in docker.io|docker-cli|containerd) head -c 1000000 /dev/zero >"${p}_1_amd64.deb" ;; esac; done ;;
esac""")
    checkout.fake("dpkg-deb", f"""mkdir -p "$3/usr/sbin" "$3/usr/bin"
printf '#!/bin/sh\\necho "Docker version {dockerd_version}, build 411e817"\\n' >"$3/usr/sbin/dockerd"
chmod +x "$3/usr/sbin/dockerd\"""")


def test_engine_install_times_its_steps_and_reports_the_debs_it_fetched(checkout):
    fake_forky(checkout)
    result = checkout.run("localswarm/install-engine.sh")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "engine:   fetched 3 packages, 3.0 MB: containerd_1_amd64.deb docker-cli_1_amd64.deb " \
           "docker.io_1_amd64.deb" in result.stdout.splitlines()
    assert "Get:1" not in result.stdout
    assert [title for _, title, _, _ in step_ends(result.stdout)] == [
        "[1/3] package index of Debian forky", "[2/3] download docker.io docker-cli containerd",
        f"[3/3] unpack into {checkout.prefix}"]
    assert result.stdout.splitlines()[-1] == f"engine: installed Docker version {PINNED}+dfsg4, build 411e817"
    assert (checkout.prefix / "usr" / "bin" / "docker-init").is_symlink()


def test_engine_install_shows_why_apt_failed_and_what_to_do(checkout):
    checkout.fake("apt-get", 'echo "E: The repository is not signed."; exit 100')
    result = checkout.run("localswarm/install-engine.sh")
    assert result.returncode == 1
    assert "    E: The repository is not signed." in result.stderr
    assert f"install Docker Engine {PINNED} yourself" in result.stderr
    assert not checkout.prefix.exists()


def test_engine_check_names_the_pinned_engine_and_installs_nothing(checkout):
    fake_forky(checkout)
    missing = checkout.run("localswarm/install-engine.sh", "--check")
    assert (missing.returncode, missing.stdout) == (1, "")
    assert not checkout.prefix.exists()
    checkout.engine("29.8.1")  # newer, and not what nodes run: not the rehearsal's
    assert checkout.run("localswarm/install-engine.sh", "--check").returncode == 1
    checkout.engine(PINNED)
    found = checkout.run("localswarm/install-engine.sh", "--check")
    assert found.returncode == 0
    assert found.stdout == f"{checkout.prefix}/usr/sbin/dockerd is Docker version {PINNED}, build 411e817\n"


def test_test_sh_shows_skip_reasons_and_passes_arguments_on(checkout):
    checkout.fake("setup.sh", "true", checkout.root / "scripts")
    checkout.fake("python", 'echo "$@"', checkout.root / ".venv" / "bin")
    result = checkout.run("scripts/test.sh", "-ra", "-k", "not slow")  # as .ci/run calls it, plus more
    assert result.returncode == 0, result.stderr
    # Four workers, one rehearsal lane each (localswarm/lane.py), unless GPU_SWARM_TEST_WORKERS says otherwise.
    assert result.stdout == "-m pytest -n 4 --dist loadgroup -ra -ra -k not slow\n"
    alone = checkout.run("scripts/test.sh", env={"GPU_SWARM_TEST_WORKERS": "0"})
    assert alone.stdout == "-m pytest -n 0 --dist loadgroup -ra\n", alone.stderr


def test_pytest_accepts_ra_twice(tmp_path):
    (tmp_path / "test_one.py").write_text("import pytest\n\ndef test_skipped():\n    pytest.skip('no GPU here')\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-ra", "-ra", "-p", "no:cacheprovider", str(tmp_path)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SKIPPED [1]") == 1 and "no GPU here" in result.stdout
