"""The end of a rehearsal machine's processes and cgroups (localswarm/nspawn.py), on this host's real
cgroups: a process killed with a lot of memory leaves its cgroup only once its exit is done.

The project's CI once failed a destroy on it: "machine lsw-6: its cgroup still holds processes
([Errno 16] Device or resource busy: '/sys/fs/cgroup/systemd/gpu-swarm-machines/lsw-6/payload')",
a rmdir right after the SIGKILL of a machine whose dockerd was still exiting.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from localswarm import nspawn

pytestmark = pytest.mark.integration  # root, and a cgroup tree to write in

# Touches every page, so that its exit has 1 GiB to give back (0.15-0.37 s on the 2-core VM).
HOLDER = "b = bytearray(1 << 30)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('ready', flush=True)\n" \
         "import time; time.sleep(600)"


@pytest.fixture
def machine(tmp_path):
    m = SimpleNamespace(name=f"lsw-test-{os.getpid()}", dir=tmp_path, root=tmp_path / "root")
    if os.geteuid() != 0 or not nspawn.cgroup_roots():
        if os.environ.get("CI"):
            pytest.fail("this test needs root and a cgroup tree (CI runs as root)")
        pytest.skip("needs root and a cgroup tree")
    yield m
    nspawn.kill(m)
    nspawn.remove_cgroups(m)


def _hold(m, code: str) -> subprocess.Popen:
    """A process in the machine's payload cgroup of every hierarchy, as nspawn places a machine's."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    for cgroup in nspawn.cgroups_of(m):
        (cgroup / "payload").mkdir(parents=True, exist_ok=True)
        (cgroup / "payload" / "cgroup.procs").write_text(str(proc.pid))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_killed_machine_whose_processes_take_time_to_exit_still_has_its_cgroups_removed(machine):
    proc = _hold(machine, HOLDER)
    assert nspawn.procs(machine) == [proc.pid]
    nspawn.kill(machine)
    nspawn.remove_cgroups(machine)
    assert not any(Path(c).exists() for c in nspawn.cgroups_of(machine))
    assert proc.wait(timeout=10) == -9


def test_a_cgroup_that_stays_busy_is_an_error_that_names_what_is_in_it(machine):
    proc = _hold(machine, "print('ready', flush=True)\nimport time; time.sleep(600)")
    with pytest.raises(OSError, match=rf"in it: {proc.pid} \(python3?[.\d]*, state S\)"):
        nspawn.remove_cgroups(machine, timeout=0.3)
    assert proc.poll() is None  # removing cgroups kills nothing; kill() is the one that does
