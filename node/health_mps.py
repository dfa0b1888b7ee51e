"""The health watcher's look at a pool that shares its GPUs by MPS: each GPU's MPS control daemon,
and the relay (mps_relay.py) through which slot tasks reach them.

A GPU whose daemon is gone is unhealthy: its slot tasks' clients lose their server, and the
guard starts no new slot task on it (without the daemon CUDA would run it outside MPS, without
its memory limit). The reconciler then drains the node; `systemctl restart gpu-swarm-mps`
brings the daemons back, and the condition clears after the usual recovery time. Without the
relay no slot task reaches any daemon and the guard starts none: every GPU is unhealthy alike.

A daemon that runs but no longer serves is worse: MPS's own weakness (measured on an H200) lets one
client that takes its server descriptor and never speaks on it stop the server for every client of the
GPU, and the daemon blocks for good on the next command that needs the server. MpsWatchdog asks a
daemon for its server and that server's memory ceiling, with the node's own nvidia-cuda-mps-control in
the daemon's namespace and a time limit, within seconds of the relay handing out a server descriptor
(only a client that got one can stall the server) and once a minute besides: each ask is four lines of
the daemon's control.log, which lives in /run, so asking every few seconds for weeks would fill the
node's memory. Two unanswered asks in a row make the
GPU unhealthy (mps_server_stuck_after_<who>_on_<uuid>: the task that got the server's last descriptor
before the stall, from the relay's last-clients), which drains the node; everything in the daemon's
namespace is killed by pid, and `systemctl reload gpu-swarm-mps` starts that daemon and its server
again. The GPU is healthy again once an ask is answered and the drain has had its time (--mps-hold).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from contract import MPS_DAEMON_PID, MPS_LAST_CLIENTS, MPS_NAMESPACE, MPS_UNIT
from guard_files import mps_daemon_alive, mps_relay_alive  # the guard's own tests, so both see them alike
from health_rules import OK, RANK, Tracker

MPS_RELAY_DOWN = "mps_relay_down"
STUCK = "mps_server_stuck"
RESTART = ("systemctl", "reload", MPS_UNIT)  # in the unit's own cgroup, not the watcher's
BACKSTOP_S = 60.0  # a daemon no descriptor went out of is asked this often all the same
_REASON_ROOM = 120  # condition_labels keeps this much of a reason
FIRST_ANSWER = "its MPS daemon and server answered the watchdog's first ask"  # once per GPU; benches wait on it


def mps_reason(uuid: str) -> str:
    return f"mps_daemon_down_on_{uuid}"


def stuck_reason(uuid: str, who: str | None) -> str:
    """mps_server_stuck_after_<who>_on_<uuid>: the GPU last, as every fault reason (stack_tasks reads it so)."""
    tail = f"_on_{uuid}"
    if not who:
        return STUCK + tail
    room = _REASON_ROOM - len(STUCK) - len("_after_") - len(tail)
    return f"{STUCK}_after_{who[:room]}{tail}"


def check_mps(uuids: list[str], tracker: Tracker, now: float, mps_dir: str,
              watchdog: "MpsWatchdog | None" = None) -> None:
    """After the GPU check: a GPU that passed it but has no live MPS daemon, or no relay, or a daemon the
    watchdog found stuck, is unhealthy."""
    relay = mps_relay_alive(mps_dir)
    for uuid in uuids:
        condition, _ = tracker.checks.get(uuid, ("healthy", "ok"))
        if RANK[condition] < RANK["unhealthy"]:
            if watchdog and uuid in watchdog.stuck:  # its daemon may be down meanwhile: the watchdog restarts it
                tracker.check(uuid, "unhealthy", watchdog.stuck[uuid]["reason"], now)
            elif not mps_daemon_alive(mps_dir, uuid):
                tracker.check(uuid, "unhealthy", mps_reason(uuid), now)
            elif not relay:
                tracker.check(uuid, "unhealthy", MPS_RELAY_DOWN, now)


class MpsWatchdog:
    """Asks every GPU's daemon whether it still serves (probe), and brings a stuck one back."""

    def __init__(self, mps_dir: str, log, docker_socket: str | None = None, timeout: float = 3, hold: float = 60,
                 restart: tuple[str, ...] | list[str] = RESTART, utility: str = "nvidia-cuda-mps-control",
                 failures: int = 2, retry: float = 60):
        self.mps_dir, self.log, self.docker_socket = mps_dir, log, docker_socket
        self.timeout, self.hold, self.restart_cmd, self.utility = timeout, hold, list(restart), utility
        self.failures, self.retry = failures, retry
        self.failed: dict[str, int] = {}
        self.last_ok: dict[str, float] = {}  # when the last answered ask began
        self.asked: dict[str, float] = {}  # when the last ask began (the watcher's clock)
        self.stuck: dict[str, dict] = {}  # uuid -> {"reason", "since", "restarted"}

    # ---- asking

    def ask(self, uuid: str, pid: int, command: str) -> str:
        """One command to the daemon, in its namespace; raises on no answer within the time limit."""
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": f"{self.mps_dir}/{uuid}/pipe"}
        try:
            done = subprocess.run(["nsenter", "--target", str(pid), "--mount", "--", self.utility],
                                  input=command + "\n", capture_output=True, text=True, timeout=self.timeout, env=env)
        except subprocess.TimeoutExpired:
            raise OSError(f"no answer to {command.split()[0]} within {self.timeout:g} s")
        if done.returncode:
            raise OSError(f"{command}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[:120]}")
        return done.stdout.strip()

    def probe(self, uuid: str) -> str | None:
        """None when the daemon answers and so does its server (get_device_pinned_mem_limit needs it); else why."""
        try:
            with open(f"{self.mps_dir}/{uuid}/{MPS_DAEMON_PID}", encoding="utf-8") as f:
                pid = int(f.read().strip())
            servers = self.ask(uuid, pid, "get_server_list").split()
            if servers and not self.ask(uuid, pid, f"get_device_pinned_mem_limit {servers[0]} 0"):
                return f"its server {servers[0]} gave no memory ceiling"
        except (OSError, ValueError) as e:
            return str(e)
        return None

    def due(self, uuid: str, now: float) -> bool:
        """A descriptor handed out since the last answered ask, an ask that failed, a stall, or a minute."""
        if uuid in self.stuck or self.failed.get(uuid) or now - self.asked.get(uuid, -BACKSTOP_S) >= BACKSTOP_S:
            return True
        try:
            handed = os.stat(f"{self.mps_dir}/{uuid}/{MPS_LAST_CLIENTS}").st_mtime
        except OSError:
            return False
        return handed >= self.last_ok.get(uuid, 0.0)

    def check(self, uuids: list[str], tracker: Tracker, now: float) -> None:
        """Every GPU whose daemon runs and is due: asked once; stuck after `failures` unanswered asks in a row."""
        for uuid in uuids:
            if not mps_daemon_alive(self.mps_dir, uuid) and uuid not in self.stuck:
                continue  # check_mps says so: mps_daemon_down
            if not self.due(uuid, now):
                continue
            self.asked[uuid] = now
            began = time.time()
            why = self.probe(uuid) if mps_daemon_alive(self.mps_dir, uuid) else "its daemon is not running"
            if why is None:
                self.failed.pop(uuid, None)
                if uuid not in self.last_ok:  # what a stall is measured from: until then no task can be named
                    self.log(f"{uuid}: {FIRST_ANSWER}")
                self.last_ok[uuid] = began
                self.recovered(uuid, tracker, now)
                continue
            self.failed[uuid] = self.failed.get(uuid, 0) + 1
            state = self.stuck.get(uuid)
            if state is None and self.failed[uuid] >= self.failures:
                who = self.culprit(uuid)
                state = self.stuck[uuid] = {"reason": stuck_reason(uuid, who), "since": now, "restarted": 0.0}
                self.log(f"{uuid}: the MPS daemon or its server no longer serves ({why}, {self.failed[uuid]} times); "
                         f"the last task that got a server descriptor before: {who or 'unknown'}. Draining, and "
                         "starting it again")
            if state is not None:
                tracker.check(uuid, "unhealthy", state["reason"], now)
                if now - state["restarted"] >= self.retry:
                    state["restarted"] = now
                    self.bring_back(uuid)

    def recovered(self, uuid: str, tracker: Tracker, now: float) -> None:
        state = self.stuck.get(uuid)
        if state is None:
            return
        if now - state["since"] < self.hold:
            tracker.check(uuid, "unhealthy", state["reason"], now)  # the drain has its time
            return
        del self.stuck[uuid]
        if tracker.checks.get(uuid, OK)[1] == state["reason"]:
            tracker.check(uuid, *OK, now)
        self.log(f"{uuid}: the MPS daemon and its server serve again, {now - state['since']:.0f} s after the stall "
                 "was found")

    # ---- who, and bringing it back

    def culprit(self, uuid: str) -> str | None:
        """The task that got a server descriptor first after the last answered ask (else the last one before):
        its swarm service, its container, or its pid. None when no ask of this watcher's was ever answered (it
        started on a stalled server): the stall may predate every descriptor it could name, and a drain that
        names an innocent task sends its owner looking in the wrong place."""
        try:
            with open(f"{self.mps_dir}/{uuid}/{MPS_LAST_CLIENTS}", encoding="utf-8") as f:
                entries = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return None
        if not entries:
            return None
        since = self.last_ok.get(uuid)
        if since is None:
            self.log(f"{uuid}: no ask answered since this watcher started, so no task is named; the last "
                     f"{min(len(entries), 3)} that got a server descriptor: "
                     + ", ".join(str(e.get("container") or e.get("pid"))[:12] for e in entries[-3:]))
            return None
        after = [e for e in entries if e.get("at", 0) >= since]
        entry = after[0] if after else entries[-1]
        if len(after) > 1:
            self.log(f"{uuid}: {len(after)} tasks got a server descriptor since the last answered ask: "
                     + ", ".join(str(e.get("container") or e.get("pid"))[:12] for e in after))
        container = entry.get("container")
        if container and self.docker_socket:
            from gpu_tasks import DockerUnavailable, docker_get
            try:
                labels = docker_get(self.docker_socket, f"/containers/{container}/json")["Config"]["Labels"] or {}
                service = labels.get("com.docker.swarm.service.name")
                if service:
                    return service
            except (DockerUnavailable, KeyError, TypeError, ValueError):
                pass
        return container[:12] if container else f"pid_{entry.get('pid')}"

    def bring_back(self, uuid: str) -> None:
        killed = kill_namespace(f"{self.mps_dir}/{uuid}")
        try:
            done = subprocess.run(self.restart_cmd, capture_output=True, text=True, timeout=90)
            said = f"exit {done.returncode}: {(done.stdout + done.stderr).strip()[-200:]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            said = str(e)
        self.log(f"{uuid}: killed pid {' '.join(map(str, killed)) or 'none'} (its daemon's namespace); "
                 f"{' '.join(self.restart_cmd)}: {said}")


def kill_namespace(folder: str, wait_s: float = 5) -> list[int]:
    """SIGKILL every process in the mount namespace named in FOLDER/namespace (a GPU's daemon and server),
    never this one's or init's; the pids, once they are gone (or wait_s passed)."""
    try:
        with open(f"{folder}/{MPS_NAMESPACE}", encoding="utf-8") as f:
            namespace = f.read().strip()
    except OSError:
        return []
    if not namespace.startswith("mnt:[") or namespace in _own_namespaces():
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == namespace:
                    pids.append(int(entry))
            except OSError:
                continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.05)
    return pids


def _own_namespaces() -> set[str]:
    """This process's mount namespace and init's (when it may read it): never killed, whatever a file says."""
    found = set()
    for pid in ("self", "1"):
        try:
            found.add(os.readlink(f"/proc/{pid}/ns/mnt"))
        except OSError:
            pass
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
