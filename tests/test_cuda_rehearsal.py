"""Preview's CUDA check in the rehearsal: Pulumi's CLI runs the program, which reads the stack's image
from the rehearsal's registry.

That registry is the machines' Docker Hub mirror; it holds the stand-in under nvidia/cuda names with
the requirement the real image's config states (localswarm/registry.py cuda_requirement). A stack whose
image needs CUDA 13.1 is refused on the dev cluster (driver 580: CUDA up to 13.0) before any machine starts.
"""
from __future__ import annotations


import pytest

from localswarm import machines, pulumi_cli
from tests.rehearsal_tools import cli, pulumi, require_engine

pytestmark = pytest.mark.integration


def test_pulumi_up_refuses_an_image_newer_than_the_driver_before_any_machine_starts():
    require_engine()
    cli("down")
    try:
        for key, value in (("stacks[0].name", "train"), ("stacks[0].file", "tests/data/stacks/train-cuda-13-1.yml")):
            assert pulumi("config", "set", "--path", f"gpu-swarm:{key}", value).returncode == 0
        proc = pulumi("up", "--yes")
        said = proc.stdout + proc.stderr
        assert proc.returncode != 0, said
        for part in ("gpu-swarm:stacks[0].file: tests/data/stacks/train-cuda-13-1.yml: services.train:",
                     "nvidia/cuda:13.1.0-base-ubuntu24.04 needs CUDA 13.1 (NVIDIA_REQUIRE_CUDA='cuda>=13.1')",
                     "no pool it can land on runs it: t4 (driver 580, CUDA up to 13.0)"):
            assert part in said, said
        assert not pulumi_cli.holds_machines() and machines.machines() == []
    finally:
        cli("down")
