"""The node's engine, toolkit and driver, installed exactly as node/versions.env pins them, in real bash.

The steps run for real (install-docker, install-container-toolkit, install-nvidia-driver) with stubs of
apt-get, apt-cache, dpkg, dpkg-query, modinfo and the tools, whose answers are in the shape the real ones
print: `apt-cache madison` lists a repository's versions (Docker's are 5:28.5.2-1~ubuntu.24.04~noble,
NVIDIA's 1.20.1-1, Ubuntu's 580.95.05-0ubuntu0.24.04.2), and each tool reports the version a stub file
holds, which the stubbed `apt-get install` rewrites, as an install would.
"""
from __future__ import annotations

import pytest

from tests.test_shell_scripts import Node
from to_node.software import min_versions

PINS = min_versions()
DOCKER, CONTAINERD, TOOLKIT = PINS["DOCKER_VERSION"], PINS["CONTAINERD_VERSION"], PINS["TOOLKIT_VERSION"]
NOBLE = "~ubuntu.24.04~noble"
DOCKER_REPO = "https://download.docker.com/linux/ubuntu noble/stable amd64 Packages"


# curl as the steps call it: -o FILE downloads a key; without it, the body is a list file's text.
CURL = r'''out=""; while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
if [ -n "$out" ]; then echo "-----BEGIN PGP PUBLIC KEY BLOCK-----" >"$out"
else echo 'deb https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /'; fi'''


def madison(lines: dict[str, list[str]]) -> str:
    """A stub body for `apt-cache madison PKG` (and `apt-cache show PKG`: found when it has versions)."""
    cases = "\n".join(f'  {pkg}) printf "%s\\n" {" ".join(repr(f" {pkg} | {v} | repo") for v in versions)} ;;'
                      for pkg, versions in lines.items())
    return f'pkg=${{@: -1}}\ncase $pkg in\n{cases}\n  *) [ "$1" = show ] && exit 100 ;;\nesac'


@pytest.fixture
def engine(node_dir) -> Node:
    """A node whose dockerd and containerd say what the files docker.version and containerd.version hold."""
    node = node_dir
    node.real_step("install-docker")
    for tool, line in (("dockerd", 'echo "Docker version $(cat "$ROOT/docker.version"), build 3ef3c07"'),
                       ("containerd", 'echo "containerd containerd.io v$(cat "$ROOT/containerd.version") fcd4322"')):
        node.fake(tool, line)
    node.env["ROOT"] = str(node.root)
    node.fake("systemctl", "exit 0")
    node.fake("apt-mark", "exit 0")
    node.fake("dpkg", '[ "$1" = --print-architecture ] && echo amd64 || exit 1')  # dpkg -s: no distro engine, no extras
    node.fake("dpkg-query", "exit 1")
    node.fake("curl", CURL)
    node.fake("apt-cache", madison({
        "docker-ce": [f"5:29.0.0-1{NOBLE}", f"5:{DOCKER}-1{NOBLE}", f"5:28.5.1-1{NOBLE}"],
        "docker-ce-cli": [f"5:29.0.0-1{NOBLE}", f"5:{DOCKER}-1{NOBLE}"],
        "containerd.io": [f"2.2.0-1{NOBLE}", f"{CONTAINERD}-1{NOBLE}", f"1.7.28-1{NOBLE}"]}))
    # An install writes the versions it was asked for, as the packages' binaries would then say them.
    node.fake("apt-get", r'''case " $* " in *" install "*)
  for a in "$@"; do case $a in
    docker-ce=*) v=${a#*=}; v=${v#*:}; echo "${v%%-*}" >"$ROOT/docker.version" ;;
    containerd.io=*) v=${a#*=}; echo "${v%%-*}" >"$ROOT/containerd.version" ;;
  esac; done ;;
esac''')
    return node


@pytest.fixture
def node_dir(tmp_path) -> Node:
    return Node(tmp_path)


