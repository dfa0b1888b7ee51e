"""Every bench in bench/ still runs: each one's --smoke (tiny sizes, no GPU) runs here, so a bench that
no longer runs fails the suite, and a new bench without a smoke mode fails it too.

The GPU benches run their whole logic against stand-in GPUs (bench/gpu_standins.py); the benches of
the rehearsal do their smallest real run. Those start engines and machines, so here run them under
the rehearsal's lock:
    flock /tmp/gpu-swarm-rehearsal.lock .venv/bin/python -m pytest tests/test_benches.py
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
# What bench/ holds that is not a bench, and what runs it.
NOT_BENCHES = {
    "gpu_standins.py": "the stand-in GPUs of the GPU benches' smoke modes, which run it",
    "gpu_bench.py": "what the GPU benches share (checks, their engine, jobs): gpu_e2e, gpu_mps and gpu_metrics import it",
    "gpu_mps_node.py": "the MPS bench's engine, tasks and exporter reader: gpu_mps.py imports it",
    "gpu_mps_escapes.py": "what an MPS slot task may try to get more than its share: gpu_mps.py runs it",
    "gpu_mps_daemon.py": "what a task may try against its GPU's MPS daemon, and the watchdog: gpu_mps.py runs it",
    "mps_peer.c": "built and run by build_gpu_kit.sh --smoke, and by gpu_mps.py's smoke (tests/test_gpu_mps_bench.py)",
    "cuda_standin.sh": "builds the stand-in CUDA image: every GPU bench's smoke runs it",
    "cuda_probe.c": "built and run by build_gpu_kit.sh --smoke (and by the kit on a GPU machine)",
}
REHEARSAL = pytest.mark.integration  # root and an engine, under the rehearsal's lock
# Under pytest-xdist (tests/conftest.py): the GPU benches' engines are in the host's own namespace, so one
# at a time; each rehearsal bench makes and removes its own rehearsal, so each may have a lane of its own.
HOST_ENGINE = pytest.mark.xdist_group("host-engine")


def own_lane(test):
    return pytest.mark.xdist_group(test.__name__)(test)


def smoke(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """The bench's smoke, timed: it must end well, and within its own limit."""
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    print(f"{' '.join(command[1:])}: {time.monotonic() - started:.1f} s")  # shown with pytest -s
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done


