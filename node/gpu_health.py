#!/usr/bin/env python3
"""GPU health watcher for gpu-swarm nodes: one node condition, published as engine labels.

Swarm cannot take one GPU away from a running node (node-generic-resources is read only
when dockerd starts; restarting dockerd stops the node's tasks), so the node is the unit.
This watcher only reports, as gpu-swarm.condition* engine labels (daemon.json + SIGHUP:
labels reload live); the reconciler on the managers drains. Inputs: NVML events (critical
XIDs, ECC errors), a check of every advertised GPU each --interval, IMDSv2's scheduled
maintenance events (every node) and spot notices (--spot); --inventory and --faults simulate
GPUs and faults for a rehearsal.
Stdlib plus pynvml (package nvidia-ml-py), imported only when NVML is used.

Exit codes: 0 done (--once), or the advertised GPUs changed (systemd starts it again);
1 a file could not be read or written; 2 bad input (nothing written); 3 NVML failing at start.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # the agent's modules ship beside this file (tests load it by path)
from contract import (CAPACITY_BLOCK_END_ENV, CONDITION_GPU_LABEL, CONDITION_LABEL,  # noqa: E402
                      CONDITION_REASON_LABEL, CONDITION_SINCE_LABEL, DOCKER_DAEMON_JSON, DRAIN_CONDITIONS, DOCKER_SOCKET, DOCKERD_PIDFILE, HEALTH_CRITICAL_XIDS_ENV, HEALTH_IGNORE_XIDS_ENV,
                      HEALTH_INTERVAL_ENV, HEALTH_RECOVERY_ENV, HEALTH_STATE_PATH, KIND_ENV, MPS_DIR, SHARED_KIND_ENV,
                      SHARING_MODE_ENV, SPOT_ENV)
from daemon_json import locked, read_daemon_json, write_atomic  # noqa: E402
from gpu_detect import BadInput, DetectionFailed  # noqa: E402
from gpu_resources import DEFAULT_KIND, default_shared_kind, validate_kind  # noqa: E402
from health_rules import (OK, Tracker, condition_labels, ignored_xids, merge_labels, node_condition,  # noqa: E402
                          watched_uuids)
from health_mps import RESTART, MpsWatchdog, check_mps  # noqa: E402
from health_sources import (CAPACITY_BLOCK_DRAIN_S, CAPACITY_BLOCK_TERMINATION_S, DEFAULT_IMDS,  # noqa: E402
                            MAINTENANCE_LEAD_S, Imds, Nvml, Simulation, parse_block_end)
from sentinel import signal_sentinel  # noqa: E402

# --- output and the loop ------------------------------------------------------------------

def send_sighup(pidfile: str) -> str:
    """Ask dockerd to reload daemon.json; says what happened, for the log."""
    try:
        with open(pidfile, encoding="utf-8") as f:
            pid = int(f.read().strip())
    except FileNotFoundError:
        return f"no {pidfile}: dockerd is not running, and reads the labels when it starts"
    except (OSError, ValueError) as e:
        return f"no pid in {pidfile} ({e}); dockerd was not told"
    if pid <= 1:  # kill() of 0 or -1 would signal whole process groups
        return f"{pidfile} holds pid {pid}; dockerd was not told"
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as e:
        return f"SIGHUP to dockerd (pid {pid}) failed: {e.strerror}"
    return f"sent SIGHUP to dockerd (pid {pid})"


def read_config(path: str) -> dict:
    try:
        return read_daemon_json(path) or {}
    except BadInput as e:
        raise BadInput(str(e).replace("run the agent again", "the watcher tries again"))


def publish(args, tracker: Tracker, uuids: list[str], imds: tuple[str, str], now: float, log) -> dict | None:
    """Write the labels (and tell dockerd) when they changed; returns the report."""
    with locked(args.daemon_json):  # the agent may be rewriting it too
        config = read_config(args.daemon_json)
        if watched_uuids(config, args.kind, args.shared_kind) != uuids:
            return None  # other GPUs: write nothing, run() decides
        states = tracker.states(uuids, now)
        condition, reason, gpu = node_condition(states, imds)
        old = dict(label.split("=", 1) for label in config.get("labels", [])
                   if label.startswith(CONDITION_LABEL) and "=" in label)
        since = old.get(CONDITION_SINCE_LABEL, "")
        labels = condition_labels(condition, reason, gpu,
                                  since if old.get(CONDITION_LABEL) == condition and since.isdigit() else now)
        report = {"condition": condition, "reason": labels[CONDITION_REASON_LABEL], "gpu": labels[CONDITION_GPU_LABEL],
                  "since": int(labels[CONDITION_SINCE_LABEL]), "changed": labels != old, "labels": labels,
                  "gpus": {uuid: {"condition": c, "reason": r} for uuid, (c, r) in states.items()},
                  "imds": {"condition": imds[0], "reason": imds[1]} if args.spot is not False or args.maintenance else None,
                  "dockerd": "not told"}
        if report["changed"]:  # compared as labels, so a restart in the same condition writes nothing
            write_atomic(args.daemon_json, (json.dumps(merge_labels(config, labels), indent=2) + "\n").encode())
    if report["changed"]:
        report["dockerd"] = send_sighup(args.dockerd_pidfile)
        log(f"condition {condition} (was {old.get(CONDITION_LABEL, 'unset')}): {report['reason']} gpu={report['gpu']}; "
            f"{report['dockerd']}")
    if report["changed"] and condition in DRAIN_CONDITIONS and old.get(CONDITION_LABEL) not in DRAIN_CONDITIONS:
        report["sentinel"] = signal_sentinel(args.docker_socket)  # once a fault: its task restarts for the next
        log(report["sentinel"])
    if tracker.state() != tracker.saved:
        write_atomic(args.state_file, (tracker.state() + "\n").encode())
        tracker.saved = tracker.state()
    return report


def run(args, log, clock=time.time) -> int:
    try:
        args.kind = validate_kind(args.kind)
        args.shared_kind = validate_kind(args.shared_kind or default_shared_kind(args.kind))
    except ValueError as e:
        raise BadInput(f"--kind/--shared-kind: {e}")
    uuids = watched_uuids(read_config(args.daemon_json), args.kind, args.shared_kind)
    ignored = ignored_xids(args.ignore_xids, args.critical_xids)
    tracker = Tracker(args.recovery_seconds, log)
    tracker.load(args.state_file)
    tracker.events = {uuid: event for uuid, event in tracker.events.items() if uuid in uuids}  # GPUs since replaced
    source = Simulation(args.inventory, args.faults, log) if args.inventory else Nvml(uuids, log)
    watch_imds = args.spot is not False or args.maintenance or args.capacity_block_end is not None
    imds = Imds(args.imds, log, args.spot, args.maintenance, block_end=args.capacity_block_end) if watch_imds else None
    watchdog = MpsWatchdog(args.mps_dir, log, args.docker_socket, args.mps_probe_timeout, args.mps_hold,
                           shlex.split(args.mps_restart)) if args.sharing_mode == "mps" else None
    imds_state, next_check, error, changes = OK, 0.0, None, 0
    next_probe = 0.0  # MPS: a stuck server is found within seconds, not at the next --interval
    next_poll = 0.0  # IMDS: a notice gives two minutes, so it is asked more often than the GPUs are checked
    asked = [what for what, on in (("scheduled maintenance", args.maintenance),
                                   ("spot notices" if args.spot else "spot notices if IMDS says it is spot",
                                    args.spot is not False),
                                   ("its Capacity Block's end", args.capacity_block_end is not None)) if on]
    log(f"watching {len(uuids)} GPU(s) of {args.kind} and {args.shared_kind}{''.join(', ' + a for a in asked)}; "
        f"ignoring XIDs {','.join(map(str, sorted(ignored)))}")
    try:
        while True:
            report = None
            try:
                now = clock()
                if now >= next_check:
                    source.check(uuids, tracker, now, ignored)
                    if args.sharing_mode == "mps":
                        check_mps(uuids, tracker, now, args.mps_dir, watchdog)
                    next_check = now + args.interval
                if watchdog and now >= next_probe:
                    watchdog.check(uuids, tracker, now)
                    next_probe = now + min(args.mps_probe_interval, args.interval)
                if imds and now >= next_poll:
                    imds_state = imds.poll(now)
                    next_poll = now + min(args.imds_interval, args.interval)
                for _ in range(1000 if args.once else 0):  # --once: take the events already queued
                    if not source.wait(0, tracker, ignored, clock):
                        break
                report, error = publish(args, tracker, uuids, imds_state, clock(), log), None
                changes = 0 if report else changes + 1
            except (BadInput, OSError) as e:
                if args.once:
                    raise
                if str(e) != error:  # a corrupt daemon.json must not end the watch: log once, retry
                    log(f"error: {e}; trying again every {args.interval:g}s")
                error = str(e)
            if changes >= (1 if args.once else 2):  # twice: not a file in the middle of a rewrite
                log("the advertised GPUs changed: exiting, for systemd to start the watcher on them")
                return 0
            if report and (args.once or (args.json and report["changed"])):
                print(json.dumps(report) if args.json else
                      f"condition {report['condition']}: {report['reason']} gpu={report['gpu']}", flush=True)
            if args.once:
                return 0
            source.wait(min(next_check, next_poll if imds else next_check, next_probe if watchdog else next_check)
                        - clock(), tracker, ignored, clock)
    finally:
        source.close()


def _seconds(text: str) -> float:
    if not re.fullmatch(r"\d+\.?\d*|\.\d+", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return float(text)


def _block_end(text: str) -> float | None:
    try:
        return parse_block_end(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a time such as 2026-12-04T11:30:00Z")


def _xids(text: str) -> frozenset[int]:
    if not re.fullmatch(r"[\d, ]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of XIDs, such as 13,43")
    return frozenset(int(part) for part in text.replace(" ", "").split(",") if part)


def parse_args(argv, env=os.environ) -> argparse.Namespace:
    spot_env = env.get(SPOT_ENV, "").strip().lower()
    parser = argparse.ArgumentParser(
        description="Watch this node's GPUs; publish one condition (healthy, degraded, unhealthy, reclaim) as "
                    f"{CONDITION_LABEL}* engine labels. Exit 0 ok, 1 I/O error, 2 bad input, 3 NVML failing. "
                    "A $NAME in the help is the environment variable that sets the default.")
    add = parser.add_argument
    add("--daemon-json", default=DOCKER_DAEMON_JSON, metavar="PATH",
        help=f"read the GPUs from and write the labels to (default {DOCKER_DAEMON_JSON})")
    add("--kind", default=env.get(KIND_ENV) or DEFAULT_KIND, help=f"GPU kind (${KIND_ENV}, {DEFAULT_KIND})")
    add("--shared-kind", default=env.get(SHARED_KIND_ENV) or None,
        help=f"also watch the GPUs whose slots (GPU-x-sN) this kind advertises (${SHARED_KIND_ENV}, <kind>-SHARED)")
    add("--interval", type=_seconds, default=env.get(HEALTH_INTERVAL_ENV) or "10",
        help=f"seconds between checks (${HEALTH_INTERVAL_ENV}, 10)")
    add("--recovery-seconds", type=_seconds, default=env.get(HEALTH_RECOVERY_ENV) or "300",
        help=f"an event's state clears once checks have passed this long (${HEALTH_RECOVERY_ENV}, 300)")
    add("--ignore-xids", type=_xids, default=env.get(HEALTH_IGNORE_XIDS_ENV, ""),
        help=f"XIDs to ignore besides 13,31,43,45,68,109 (${HEALTH_IGNORE_XIDS_ENV})")
    add("--critical-xids", type=_xids, default=env.get(HEALTH_CRITICAL_XIDS_ENV, ""),
        help=f"XIDs never to ignore (${HEALTH_CRITICAL_XIDS_ENV})")
    add("--sharing-mode", default=env.get(SHARING_MODE_ENV) or "time-slicing", choices=("time-slicing", "mps"),
        help=f"mps: also check each GPU's MPS control daemon (${SHARING_MODE_ENV})")
    add("--mps-dir", default=MPS_DIR, metavar="PATH", help=f"where the MPS daemons keep their pipes (default {MPS_DIR})")
    add("--mps-probe-interval", type=_seconds, default="2", metavar="S",
        help="mps: seconds between asks of each daemon whether it and its server still serve (default 2)")
    add("--mps-probe-timeout", type=_seconds, default="3", metavar="S",
        help="mps: an ask unanswered this long fails; two in a row make the GPU mps_server_stuck (default 3)")
    add("--mps-hold", type=_seconds, default="60", metavar="S",
        help="mps: a GPU found stuck stays unhealthy at least this long, so that the node is drained (default 60)")
    add("--mps-restart", default=" ".join(RESTART), metavar="COMMAND",
        help=f"mps: what starts a killed daemon again, in gpu-swarm-mps's own unit (default {' '.join(RESTART)})")
    add("--spot", action=argparse.BooleanOptionalAction,
        default=None if not spot_env else spot_env in ("1", "true", "yes"),
        help=f"watch IMDS for spot interruption and rebalance notices (${SPOT_ENV}); default: when IMDS's "
             "instance-life-cycle says spot")
    add("--maintenance", action=argparse.BooleanOptionalAction, default=True,
        help="watch IMDS for scheduled maintenance events, on every node: one that begins within "
             f"{MAINTENANCE_LEAD_S // 60} minutes drains the node as a spot reclaim does (default on)")
    add("--capacity-block-end", type=_block_end, default=env.get(CAPACITY_BLOCK_END_ENV, ""), metavar="TIME",
        help=f"a Capacity Block's end (RFC 3339): the node drains {CAPACITY_BLOCK_DRAIN_S // 60} minutes before it, "
             f"ahead of AWS's termination {CAPACITY_BLOCK_TERMINATION_S // 60} minutes before (${CAPACITY_BLOCK_END_ENV})")
    add("--imds", default=DEFAULT_IMDS, metavar="URL", help=f"instance metadata service (default {DEFAULT_IMDS})")
    add("--imds-interval", type=_seconds, default="2", metavar="S",
        help="seconds between asks of IMDS, at most --interval (default 2, as AWS's Node Termination Handler)")
    add("--dockerd-pidfile", default=DOCKERD_PIDFILE, metavar="PATH", help=f"(default {DOCKERD_PIDFILE})")
    add("--docker-socket", default=DOCKER_SOCKET, metavar="PATH", help=f"dockerd's API, to signal the sentinel "
        f"task on a fault (default {DOCKER_SOCKET})")
    add("--state-file", default=HEALTH_STATE_PATH, metavar="PATH",
        help=f"where events are remembered across restarts (default {HEALTH_STATE_PATH})")
    add("--inventory", metavar="FILE", help="simulated GPUs (the agent's inventory format); NVML is not touched")
    add("--faults", metavar="FILE", help='with --inventory, re-read each interval: {"<uuid>": {"xid": 79} | {"ecc": '
                                         '"double"|"single"} | {"missing": true} | {"pending_retirement": true}}')
    add("--once", action="store_true", help="check once, write, print the report and exit")
    add("--json", action="store_true", help="print each report as one JSON line (and log to stderr)")
    args = parser.parse_args(argv)
    if spot_env not in ("", "1", "true", "yes", "0", "false", "no"):
        parser.error(f"{SPOT_ENV}={spot_env!r}: expected true or false")
    if args.faults and not args.inventory:
        parser.error("--faults needs --inventory (simulated GPUs)")
    if args.interval <= 0 or args.imds_interval <= 0 or args.mps_probe_interval <= 0 or args.mps_probe_timeout <= 0:
        parser.error("--interval, --imds-interval, --mps-probe-interval and --mps-probe-timeout must be more than 0 "
                     "seconds")
    return args


def main(argv=None, clock=time.time) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)
    try:
        return run(args, log, clock)
    except (BadInput, DetectionFailed) as e:
        print(f"gpu-swarm health: {e}", file=sys.stderr)
        return 2 if isinstance(e, BadInput) else 3
    except OSError as e:
        print(f"gpu-swarm health: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