def versions(node: Node, docker: str, containerd: str) -> None:
    (node.root / "docker.version").write_text(docker + "\n")
    (node.root / "containerd.version").write_text(containerd + "\n")


@pytest.mark.parametrize("docker, containerd", [(DOCKER, CONTAINERD), (f"{DOCKER}+dfsg4", "2.1.9")],
                         ids=["docker-ce", "debian-docker.io"])
def test_the_pinned_engine_is_kept_as_it_is(engine, docker, containerd):
    """Debian's docker.io of the pinned release with its containerd 2.1.9 (the rehearsal, the GPU kit) too."""
    versions(engine, docker, containerd)
    assert engine.bootstrap("install-docker").returncode == 0, engine.log.read_text()
    assert engine.statuses() == {"install-docker": "skipped"}
    assert not [c for c in engine.called() if c.startswith(("apt-get", "apt-mark"))]


def test_the_deep_learning_amis_docker_29_is_replaced_by_the_pinned_engine_and_held(engine):
    versions(engine, "29.8.1", "2.4.1")
    (engine.root / "os-release").write_text("ID=ubuntu\nVERSION_CODENAME=noble\n")
    result = engine.bootstrap("install-docker")
    assert result.returncode == 0, engine.log.read_text()
    install = next(c for c in engine.called() if c.startswith("apt-get") and " install " in c and "docker-ce=" in c)
    assert (engine.root / "apt" / "sources.list.d" / "docker.list").read_text().strip().endswith(
        "https://download.docker.com/linux/ubuntu noble stable")
    assert f"docker-ce=5:{DOCKER}-1{NOBLE}" in install and f"docker-ce-cli=5:{DOCKER}-1{NOBLE}" in install
    assert f"containerd.io={CONTAINERD}-1{NOBLE}" in install and "--allow-downgrades" in install
    assert "apt-mark hold docker-ce docker-ce-cli containerd.io" in engine.called()
    assert "found Docker 29.8.1, containerd 2.4.1" in engine.log.read_text()


def test_a_repository_without_the_pinned_release_fails_naming_it(engine):
    versions(engine, "29.8.1", "2.4.1")
    engine.fake("apt-cache", madison({"docker-ce": [f"5:29.0.0-1{NOBLE}"], "docker-ce-cli": [f"5:29.0.0-1{NOBLE}"],
                                      "containerd.io": [f"2.2.0-1{NOBLE}"]}))
    assert engine.bootstrap("install-docker").returncode == 1
    log = engine.log.read_text()
    assert f"no docker-ce {DOCKER}" in log and f"containerd.io {CONTAINERD} (missing)" in log
    assert not [c for c in engine.called() if " install " in c and "docker-ce=" in c]


def test_an_install_that_leaves_another_engine_fails_naming_both(engine):
    versions(engine, "29.8.1", "2.4.1")
    engine.fake("apt-get", "exit 0")  # the install "works", but nothing changed
    assert engine.bootstrap("install-docker").returncode == 1
    assert f"Docker is 29.8.1 and containerd 2.4.1; node/versions.env pins Docker {DOCKER}" in engine.log.read_text()


# ---------------------------------------------------------------- the toolkit

@pytest.fixture
def toolkit(node_dir) -> Node:
    node = node_dir
    node.real_step("install-container-toolkit")
    node.env["ROOT"] = str(node.root)
    node.fake("nvidia-ctk", r'''case "$1" in
  --version) echo "NVIDIA Container Toolkit CLI version $(cat "$ROOT/toolkit.version")"; echo "commit: 1a2b3c" ;;
  runtime) echo '{"runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}}' >"$DOCKER_DAEMON_JSON" ;;
esac''')
    node.fake("dpkg-query", "exit 0")
    node.fake("apt-mark", "exit 0")
    node.fake("curl", CURL)
    node.fake("apt-cache", madison({pkg: ["1.20.2-1", f"{TOOLKIT}-1", "1.19.0-1"] for pkg in (
        "nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools",
        "libnvidia-container1")}))
    node.fake("apt-get", r'''case " $* " in *" install "*)
  for a in "$@"; do case $a in nvidia-container-toolkit=*) v=${a#*=}; echo "${v%%-*}" >"$ROOT/toolkit.version" ;; esac; done ;;
esac''')
    node.daemon_json.parent.mkdir(parents=True, exist_ok=True)
    node.daemon_json.write_text("{}\n")
    return node


