"""Integration tests: stacks whose tasks end, a stack that cannot converge, and Compose GPU requests, in the rehearsal.

They need root and a Docker Engine >= 25.0.3, and the rehearsal's lock (flock /tmp/lsw.lock).
Each test brings its own rehearsal up and takes it down.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from textwrap import dedent

import pytest

from localswarm.host import REPO
from tests.rehearsal_tools import advertised, cli, status, tasks_of

pytestmark = pytest.mark.integration

ENDING = dedent("""\
    # Tasks that end, under each restart policy; none reserves a GPU.
    services:
      once:
        image: busybox
        command: ["sh", "-c", "echo done"]
        deploy:
          restart_policy: {condition: none}
      fails-once:
        image: busybox
        command: ["sh", "-c", "exit 3"]
        deploy:
          restart_policy: {condition: none}
      until-ok:
        image: busybox
        command: ["sh", "-c", "echo done"]
        deploy:
          restart_policy: {condition: on-failure}
      batch:
        image: busybox
        command: ["sh", "-c", "echo done"]
        deploy:
          mode: replicated-job
          replicas: 3
    """)

CRASHING = dedent("""\
    services:
      loop:
        image: busybox
        command: ["sh", "-c", "echo starting; exit 1"]
    """)


def up_json(*args: str) -> tuple[dict, str, float]:
    cli("down")
    started = time.monotonic()
    proc = cli("up", *args, "--json")
    return json.loads(proc.stdout), proc.stderr, time.monotonic() - started


def test_a_stack_whose_tasks_end_is_reported_and_the_swarm_kept(engine, tmp_path):
    """The issue's stack (7 one-GPU replicas of `nvidia-smi -L` on 3 x 2 GPUs, Compose syntax, default
    restart policy) and tasks that end under restart_policy none, on-failure and as a replicated job."""
    (tmp_path / "ends.yml").write_text(ENDING)
    try:
        view, progress, took = up_json("--nodes", "3", "--gpus-per-node", "2",
                                       "--stack", str(REPO / "stacks" / "examples" / "gpu-job.yml"),
                                       "--stack", str(tmp_path / "ends.yml"))
        print(f"up with a job stack: {took:.1f} s; converged at {view['timings']['stack_converged_s']} s")
        assert "stacks converged: " in progress
        smi = tasks_of(view, "job_smi")
        assert len(smi) == 7
        ran = [t for t in smi if t["last_run"]]
        assert len(ran) >= 6, smi
        for t in ran:
            assert t["exit_code"] == 0 and t["last_run"]["state"] == "complete"
            (gpu,) = t["last_run"]["gpus"]
            assert gpu in advertised(view)[t["last_run"]["node"]]
        assert all(t["last_run"] or "insufficient resources" in t["reason"] for t in smi)

        (once,) = tasks_of(view, "ends_once")
        assert (once["state"], once["ended"], once["exit_code"]) == ("complete", True, 0)
        (fails,) = tasks_of(view, "ends_fails-once")
        assert (fails["state"], fails["ended"], fails["exit_code"]) == ("failed", True, 3)
        (until_ok,) = tasks_of(view, "ends_until-ok")
        assert (until_ok["state"], until_ok["ended"], until_ok["exit_code"]) == ("complete", True, 0)
        batch = tasks_of(view, "ends_batch")
        assert len(batch) == 3 and all(t["state"] == "complete" and t["ended"] for t in batch)

        # The swarm is kept, and the tasks that end keep being reported.
        later = status()
        assert {n["state"] for n in later["nodes"]} == {"ready"}
        assert tasks_of(later, "ends_fails-once")[0]["exit_code"] == 3
        table = cli("status").stdout
        assert "LAST RUN" in table and "EXIT" in table
    finally:
        cli("down")


def test_a_stack_that_cannot_converge_fails_fast_and_keeps_the_swarm_to_look_at(engine, tmp_path):
    (tmp_path / "crashing.yml").write_text(CRASHING)
    cli("down")
    try:
        started = time.monotonic()
        proc = cli("up", "--nodes", "2", "--gpus-per-node", "1", "--stack", str(tmp_path / "crashing.yml"),
                   check=False)
        took = time.monotonic() - started
        print(f"up with a crash-looping stack failed after {took:.1f} s")
        assert proc.returncode == 1
        # The deploy command's own waiter (node/stack_settle.py) said so, naming the stack and the service.
        assert "the stacks did not settle: " in proc.stderr
        assert "stack crashing: crashing_loop task 1 failed 3 times and never completed" in proc.stderr
        assert "exit 1: task: non-zero exit (1)" in proc.stderr
        assert "The rehearsal is still up" in proc.stderr and "docker service ps --no-trunc" in proc.stderr
        assert took < 100, "a crash loop should be seen long before the 120 s timeout"
        view = status()  # kept: the swarm answers, with the failing task and its exit code
        (loop,) = tasks_of(view, "crashing_loop")
        assert loop["exit_code"] == 1 and loop["runs"]["failed"] >= 3 and loop["runs"]["completed"] == 0
    finally:
        cli("down")


def test_compose_gpu_requests_run_as_the_rewritten_stack(engine):
    """Ollama as its guides write it (`gpus: all`): the task holds every GPU of one node, the web UI none."""
    try:
        view, progress, _ = up_json("--nodes", "3", "--gpus-per-node", "2",
                                    "--stack", str(REPO / "stacks" / "examples" / "ollama.yml"))
        assert "ollama: rewritten for swarm: services.ollama.gpus: count all" in progress
        (ollama,) = tasks_of(view, "ollama_ollama")
        assert ollama["state"] == "running" and ollama["gpus_from"] == "container"
        assert set(ollama["gpus"]) == advertised(view)[ollama["node"]] and len(ollama["gpus"]) == 2
        (webui,) = tasks_of(view, "ollama_open-webui")
        assert webui["state"] == "running" and webui["gpus"] == []
    finally:
        cli("down")