def python(bench: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return smoke([sys.executable, f"bench/{bench}", "--smoke", *args], timeout)


def bash(bench: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return smoke(["bash", f"bench/{bench}", "--smoke"], timeout)


# bench -> the test below that runs its smoke, or the test file that does
SMOKES = {
    "scale.py": "test_scale_prints_each_size_with_its_ratio_to_the_sdk_floor",
    "compose_preview.py": "test_compose_preview_times_the_corpus",
    "guard_cost.py": "test_guard_cost_times_every_call",
    "metrics_budget.py": "test_metrics_budget_reports_each_figure",
    "build_gpu_kit.sh": "test_the_kit_builds_its_cuda_probe",
    "efa_probe.sh": "test_efa_probe_runs_the_projects_detection",
    "agent_gpu_proof.sh": "test_agent_proof_on_stand_in_gpus",
    "health_soak.py": "test_health_soak_on_stand_in_gpus",
    "gpu_e2e.py": "test_gpu_bench_on_stand_in_gpus",
    "gpu_mps.py": "tests/test_gpu_mps_bench.py",  # with what the bench must leave as it found it
    "gpu_metrics.py": "test_gpu_bench_on_stand_in_gpus",
    "gpu_session.sh": "test_gpu_session_runs_a_bench_and_packs_it",
    "rehearsal_cpu.py": "test_rehearsal_cpu_bench",
    "program_up.py": "test_program_up_bench",
    "health.py": "test_health_bench",
    "metrics_sample.py": "tests/test_metrics_rehearsal.py",  # on that module's rehearsal (--running)
    "access_rehearsal.py": "test_access_rehearsal_bench",
    "autoscale.py": "test_autoscale_bench",
}


def test_every_bench_has_a_smoke_mode_that_a_test_here_runs():
    benches = sorted(p.name for p in BENCH.iterdir() if p.is_file() and p.name not in NOT_BENCHES)
    assert benches == sorted(SMOKES), "a bench without a smoke test here (add one), or a smoke test of a bench " \
                                      "that is gone"
    tests = {name for name in globals() if name.startswith("test_")}
    elsewhere = {v for v in SMOKES.values() if v.startswith("tests/")}
    assert set(SMOKES.values()) - elsewhere <= tests
    assert all("--smoke" in (REPO / v).read_text() for v in elsewhere)
    assert all("--smoke" in (BENCH / b).read_text() for b in benches)


@pytest.mark.parametrize("bench", sorted(b for b in SMOKES if b.endswith(".py")))
def test_bench_help_runs(bench):
    proc = subprocess.run([sys.executable, f"bench/{bench}", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "usage:" in proc.stdout and "--smoke" in proc.stdout, proc.stderr


# --- no engine needed

def test_scale_prints_each_size_with_its_ratio_to_the_sdk_floor():
    out = python("scale.py", timeout=180).stdout
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 3], out
    for nodes, resources, program_s, floor_s, ratio in rows:
        assert int(resources) > 50 and float(floor_s) > 0
        assert float(ratio) == pytest.approx(float(program_s) / float(floor_s), rel=0.1)  # printed rounded
    assert int(rows[1][1]) > int(rows[0][1])  # two more nodes, more resources


def _scale():
    spec = importlib.util.spec_from_file_location("scale_bench", BENCH / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("typ, says", [
    ("aws:ec2/eip:Eip", None),  # the type the hand-made list of old missed
    ("command:remote:Command", None),
    ("tls:index/privateKey:PrivateKey", None),
    ("aws:ec2/noSuchThing:NoSuchThing", "pulumi_aws registers no class for it"),
    ("nosuchprovider:index/thing:Thing", "no Python package pulumi_nosuchprovider"),
    ("gpu-swarm:node:Boot", "no Python package pulumi_gpu-swarm"),
    ("not-a-token", "is not a Pulumi type token"),
])
def test_the_sdk_floor_finds_a_types_class_where_the_sdk_does_or_names_the_type(typ, says):
    scale = _scale()
    if says is None:
        cls = scale.sdk_class(typ)
        assert typ.rsplit(":", 1)[1] == cls.__name__
        return
    with pytest.raises(SystemExit) as failed:
        scale.sdk_class(typ)
    assert says in str(failed.value) and typ in str(failed.value)


def test_compose_preview_times_the_corpus():
    out = python("compose_preview.py").stdout
    # Data rows only: a case, its file, an outcome and a time (the header row has none of these).
    rows = re.findall(r"^\| [\w-]+ \| [\w-]+\.yml \| (accepted|refused) \| .* \| (\d+\.\d+) \| (\d+\.\d+) \|$", out, re.M)
    assert len(rows) >= 3 and all(float(wall) > 0 for _, wall, _ in rows), out


def test_guard_cost_times_every_call():
    out = python("guard_cost.py").stdout
    assert "median of 3 interleaved calls" in out
    for call in ("create, one GPU", "create, no GPU", "start (any call but create)", "per container:"):
        assert call in out


def test_metrics_budget_reports_each_figure():
    out = python("metrics_budget.py").stdout
    result = json.loads(out[:out.rindex("}") + 1])
    assert result["gpus"] == 8 and result["scrape_ms"]["scrapes"] == 5 and result["series_per_scrape"] > 30
    assert result["over_budget"] == []


def test_the_kit_builds_its_cuda_probe():
    said = bash("build_gpu_kit.sh", timeout=120).stdout
    assert "cuda-probe built, ran: exit 2" in said and "mps-peer built: mps-peer: no socket at" in said


def test_efa_probe_runs_the_projects_detection():
    out = bash("efa_probe.sh").stdout
    assert "== node/efa_detect.py" in out and "efa_detect.py FAILED" not in out


def test_agent_proof_on_stand_in_gpus():
    out = bash("agent_gpu_proof.sh").stdout
    assert "UUIDs match (2 devices)" in out and "second run changed: False" in out


# --- root, and engines or the rehearsal's machines

@REHEARSAL
@HOST_ENGINE
def test_health_soak_on_stand_in_gpus(engine):
    out = python("health_soak.py", timeout=60).stdout
    assert "| conditions reported | healthy |" in out and "on 2 GPU(s)" in out and "no false condition" in out


@REHEARSAL
@HOST_ENGINE
@pytest.mark.parametrize("bench, gpus, limit", [
    # Every check passes on 1, 2 and 4 GPUs (run by hand, bench/results/gpu-smoke-standins.md); CI
    # runs 2, the smallest count where a task could get another's GPU (gpu_mps: test_gpu_mps_bench.py).
    ("gpu_metrics.py", 2, 120), ("gpu_e2e.py", 2, 300),
])
def test_gpu_bench_on_stand_in_gpus(engine, bench, gpus, limit):
    out = python(bench, "--gpus", str(gpus), timeout=limit).stdout
    summary = re.search(r"^smoke: (\d+) of (\d+) checks passed on stand-in GPUs", out, re.M)
    assert summary and summary[1] == summary[2] and int(summary[2]) >= 10, out[-3000:]


@REHEARSAL
@HOST_ENGINE
def test_gpu_session_runs_a_bench_and_packs_it(engine):
    out = bash("gpu_session.sh", timeout=300).stdout
    assert "program metrics" in out and "passed" in out and "result: ALL PASSED" in out, out[-3000:]


@REHEARSAL
@own_lane
def test_rehearsal_cpu_bench(engine):
    out = python("rehearsal_cpu.py", timeout=300).stdout
    assert "`pulumi up` of a manager and 1 GPU node(s) took" in out and "own CPU-seconds by command" in out
    assert re.search(r"own CPU-seconds by command: .*\bpulumi \d", out), out


@REHEARSAL
@own_lane
def test_program_up_bench(engine):
    out = python("program_up.py", timeout=600).stdout
    assert "1 run(s) on" in out and "again, new node software" in out and "boot steps" in out
    assert "pulumi up --stack dev (first up, Pulumi's CLI)" in out


@REHEARSAL
@own_lane
def test_health_bench(engine):
    out = python("health.py", timeout=600).stdout
    assert "1 rounds on the rehearsal of Pulumi's CLI: a manager and 2 spot GPU nodes of 1 GPU, 1 one-GPU replica(s)" in out
    assert "tasks_running_elsewhere_s" in out and "spot_heal_to_active_s" in out


@REHEARSAL
@own_lane
def test_access_rehearsal_bench(engine):
    done = python("access_rehearsal.py", "--json", timeout=600)
    assert "every expectation held" in done.stderr
    found = json.loads(done.stdout)
    assert found["every_pin_is_a_machines_own_key"] and found["wrong_proxy_key"].startswith("refused")


@REHEARSAL
@own_lane
def test_autoscale_bench(engine):
    out = python("autoscale.py", timeout=900).stdout
    assert "1 runs, idle time 5 s" in out
    for figure in ("pending_to_decision_s", "decision_to_admitted_s", "admitted_to_running_s", "gone_to_removed_s"):
        assert figure in out, figure