def test_another_toolkit_is_replaced_by_the_pinned_one_and_registered(toolkit):
    (toolkit.root / "toolkit.version").write_text("1.18.1\n")  # what some Deep Learning AMI releases ship
    assert toolkit.bootstrap("install-container-toolkit").returncode == 0, toolkit.log.read_text()
    install = next(c for c in toolkit.called() if c.startswith("apt-get") and " install " in c)
    assert "signed-by=" in (toolkit.root / "apt" / "sources.list.d" / "nvidia-container-toolkit.list").read_text()
    for pkg in ("nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools",
                "libnvidia-container1"):
        assert f"{pkg}={TOOLKIT}-1" in install
    assert "nvidia-ctk runtime configure --runtime=docker" in toolkit.called()


def test_the_pinned_toolkit_registered_is_kept(toolkit):
    (toolkit.root / "toolkit.version").write_text(f"{TOOLKIT}\n")
    toolkit.daemon_json.write_text('{"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}\n')
    assert toolkit.bootstrap("install-container-toolkit").returncode == 0, toolkit.log.read_text()
    assert toolkit.statuses() == {"install-container-toolkit": "skipped"}


# ---------------------------------------------------------------- the driver and the kernel

KERNEL = "6.8.0-1021-aws"
MODULE = "580.95.05"  # what Ubuntu built the prebuilt module for this kernel with
NEWEST = "580.105.08"  # the branch's newest user space, newer than the module


@pytest.fixture
def driver(node_dir) -> Node:
    """Plain Ubuntu on a kernel that is not the newest: no driver yet; Ubuntu has a module for the kernel."""
    node = node_dir
    node.real_step("install-nvidia-driver")
    node.env["ROOT"] = str(node.root)
    node.fake("uname", f"echo {KERNEL}")
    flavor = "580-server-open"
    node.fake("apt-cache", madison({
        f"linux-modules-nvidia-{flavor}-{KERNEL}": [f"{KERNEL.rsplit('-', 1)[0]}.23"],
        "nvidia-utils-580-server": [f"{NEWEST}-0ubuntu0.24.04.1", f"{MODULE}-0ubuntu0.24.04.2"],
        f"nvidia-headless-no-dkms-{flavor}": [f"{NEWEST}-0ubuntu0.24.04.1", f"{MODULE}-0ubuntu0.24.04.2"]}))
    # The module's version once its package is in (modinfo reads the .ko); the tools' once theirs is.
    node.fake("apt-get", r'''case " $* " in *" install "*)
  for a in "$@"; do case $a in
    linux-modules-nvidia-*) echo "''' + MODULE + r'''" >"$ROOT/module.version" ;;
    nvidia-utils-*=*) echo "${a#*=}" >"$ROOT/tools.version"; cp "$ROOT/smi" "$ROOT/bin/nvidia-smi" ;;
  esac; done ;;
esac''')
    node.fake("modinfo", '[ -f "$ROOT/module.version" ] && cat "$ROOT/module.version"')
    node.fake("dpkg-query", 'case "$*" in *Version*) [ -f "$ROOT/tools.version" ] && cat "$ROOT/tools.version" ;; '
                            '*) exit 0 ;; esac')
    node.fake("dpkg", "exit 0")  # dpkg -s: the kernel's packages and metapackages are installed
    node.fake("apt-mark", "exit 0")
    node.fake("modprobe", "exit 0")
    node.write(node.root / "smi", '#!/bin/sh\necho "GPU 0: NVIDIA L4 (UUID: GPU-48f73d5c-653c-94b5-f00e-d5bba41a1cfb)"\n')
    return node


