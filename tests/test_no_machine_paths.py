"""No path of a build machine in the repository: results are committed, the machines' paths are not.

The checkout's own path (whatever it is on the machine running this), the GPU machine's $OUT
(/root/out, which bench/gpu_session.sh writes as <out>) and home folders are what a log carries
when it is copied in as it was printed. bench/gpu_session.sh rewrites them; this holds every
tracked file to it.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MACHINE_PATHS = re.compile(r"(?<![\w>)}/.-])(/root/out\b|/work/[\w.-]+/)")
# A home folder is a machine's in a log; in a Compose file or its corpus case it is what a user binds.
HOME = re.compile(r"(?<![\w>)}/.-])/home/[a-z][\w.-]*/")


def _tracked() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    # This file names the paths it looks for.
    return [REPO / n.decode() for n in names if n and REPO / n.decode() != Path(__file__).resolve()]


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="ignore")
    except (IsADirectoryError, FileNotFoundError):
        return ""


def test_no_tracked_file_holds_this_checkouts_path():
    here = f"{REPO}/"
    assert [str(p.relative_to(REPO)) for p in _tracked() if here in _text(p)] == []


def test_no_tracked_file_holds_a_build_or_gpu_machines_path():
    found = [f"{p.relative_to(REPO)}: {m[0]}" for p in _tracked() for m in MACHINE_PATHS.finditer(_text(p))]
    found += [f"{p.relative_to(REPO)}: {m[0]}" for p in _tracked() if p.is_relative_to(REPO / "bench" / "results")
              for m in HOME.finditer(_text(p))]
    assert found == []


def test_the_pattern_finds_what_it_is_for():
    assert MACHINE_PATHS.search("cp x /root/out/") and MACHINE_PATHS.search("at /work/main/node/x")
    assert HOME.search("in /home/ci/checkout/")
    # a container's /root and a process's root folder are not a machine's paths
    assert not MACHINE_PATHS.search("hf-cache:/root/.cache/huggingface")
    assert not MACHINE_PATHS.search("/host/proc/22807/root/run/gpu-swarm")
