"""A stack's removal (swarm/stacks.py remove_stack_function), in real bash, against a stub `docker`.

The stub keeps one stack: a service, and a network that its task still runs on for the first
few calls after the service is removed. As swarm does, it refuses to remove a network a task
still runs on (moby/swarmkit#2726); as the CLI does (docker/cli cli/command/stack/swarm/remove.go),
`docker stack rm` then prints "Failed to remove network ID: ..." and "Failed to remove some
resources from stack: NAME" on stderr and exits 1, having removed the services.
"""
from __future__ import annotations

import subprocess

from swarm import reconcile, stacks

STUB = r"""#!/bin/bash
s=$STUB_DIR
echo "$*" >> "$s/calls"
tick() { n=$(cat "$s/task" 2>/dev/null || echo 0); [ "$n" -gt 0 ] && echo $((n - 1)) > "$s/task"; true; }
busy() { [ "$(cat "$s/task" 2>/dev/null || echo 0)" -gt 0 ]; }
case "$1 $2" in
  "stack ls") [ -e "$s/service" ] && echo smoke; exit 0 ;;
  "stack rm")
    [ -n "$REFUSE" ] && { echo "$REFUSE" >&2; exit 1; }
    rm -f "$s/service"; echo "Removing service smoke_gpu"; echo "Removing network smoke_default"
    if busy; then
      printf 'Failed to remove network n1: Error response from daemon: rpc error: code = FailedPrecondition desc = network n1 is in use by task t1' >&2
      echo "Failed to remove some resources from stack: smoke" >&2; exit 1
    fi
    rm -f "$s/network"; exit 0 ;;
  "service ls") tick; [ -e "$s/service" ] && echo s1; exit 0 ;;
  "network ls") tick; [ -e "$s/network" ] && echo n1; exit 0 ;;
  "network rm")
    if busy; then echo "Error response from daemon: rpc error: code = FailedPrecondition desc = network n1 is in use by task t1" >&2; exit 1; fi
    rm -f "$s/network"; echo n1; exit 0 ;;
  "config rm") exit 0 ;;
esac
echo "stub: unexpected docker $*" >&2; exit 2
"""


def remove(tmp_path, *, task_polls: int, refuse: str = "", timeout_s: int = 20) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "docker").write_text(STUB)
    (tmp_path / "docker").chmod(0o755)
    for thing in ("service", "network"):
        (tmp_path / thing).touch()
    (tmp_path / "task").write_text(f"{task_polls}\n")
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "STUB_DIR": str(tmp_path), "REFUSE": refuse}
    done = subprocess.run(["bash", "-c", stacks.remove_stack("smoke", timeout_s=timeout_s)], env=env, capture_output=True,
                          text=True, timeout=60)
    return done, (tmp_path / "calls").read_text().splitlines()


def test_a_network_its_stopping_task_still_held_is_removed_once_the_task_is_gone(tmp_path):
    done, calls = remove(tmp_path, task_polls=3)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "stack smoke removed\n" and done.stderr == ""
    assert not (tmp_path / "network").exists() and not (tmp_path / "service").exists()
    assert calls.count("network rm n1") >= 1 and calls[-1] == "config rm gpu-swarm.stack.smoke"


def test_a_stack_whose_tasks_stopped_at_once_is_removed_by_stack_rm_alone(tmp_path):
    done, calls = remove(tmp_path, task_polls=0)
    assert done.returncode == 0, done.stderr
    assert not any(c.startswith("network rm") for c in calls)


def test_any_other_refusal_fails_the_removal_with_the_daemons_words(tmp_path):
    words = "Error response from daemon: This node is not a swarm manager."
    done, calls = remove(tmp_path, task_polls=0, refuse=words)
    assert done.returncode == 1 and done.stderr.strip() == words
    assert (tmp_path / "network").exists() and "config rm gpu-swarm.stack.smoke" not in calls


def test_a_network_that_never_frees_fails_after_the_wait_and_says_what_is_left(tmp_path):
    done, _ = remove(tmp_path, task_polls=10_000, timeout_s=2)
    assert done.returncode == 1
    assert "gpu-swarm: stack smoke still has services or networks (gave up after 2 s)" in done.stderr


def test_the_reconcile_removes_stacks_with_the_same_function():
    text = reconcile.reconcile(nodes=["a" * 25], stacks=["smoke"])
    assert "\n".join(stacks.remove_stack_function()) in text and text.count("remove_stack() {") == 1