def test_the_user_space_is_the_version_of_the_kernels_module_and_the_kernel_is_held(driver):
    assert driver.bootstrap("install-nvidia-driver").returncode == 0, driver.log.read_text()
    installs = [c for c in driver.called() if c.startswith("apt-get") and " install " in c]
    assert installs[0].endswith(f"linux-modules-nvidia-580-server-open-{KERNEL}")
    assert f"nvidia-utils-580-server={MODULE}-0ubuntu0.24.04.2" in installs[1]
    assert f"nvidia-headless-no-dkms-580-server-open={MODULE}-0ubuntu0.24.04.2" in installs[1]
    # No metapackage that follows kernel upgrades, and the kernel held where it is.
    assert not any("-aws" in word and "nvidia" in word and KERNEL not in word for c in installs for word in c.split())
    holds = [c for c in driver.called() if c.startswith("apt-mark hold linux-")]
    assert {"apt-mark hold linux-aws", "apt-mark hold linux-image-aws", f"apt-mark hold linux-image-{KERNEL}",
            "apt-mark hold linux-headers-aws"} <= set(holds)
    called = driver.called()
    assert called.index("modprobe nvidia") > max(i for i, c in enumerate(called) if c.startswith("modinfo"))


def test_a_module_and_tools_of_two_versions_fail_before_the_module_loads_naming_both(driver):
    driver.fake("apt-get", r'''case " $* " in *" install "*)
  for a in "$@"; do case $a in
    linux-modules-nvidia-*) echo "''' + MODULE + r'''" >"$ROOT/module.version" ;;
    nvidia-utils-*=*) echo "''' + NEWEST + r'''-0ubuntu0.24.04.1" >"$ROOT/tools.version" ;;
  esac; done ;;
esac''')
    assert driver.bootstrap("install-nvidia-driver").returncode == 1
    log = driver.log.read_text()
    assert f"kernel module for kernel {KERNEL} is {MODULE} and the user-space tools" in log and NEWEST in log
    assert "modprobe nvidia" not in driver.called()


def test_a_kernels_module_without_tools_of_its_version_fails_naming_the_version(driver):
    driver.fake("apt-cache", madison({
        f"linux-modules-nvidia-580-server-open-{KERNEL}": ["6.8.0-1021.23"],
        "nvidia-utils-580-server": [f"{NEWEST}-0ubuntu0.24.04.1"],
        "nvidia-headless-no-dkms-580-server-open": [f"{NEWEST}-0ubuntu0.24.04.1"]}))
    assert driver.bootstrap("install-nvidia-driver").returncode == 1
    assert f"module for kernel {KERNEL} is driver {MODULE}" in driver.log.read_text()


DKMS_INSTALL = r'''case " $* " in *" install "*)
  echo "MODULE" >"$ROOT/module.version"; echo "MODULE-0ubuntu0.24.04.2" >"$ROOT/tools.version"
  cp "$ROOT/smi" "$ROOT/bin/nvidia-smi" ;;
esac'''


def test_without_a_prebuilt_module_dkms_builds_one_for_this_kernel_and_the_kernel_is_held(driver):
    """The EFA module, which DKMS builds for the running kernel only, is there again after a reboot."""
    driver.fake("apt-cache", "exit 100")  # no prebuilt modules for this kernel
    driver.fake("apt-get", DKMS_INSTALL.replace("MODULE", MODULE))
    assert driver.bootstrap("install-nvidia-driver").returncode == 0, driver.log.read_text()
    install = next(c for c in driver.called() if c.startswith("apt-get") and " install " in c)
    assert install.endswith(f"nvidia-headless-580-server-open linux-headers-{KERNEL}")
    assert "linux-headers-aws" not in install  # it follows kernel upgrades
    assert f"apt-mark hold linux-image-{KERNEL}" in driver.called() and "apt-mark hold linux-aws" in driver.called()
