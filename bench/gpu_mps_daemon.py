"""What a task may try against its GPU's MPS daemon, as root in its container, and what the node does about it
(bench/gpu_mps.py runs it beside slot tasks that keep running): a part of the MPS bench, not a bench.

Every escape the H200 session found (issue 45), tried by a slot task and by a task that reserved nothing:
mounts that reach the MPS folder (its parent, the /var/run path, /run, /, the host's /proc); control words
through the relay (a default and a server's ceiling); a passed descriptor; one idle connection and a flood
of 1,000 (reopened as the relay closes them); a dropped server descriptor after a valid handshake. After
each, the ceilings are read on the host, the daemon answers, and a neighbour on the same GPU allocates
within its share. A neighbour's new client is timed (median of --latency-runs) with nothing, one idle
connection and the flood; a dropped descriptor, which stalls MPS's server (its own weakness), is found by
the health watcher (node/gpu_health.py, real), drained, named and started again: stall to a working GPU,
median of --stall-rounds. A container that bypasses the guard (--runtime runc, the host's / and /run
mounted) finds no daemon socket either: the pipe folder lives in the daemon's own mount namespace.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpu_bench import KIND, REPO, SHARED_KIND, check, wait
from gpu_mps_node import ENGINE, IMAGE, Exporter, containers, docker, given, gone, gpu_of_slot, job, task_env
from swarm.node_contract import MPS_DIR

sys.path.insert(0, str(REPO / "node"))
from health_mps import FIRST_ANSWER  # noqa: E402  (what the watcher logs once a daemon answered it)

MOUNTS = [("parent", "/run/gpu-swarm"), ("var-run", f"/var/run/gpu-swarm/mps"), ("run", "/run"), ("root", "/"),
          ("proc", "/proc")]


def mps_control(gpu: str, command: str, timeout: float = 10) -> str | None:
    """One command to a GPU's control daemon on the host, in its mount namespace, as gpu-swarm-mps sends it;
    None when it does not answer in time."""
    try:
        pid = Path(MPS_DIR, gpu, "daemon.pid").read_text().strip()
        done = subprocess.run(["nsenter", "--target", pid, "--mount", "--", "nvidia-cuda-mps-control"],
                              input=command + "\n", capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": f"{MPS_DIR}/{gpu}/pipe"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def ceilings(gpus: list[str]) -> dict[str, list[str | None]]:
    """Per GPU, read on the host: the daemon's default ceiling, and each server's own."""
    out = {}
    for gpu in gpus:
        servers = (mps_control(gpu, "get_server_list") or "").split()
        out[gpu] = [mps_control(gpu, "get_default_device_pinned_mem_limit 0"),
                    *sorted(str(mps_control(gpu, f"get_device_pinned_mem_limit {s} 0")) for s in servers)]
    return out


def exec_in(container: str, command: str, timeout: float = 60, detach: bool = False) -> tuple[int, str]:
    """A command as root in a running task's container, with the MPS settings the guard gave its first process
    (docker exec starts from the container's config, which the guard does not change); (exit code, output)."""
    mps = [a for k, v in task_env(container).items() if k.startswith("CUDA_MPS_") for a in ("-e", f"{k}={v}")]
    try:
        done = docker("exec", *(["-d"] if detach else []), *mps, container, "sh", "-c", command, check_rc=False,
                      timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "no answer"
    return done.returncode, (done.stdout + done.stderr).strip()


def new_client(container: str, mib: int = 64, limit_s: float = 8) -> float | None:
    """Seconds a new CUDA client in the container took to have its memory, as it timed itself (cuda-probe's
    "ready in"); None when it got none within limit_s."""
    rc, said = exec_in(container, f"cuda-probe {mib} once & p=$!; (sleep {limit_s:g}; kill $p 2>/dev/null) & "
                                  "wait $p", timeout=limit_s + 20)
    ready = re.search(r"ready in (\d+) ms", said)
    return int(ready[1]) / 1000 if rc == 0 and "allocated" in said and ready else None


class Watcher:
    """The node's health watcher, on this bench's engine: its labels reach dockerd, its JSON reports come here."""

    def __init__(self, out: Path, slots: int, gpus: list[str], hold: float = 5):
        self.reports: list[dict] = []
        path = out / "health-watcher.log"
        start = path.stat().st_size if path.exists() else 0
        self.log = open(path, "a")
        cmd = [sys.executable, str(REPO / "node" / "gpu_health.py"), "--json", "--daemon-json",
               str(ENGINE.root / "daemon.json"), "--state-file", str(out / "health-state.json"),
               "--dockerd-pidfile", str(ENGINE.run_dir / "dockerd.pid"), "--docker-socket",
               str(ENGINE.run_dir / "docker.sock"), "--kind", KIND, "--shared-kind", SHARED_KIND,
               "--sharing-mode", "mps", "--mps-dir", MPS_DIR, "--no-maintenance", "--interval", "5",
               "--mps-probe-interval", "1", "--mps-probe-timeout", "2", "--mps-hold", str(hold),
               "--mps-restart", f"bash {shlex.quote(str(REPO / 'node' / 'gpu-swarm-mps'))} start"]
        env = {**os.environ, "GPU_SWARM_SLOTS_PER_GPU": str(slots)}  # node.env, for the restart's ceilings
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()
        # It prints a report when the labels change, so a second watcher says nothing new: its log will do. Until
        # its first ask is answered it names no task for a stall (health_mps.culprit), so a drop waits for that.
        said = lambda: path.read_bytes()[start:].decode(errors="replace")  # noqa: E731  (this watcher's lines)
        wait(lambda: "watching " in said(), 60, "the health watcher to start")
        wait(lambda: all(f"{gpu}: {FIRST_ANSWER}" in said() for gpu in gpus), 60,
             "the health watcher's first ask of every daemon answered")

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.reports.append({**json.loads(line), "seen": time.time()})
            except ValueError:
                pass

    def first(self, after: float, condition: str, limit_s: float) -> dict | None:
        try:
            return wait(lambda: next((r for r in self.reports if r["seen"] >= after and r["condition"] == condition),
                                     None), limit_s, f"a {condition} report")
        except RuntimeError:
            return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def daemon_escapes(out: Path, share: int, slot: list[str], gpus: list[str], exporter: Exporter, slots: int,
                   latency_runs: int, stall_rounds: int) -> None:
    began, before, lines = time.monotonic(), ceilings(gpus), []
    check("every daemon's ceilings are read on the host before the escapes", all(
        v and all(v) for v in before.values()), json.dumps(before))
    neighbour = next(iter(containers("steady")))  # until the attacker's own neighbours are known

    def after(what: str) -> None:
        """What must hold after each try: the ceilings, the daemon answering, a neighbour within its share."""
        now = ceilings(gpus)
        allocated = new_client(neighbour, share - 2048, limit_s=30)
        lines.append(f"{what}: ceilings {json.dumps(now)}; neighbour allocated {share - 2048} MiB: {allocated}")
        check(f"after {what}: every ceiling read on the host unchanged, the daemons answer, and a neighbour "
              f"allocates {share - 2048} of its {share} MiB", now == before and allocated is not None,
              f"{json.dumps(now)[:160]}; neighbour {'allocated' if allocated else 'got nothing'}")

    # First, on the free slot: a slot task's mounts are refused when it starts, so it needs a slot to get there.
    for name, source in MOUNTS:
        said = {}
        for who, extra in (("slot", slot), ("none", [])):
            log = job(f"mount-{name}-{who}", "ls /m; sleep 1", *extra, "--mount",
                      f"type=bind,source={source},target=/m")
            said[who] = log.splitlines()[0] if log else ""
            (out / f"escape-mount-{name}-{who}.log").write_text(log)
        check(f"a slot task and a task with no reservation that mount {source} do not start",
              all(s.startswith(("Failed", "Rejected")) and "where the node's MPS daemons listen" in s
                  for s in said.values()), " | ".join(s.partition("gpu-swarm guard: ")[2][:90] or s[:90]
                                                     for s in said.values()))
    after("the mounts")
    print(f"evidence: the mounts took {time.monotonic() - began:.0f} s", flush=True)

    docker("service", "create", "--detach", "--name", "attacker", *slot, IMAGE, "sleep", "3600")
    docker("service", "create", "--detach", "--name", "loner", IMAGE, "sleep", "3600")  # reserved nothing
    attacker = next(iter(wait(lambda: containers("attacker"), 60, "the attacker to run")))
    loner = next(iter(wait(lambda: containers("loner"), 60, "the task with no reservation to run")))
    gpu = gpu_of_slot(given(attacker, SHARED_KIND))
    pipe = f"{MPS_DIR}/{gpu}/pipe"
    neighbours = [c for c in containers("steady") if gpu_of_slot(given(c, SHARED_KIND)) == gpu]
    check("the attacker holds a slot of a GPU whose other slots hold steady tasks (its neighbours)",
          gpu in gpus and bool(neighbours), f"{gpu}; {len(neighbours)} neighbour(s)")
    if not neighbours:
        gone("attacker")
        gone("loner")
        return
    neighbour = neighbours[0]
    watcher = Watcher(out, slots, gpus)
    try:
        bypass(out, gpu)

        servers = (mps_control(gpu, "get_server_list") or "0").split()
        words = [("set_default_device_pinned_mem_limit 0 200G", "a default ceiling"),
                 (f"set_device_pinned_mem_limit {servers[0]} 0 200G", "its server's ceiling"),
                 ("get_server_list", "a read of the daemon's servers")]
        for command, what in words:
            rc, said = exec_in(attacker, f'mps-peer control "$CUDA_MPS_PIPE_DIRECTORY/control" "{command}"')
            none = [exec_in(loner, f'mps-peer control {p}/control "{command}"') for p in (pipe, pipe[:-4] + "tasks")]
            (out / "escape-control.log").open("a").write(f"{command}\nslot: {rc} {said}\nnone: {none}\n")
            check(f"control words ({what}) through a slot task's socket are cut off, and a task with no reservation "
                  "finds no socket", rc == 3 and "cut off" in said and all(r == 2 for r, _ in none),
                  f"slot: {said[:100]}; none: {[s[:60] for _, s in none]}")
            after(f"control words ({what})")

        rc, said = exec_in(attacker, 'mps-peer fdpass "$CUDA_MPS_PIPE_DIRECTORY/control"')
        none = exec_in(loner, f"mps-peer fdpass {pipe}/control")
        check("a slot task that passes a descriptor is cut off, and a task with no reservation finds no socket",
              rc == 3 and none[0] == 2, f"slot: {said[:100]}; none: {none[1][:80]}")
        after("a passed descriptor")

        print(f"evidence: the relay's escapes done at {time.monotonic() - began:.0f} s", flush=True)
        latencies(out, attacker, loner, neighbour, pipe, latency_runs, after)
        print(f"evidence: the timed clients done at {time.monotonic() - began:.0f} s", flush=True)
        other = [r for r in watcher.reports if r["condition"] != "healthy"]
        check("the watcher saw every GPU healthy through every other escape", not other,
              "; ".join(f"{r['condition']}: {r['reason']}" for r in other)[:200] or "no other condition")
        watcher.stop()
        stalls(out, attacker, neighbour, gpu, slots, exporter, stall_rounds, after)
        print(f"evidence: the stalls done at {time.monotonic() - began:.0f} s", flush=True)
    finally:
        watcher.stop()
        (out / "escapes-after-each.log").write_text("\n".join(lines) + "\n")
        gone("attacker")
        gone("loner")


def bypass(out: Path, gpu: str) -> None:
    """A container that passes no guard (--runtime runc, as only the node's root can start one) with the host's /
    and /run mounted: the daemon's pipe folder is empty there, so not even a path that slipped through reaches it.
    The host's /proc (which the guard refuses too) is tried as well, and shown: /proc/<pid>/root crosses into the
    daemon's namespace where ptrace rules allow it (AppArmor's docker-default does not)."""
    host_pipe = f"{MPS_DIR}/{gpu}/pipe".lstrip("/")
    daemon = Path(MPS_DIR, gpu, "daemon.pid").read_text().strip()
    command = (f'echo "root:[$(ls -A /host/{host_pipe})]"; echo "run:[$(ls -A /host-run/{host_pipe[4:]})]"; '
               f"for p in /host/{host_pipe} /host-run/{host_pipe[4:]}; do for s in control control_privileged; do "
               "mps-peer control $p/$s 'set_default_device_pinned_mem_limit 0 200G'; echo \"rc $?\"; done; done; "
               f"echo proc:; mps-peer control /host/proc/{daemon}/root/{host_pipe}/control_privileged "
               "'get_default_device_pinned_mem_limit 0'; echo \"proc rc $?\"")
    done = docker("run", "--rm", "--runtime", "runc", "-v", "/:/host", "-v", "/run:/host-run", IMAGE, "sh", "-c",
                  command, check_rc=False, timeout=60)
    said = done.stdout + done.stderr
    (out / "escape-bypass.log").write_text(said)
    check("a container that bypasses the guard, with the host's / and /run mounted, finds no daemon socket: the "
          "pipe folder is empty outside the daemon's own mount namespace",
          "root:[]" in said and "run:[]" in said and said.splitlines().count("rc 2") == 4,
          " | ".join(said.split("\n")[:3]))
    print(f"evidence: the host's /proc/{daemon}/root from that container: "
          f"{said.partition('proc:')[2].strip().replace(chr(10), ' | ')[:200]}", flush=True)


def latencies(out: Path, attacker: str, loner: str, neighbour: str, pipe: str, runs: int, after) -> None:
    """A neighbour's new client, timed with nothing, with one idle connection of the attacker's, and under its
    flood of 1,000; the task with no reservation finds no socket to flood."""
    figures = {"nothing": [new_client(neighbour) for _ in range(runs)]}
    hold_s = runs * 4 + 15
    for name, count in (("one idle connection", 1), ("a flood of 1,000 idle connections", 1000)):
        exec_in(attacker, f'mps-peer hold "$CUDA_MPS_PIPE_DIRECTORY/control" {count} {hold_s} >/tmp/hold.log 2>&1',
                detach=True)
        time.sleep(1)  # its connections open
        figures[name] = [new_client(neighbour) for _ in range(runs)]
        held = exec_in(attacker, "cat /tmp/hold.log")[1]
        none = exec_in(loner, f"mps-peer hold {pipe[:-4]}tasks/control {count} 1")
        got = [t for t in figures[name] if t is not None]
        check(f"under {name} from a slot task, every one of a neighbour's {runs} new clients got its memory; "
              "a task with no reservation finds no socket", len(got) == runs and none[0] == 2,
              f"{len(got)} of {runs}; the attacker: {held[:90]}")
        if got:
            median = statistics.median(got)
            check(f"a neighbour's new client under {name}: within 2 s (median of {runs})", median < 2,
                  f"median {median:.2f} s, slowest {max(got):.2f} s (with nothing: median "
                  f"{statistics.median([t for t in figures['nothing'] if t] or [0]):.2f} s), as each client timed itself")
        exec_in(attacker, 'for d in /proc/[0-9]*; do read -r c <"$d/comm" 2>/dev/null || continue; '
                          '[ "$c" = mps-peer ] && kill "${d#/proc/}"; done; true')  # busybox: no pkill
        after(name)
    (out / "new-client-seconds.json").write_text(json.dumps(figures, indent=1))


def stalls(out: Path, attacker: str, neighbour: str, gpu: str, slots: int, exporter: Exporter, rounds: int,
           after) -> None:
    """A valid handshake whose server descriptor is dropped stalls MPS's server for the whole GPU: each round,
    the time from the drop to a neighbour's working client, and what a watcher started for the round said (the
    first one holds the stall 30 s, long enough for the engine labels to reach the swarm's node list)."""
    expected = f"mps_server_stuck_after_attacker_on_{gpu}"
    times, named, restarted, labelled, metric = [], 0, 0, False, False
    for round_ in range(rounds):
        watcher = Watcher(out, slots, [gpu], hold=30 if round_ == 0 else 1)
        try:
            daemon = Path(MPS_DIR, gpu, "daemon.pid").read_text().strip()
            t0 = time.time()
            rc, said = exec_in(attacker, 'mps-peer drop "$CUDA_MPS_PIPE_DIRECTORY/control"')
            working = None
            while time.time() - t0 < 180:
                if new_client(neighbour, limit_s=5) is not None:
                    working = time.time() - t0
                    break
            stalled = watcher.first(t0, "unhealthy", 30)
            if stalled and stalled["reason"] == expected and stalled["gpu"] == gpu:
                named += 1
            if Path(MPS_DIR, gpu, "daemon.pid").read_text().strip() != daemon:
                restarted += 1
            if round_ == 0 and stalled:
                try:  # what `docker node inspect` shows, `up`'s wait and `localswarm status` among its readers
                    labelled = bool(wait(lambda: expected in docker(
                        "node", "inspect", "self", "--format", "{{json .Description.Engine.Labels}}").stdout, 30,
                                         "the stall in the node's engine labels"))
                except RuntimeError:
                    labelled = False
                metric = any(n == "gpu_swarm_condition" and labels.get("reason") == expected
                             for n, labels, _ in exporter.scrape() or ())
            times.append(working)
            with (out / "stall-rounds.log").open("a") as log:
                log.write(f"drop: {rc} {said}; working after {working}; watcher: {json.dumps(stalled)[:600]}\n")
            if round_ == 0:
                watcher.first(t0, "healthy", 60)  # its hold, seen through: the GPU given back
        finally:
            watcher.stop()
    ok = [t for t in times if t is not None]
    check(f"a dropped server descriptor stalls the GPU, and the watcher finds it, drains it as {expected[:40]}..., "
          f"names the attacker's service and starts daemon and server again, every round ({rounds})",
          len(ok) == rounds and named == rounds and restarted == rounds,
          f"{len(ok)} working again, {named} named, {restarted} restarted")
    check("the report names the service: the node's engine labels (what `up`'s wait and `localswarm status` "
          "read) and the exporter's condition series", labelled and metric,
          f"labels {'name it' if labelled else 'do not'}; metrics {'name it' if metric else 'do not'}")
    if ok:
        check(f"from a stalled server to a working GPU (median of {rounds})", True,
              f"median {statistics.median(ok):.1f} s, slowest {max(ok):.1f} s")
    after("the stalls")
