"""The benchmarks still run against today's program (they are not run in full here: they print figures)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_scale_bench_evaluates_the_program_under_the_test_mocks():
    proc = subprocess.run([sys.executable, "bench/scale.py", "--child", "2"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["gpu_nodes"] == 2 and result["resources"] > 20 and result["seconds"] > 0


@pytest.mark.parametrize("bench", ["health.py", "rehearsal.py", "rehearsal_cpu.py", "guard_cost.py", "scale.py",
                                   "gpu_e2e.py"])
def test_bench_help_runs(bench):
    proc = subprocess.run([sys.executable, f"bench/{bench}", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr


def test_compose_preview_bench_times_the_corpus():
    proc = subprocess.run([sys.executable, "bench/compose_preview.py", "--smoke"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| case", "| ---"))]
    assert len(rows) == 3 and all(float(row.rstrip(" |").rsplit("|", 1)[1]) > 0 for row in rows), proc.stdout
    assert "cores (nproc)" in proc.stdout and "Python 3." in proc.stdout
