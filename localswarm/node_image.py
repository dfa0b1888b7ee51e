"""The rehearsal's node image, its "pre-baked AMI": Debian trixie set up as an Ubuntu EC2 AMI is, plus the
hardware stand-ins (localswarm/standins).

Two layers, each built once and cached by the hash of its recipe under CACHE:
- base-<hash>/rootfs: mmdebstrap of PACKAGES (about half a minute and 470 MB); it changes only
  with the package list, so editing a stand-in never downloads it again;
- node-<hash>/layer: what makes it the AMI, written through an overlay on the base: cloud-init
  (NoCloud, default user `ubuntu` with passwordless sudo), Docker's daemon.json (the local
  registry as Docker Hub mirror, the nvidia runtime registered), apt timers off, the rehearsal
  CA trusted, no SSH host keys or hostname (each machine makes its own), and the stand-ins.
A machine's root is an overlay with lowerdir=Image.lowerdir. `python -m localswarm.node_image`
builds it (scripts/setup.sh does); `--check` says whether it is built.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from localswarm import object_store, standins
from localswarm.host import SETUP_HINT, RehearsalError, run
from to_node.software import min_versions, pinned_wheel
from localswarm.network import BRIDGE_ADDR

CACHE = Path(os.environ.get("GPU_SWARM_IMAGE_CACHE", "/var/cache/gpu-swarm/node-image"))
WHEELS = CACHE / "wheels"  # PyPI wheels the node software needs (pypi_wheels), kept across builds
SUITE = "trixie"  # cloud-init 25.1 (Ubuntu 24.04 ships 24.x+)
# The engine, as node/versions.env pins it (DOCKER_VERSION, and CONTAINERD_VERSION's minor): Debian forky's
# docker.io 28.5.2 with containerd 2.1.9 and runc 1.3.6, over trixie. Its release is checked after the build.
ENGINE_SUITE = "forky"
ENGINE_PACKAGES = ("docker.io", "docker-cli", "containerd", "runc")
MIRROR = "http://deb.debian.org/debian"
PACKAGES = (
    "systemd", "systemd-sysv", "dbus",  # PID 1, as on an instance
    "cloud-init", "openssh-server", "sudo",  # how the program reaches a node
    "iptables",  # the engine's (ENGINE_PACKAGES come from ENGINE_SUITE)
    "python3",  # the GPU agent's venv; no python3-venv, which a venv without pip does not need (install-agent-venv.sh)
    "curl", "ca-certificates", "openssl",  # the node bundle's download from the S3 stand-in
    "busybox-static",  # the post-join check image (node/build-check-image.sh)
    "iproute2", "procps", "netbase", "less",
)
# Like Ubuntu's minimal cloud images: no manuals or translations (a fifth of the size).
DPKG_OPTIONS = ("path-exclude=/usr/share/man/*", "path-exclude=/usr/share/doc/*",
                "path-include=/usr/share/doc/*/copyright", "path-exclude=/usr/share/locale/*")
REGISTRY_MIRROR = f"{BRIDGE_ADDR}:5000"  # localswarm/registry.py's registry, a Docker Hub mirror
DAEMON_JSON = {
    "registry-mirrors": [f"http://{REGISTRY_MIRROR}"],
    "insecure-registries": [REGISTRY_MIRROR],  # the local registry speaks plain HTTP
    "log-opts": {"max-size": "1m"},
    "shutdown-timeout": 3,  # a stop should not wait 15 s per sleeping task
}
CLOUD_CFG = """\
# gpu-swarm rehearsal: this image plays an Ubuntu EC2 AMI, booted through cloud-init's NoCloud
# datasource (seed in /var/lib/cloud/seed/nocloud, written by localswarm/machines.py).
datasource_list: [NoCloud]
# The machine's network namespace is set up before it boots, as EC2's DHCP would answer.
network: {config: disabled}
system_info:
  distro: debian
  ssh_svcname: ssh
  # Ubuntu AMIs' default user: public keys from the meta-data, sudo without a password.
  default_user:
    name: ubuntu
    lock_passwd: true
    gecos: Ubuntu
    groups: [adm, cdrom, dip, plugdev, sudo, video]
    sudo: ["ALL=(ALL) NOPASSWD:ALL"]
    shell: /bin/bash
"""
RESOLV_CONF = f"""\
# gpu-swarm rehearsal: the bridge's resolver (localswarm/dns.py) answers every name NXDOMAIN at
# once, as nothing is reachable. Names a machine needs are in its /etc/hosts.
nameserver {BRIDGE_ADDR}
"""


def lane_files() -> dict[str, str]:
    """What names the bridge, which is the lane's (localswarm/lane.py): each machine's disk gets these at
    launch, so that one image serves every lane."""
    return {"etc/docker/daemon.json": json.dumps(DAEMON_JSON, indent=2) + "\n", "etc/resolv.conf": RESOLV_CONF}


MASKED = {
    "apt-daily.timer": "no package index is reachable, and an AMI for a swarm should not upgrade by itself",
    "apt-daily-upgrade.timer": "same",
    "systemd-modules-load.service": "a container cannot load kernel modules (the host kernel's are not in the image)",
}
REMOVED = ("/etc/hostname", "/etc/ssh/ssh_host_*")  # mmdebstrap copied the host's; each machine makes its own
LAYER_STEPS_VERSION = 3  # bump when the layer's build steps change in a way the file list does not show


@dataclass(frozen=True)
class Image:
    base: Path  # the mmdebstrap root filesystem
    layer: Path  # the AMI's configuration and the stand-ins

    @property
    def lowerdir(self) -> str:
        return f"{self.layer}:{self.base}"


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def base_dir() -> Path:
    engine = [ENGINE_SUITE, ENGINE_PACKAGES, min_versions()["DOCKER_VERSION"], min_versions()["CONTAINERD_VERSION"]]
    return CACHE / f"base-{_digest([SUITE, MIRROR, PACKAGES, DPKG_OPTIONS, engine])}"


def pypi_wheels(download: bool, progress=print) -> dict[str, tuple[bytes, int]] | None:
    """The wheels the node software installs from PyPI that are no stand-in: prometheus_client at
    node/versions.env's pin (the metrics exporter's), for the image's wheelhouse. Downloaded from
    PyPI once, into CACHE, and checked against the pin's sha256 as a node checks it; None when it is
    not there and download is False."""
    version = min_versions()["PROMETHEUS_CLIENT_VERSION"]
    _, name, sha256 = pinned_wheel("PROMETHEUS_CLIENT")
    wheel = WHEELS / name
    if not wheel.exists():
        if not download:
            return None
        progress(f"wheelhouse: prometheus_client {version} from PyPI ...")
        WHEELS.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "--disable-pip-version-check", "-d", str(WHEELS), f"prometheus-client=={version}"],
                              capture_output=True, text=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
        if done.returncode != 0 or not wheel.exists():
            raise RehearsalError(f"could not download prometheus_client {version} from PyPI for the node image's "
                                 f"wheelhouse: {done.stderr.strip()[-300:]}")
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != sha256:
        raise RehearsalError(f"{wheel} is not the wheel node/versions.env pins (PROMETHEUS_CLIENT_WHEEL's sha256 "
                             f"{sha256}): remove it, and the next build downloads it again")
    return {f"{standins.WHEELHOUSE}/{wheel.name}": (wheel.read_bytes(), 0o644)}


def layer_files(ca_cert: Path, wheels: dict[str, tuple[bytes, int]] | None = None) -> dict[str, tuple[bytes, int]]:
    """Every file the layer writes: path in the image -> (content, mode); wheels: pypi_wheels()."""
    files = {**standins.image_files(), **(wheels or {})}
    files["/etc/cloud/cloud.cfg.d/90-gpu-swarm-rehearsal.cfg"] = (CLOUD_CFG.encode(), 0o644)
    files["/etc/machine-id"] = (b"", 0o444)  # empty: systemd makes one per machine at its first boot
    # The locale as Ubuntu's cloud images set it (Debian's leaves it unset): cloud-init's locale module
    # then finds it set, where it ran update-locale at every first boot (0.07-0.17 s). In trixie
    # /etc/default/locale is a link to this file, which systemd-tmpfiles puts back at every boot.
    files["/etc/locale.conf"] = (b"LANG=C.UTF-8\n", 0o644)
    files["/usr/local/share/ca-certificates/gpu-swarm-rehearsal-ca.crt"] = (ca_cert.read_bytes(), 0o644)
    return files


def layer_dir(files: dict[str, tuple[bytes, int]]) -> Path:
    recipe = [base_dir().name, LAYER_STEPS_VERSION, sorted(MASKED), REMOVED, standins.image_links(),
              standins.image_units(), {p: [hashlib.sha256(d).hexdigest(), m] for p, (d, m) in files.items()}]
    return CACHE / f"node-{_digest(recipe)}"


def built() -> Image | None:
    """The current image when it is built, else None."""
    if not object_store.CA_CERT.exists():
        return None
    wheels = pypi_wheels(download=False)
    if wheels is None:
        return None
    image = Image(base_dir() / "rootfs", layer_dir(layer_files(object_store.CA_CERT, wheels)) / "layer")
    return image if image.base.is_dir() and image.layer.is_dir() else None


def _size_mb(path: Path) -> float:
    out = run(["du", "-sb", str(path)], check=False).stdout.split()
    return int(out[0]) / 1e6 if out else 0.0


def _build_base(progress) -> None:
    target = base_dir()
    if not shutil.which("mmdebstrap"):
        raise RehearsalError(f"`mmdebstrap` is not installed; {SETUP_HINT}")
    work = Path(f"{target}.tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    progress(f"base: mmdebstrap Debian {SUITE} with {len(PACKAGES)} packages and their dependencies "
             f"from {MIRROR} ...")
    t0 = time.monotonic()
    log = CACHE / f"{target.name}.log"
    # The hook counts the .debs before mmdebstrap empties apt's cache: what the build downloaded.
    count = 'echo "downloaded $(cat "$1"/var/cache/apt/archives/*.deb | wc -c) bytes"'
    # The engine from ENGINE_SUITE, its dependencies from SUITE where they are met there (pkg/suite).
    engine = ("chroot \"$1\" apt-get install -y -q --no-install-recommends "
              + " ".join(f"{p}/{ENGINE_SUITE}" for p in ENGINE_PACKAGES))
    cmd = ["mmdebstrap", "--variant=apt", f"--include={','.join(PACKAGES)}", f"--customize-hook={engine}",
           f"--customize-hook={count}", f"--aptopt=APT::Default-Release \"{SUITE}\"",
           # Debian's testing suite is signed, but its Release file's Valid-Until is a week, and a mirror can
           # hold an older copy (this workplace's did, 25 days past it): the signature is checked all the same.
           "--aptopt=Acquire::Check-Valid-Until \"false\"",
           *[f"--dpkgopt={o}" for o in DPKG_OPTIONS], SUITE, str(work / "rootfs"),
           f"deb {MIRROR} {SUITE} main", f"deb {MIRROR} {ENGINE_SUITE} main"]
    with open(log, "wb") as out:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RehearsalError(f"mmdebstrap failed (exit {done.returncode}); the end of {log}:\n{tail}\n"
                             f"It needs {MIRROR} (Debian's signed packages; bookworm's debian-archive-keyring "
                             "has trixie's keys)")
    _check_engine(work / "rootfs")
    work.rename(target)
    got = [line.split()[1] for line in log.read_text(errors="replace").splitlines() if line.startswith("downloaded ")]
    fetched = f"downloaded {int(got[-1]) / 1e6:.1f} MB, " if got and got[-1].isdigit() else ""
    progress(f"base: done in {time.monotonic() - t0:.1f} s, {fetched}{_size_mb(target / 'rootfs'):.0f} MB in {target}")


def _check_engine(rootfs: Path) -> None:
    """The image's engine is the pinned release, or the build fails naming both: a moved suite would
    otherwise make every rehearsal node replace its engine, from a repository it cannot reach."""
    pins = min_versions()
    said = run(["chroot", str(rootfs), "dockerd", "--version"], check=False).stdout
    said_containerd = run(["chroot", str(rootfs), "containerd", "--version"], check=False).stdout
    docker = re.search(r"version (\d+\.\d+\.\d+)", said)
    containerd = re.search(r" v?(\d+\.\d+)\.\d+", said_containerd)
    if not docker or docker[1] != pins["DOCKER_VERSION"] or not containerd or \
            containerd[1] != pins["CONTAINERD_VERSION"].rsplit(".", 1)[0]:
        raise RehearsalError(f"Debian {ENGINE_SUITE}'s engine is {said.strip() or 'missing'} with "
                             f"{said_containerd.strip() or 'no containerd'}; node/versions.env pins Docker "
                             f"{pins['DOCKER_VERSION']} and containerd {pins['CONTAINERD_VERSION']} (its minor): move "
                             "the pins and run the benches again, or take the engine from a suite that has them")


def _build_layer(base: Path, files: dict[str, tuple[bytes, int]], target: Path, progress) -> None:
    progress(f"node layer: cloud-init, daemon.json, CA, {len(standins.STANDINS)} hardware stand-ins ...")
    t0 = time.monotonic()
    work = Path(f"{target}.tmp")
    shutil.rmtree(work, ignore_errors=True)
    for d in ("layer", "work", "root"):
        (work / d).mkdir(parents=True)
    root = work / "root"
    run(["mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir={base},upperdir={work / 'layer'},workdir={work / 'work'}", str(root)])
    try:
        for path, (data, mode) in files.items():
            dest = root / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.unlink(missing_ok=True)  # /etc/resolv.conf may be a link
            dest.write_bytes(data)
            os.chmod(dest, mode)
        for link, points_to in standins.image_links().items():
            (root / link.lstrip("/")).unlink(missing_ok=True)
            (root / link.lstrip("/")).symlink_to(points_to)
        units = root / "etc/systemd/system"
        for unit in MASKED:
            (units / unit).unlink(missing_ok=True)
            (units / unit).symlink_to("/dev/null")
        wants = units / "multi-user.target.wants"
        for unit in standins.image_units():
            (wants / unit).unlink(missing_ok=True)
            (wants / unit).symlink_to(f"/usr/lib/systemd/system/{unit}")
        for pattern in REMOVED:
            for path in root.glob(pattern.lstrip("/")):
                path.unlink()
        # The real tools, in the image: the CA into the system's bundle, and the toolkit's
        # registration done by the nvidia-ctk stand-in itself, as on an AMI with the toolkit.
        run(["chroot", str(root), "update-ca-certificates"])
        run(["chroot", str(root), "nvidia-ctk", "runtime", "configure", "--runtime=docker"])
        # Last, after every change to /usr: an AMI is baked from an instance that has booted, whose
        # systemd-update-done marked /etc and /var as up to date with /usr. Its first boot as a new
        # instance then runs no ConditionNeedsUpdate unit (ldconfig, sysusers, the journal catalog);
        # a machine of this image ran them at every first boot, 0.3 s of its start on 2 cores.
        run(["chroot", str(root), "/usr/lib/systemd/systemd-update-done"])
    finally:
        run(["umount", str(root)], check=False)
    shutil.rmtree(work / "work", ignore_errors=True)
    root.rmdir()
    work.rename(target)
    progress(f"node layer: done in {time.monotonic() - t0:.1f} s, {_size_mb(target / 'layer'):.1f} MB in {target}")


def _prune(keep: set[Path]) -> None:
    """Remove older builds that no mounted overlay uses."""
    mounts = Path("/proc/self/mountinfo").read_text()
    for old in CACHE.glob("*-*"):
        if old.is_dir() and old not in keep and (old.suffix == ".tmp" or str(old) not in mounts):
            shutil.rmtree(old, ignore_errors=True)
            Path(f"{old}.log").unlink(missing_ok=True)


def ensure_image(progress=print) -> Image:
    """The node image, built when missing (one builder at a time)."""
    if os.geteuid() != 0:
        raise RehearsalError("building the node image needs root (mmdebstrap, chroot, mount)")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base_dir() / "rootfs").is_dir():
            _build_base(progress)
        files = layer_files(object_store.ensure_ca(), pypi_wheels(download=True, progress=progress))
        target = layer_dir(files)
        if not (target / "layer").is_dir():
            _build_layer(base_dir() / "rootfs", files, target, progress)
        _prune({base_dir(), target})
        return Image(base_dir() / "rootfs", target / "layer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localswarm.node_image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="build nothing: exit 0 and name it if built, else 1")
    args = parser.parse_args(argv)
    try:
        if args.check:
            image = built()
            if image:
                print(f"{image.layer.parent.name} over {image.base.parent.name} in {CACHE}")
            return 0 if image else 1
        t0 = time.monotonic()
        image = ensure_image(lambda line: print(line, flush=True))
        print(f"node image ready in {time.monotonic() - t0:.1f} s: {image.layer.parent.name} over "
              f"{image.base.parent.name}, {_size_mb(image.base) + _size_mb(image.layer):.0f} MB in {CACHE}")
        return 0
    except RehearsalError as e:
        print(f"node image: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
