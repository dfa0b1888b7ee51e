#!/usr/bin/env python3
"""The scaler of elastic pools: on the swarm leader, each round, read the swarm and the pools' groups, decide, act.

Runs on every manager (gpu-swarm-scaler.service), beside the health reconciler; only the leader acts.
Each --interval it reads the pools the program configured (AUTOSCALE_POOLS_PATH; none: it idles), every
node and task of the swarm (the Engine API), and each pool's Auto Scaling group (DescribeAutoScalingGroups,
with the managers' instance role), and carries out what node/scale_plan.py decides: the group's desired
capacity, a node's pause, drain, give-back or removal, the admit of a node that joined (the pool's admit
script, run in the background: its GPU check takes seconds), and the removal of swarm nodes whose instance
is gone. Every decision is logged with its reason; each pool's numbers and last decision are kept in a label
of the leader's own node (AUTOSCALE_STATUS_LABEL), which `localswarm program status` shows. All it must
remember between rounds is in node labels and the groups, so a new leader goes on where the last stopped.
Stdlib and its siblings (contract.py, aws_api.py, scale_plan.py, swarm_reconciler.py's docker CLI).

Exit codes: 0 done; 1 (--once only) a round had errors; 2 bad input.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import aws_api  # noqa: E402
import scale_plan  # noqa: E402
from contract import (AUTOSCALE_ADMIT_SUFFIX, AUTOSCALE_DIR, AUTOSCALE_POOLS_PATH, AUTOSCALE_STATUS_LABEL,  # noqa: E402
                      DOCKER_SOCKET, METRICS_PORT)
from swarm_reconciler import Engine, EngineError  # noqa: E402

ADMIT_TIMEOUT_S = 900  # the admit's GPU check waits up to 180 s for its jobs; the rest is the engine's


def read_pools(path: str) -> tuple[str, list[scale_plan.Pool]]:
    """(region, pools) from the program's pools.json; ("", []) when there is none (no elastic pool)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return "", []
    return str(doc.get("region") or ""), [scale_plan.Pool.from_json(p) for p in doc.get("pools") or []]


class Swarm(Engine):
    """The docker CLI for changes (as the reconciler makes them), the Engine API for the tasks' full specs."""

    def __init__(self, docker: str, sock: str):
        super().__init__(docker)
        self.sock = sock

    def tasks(self) -> list[dict]:
        conn = http.client.HTTPConnection("localhost", timeout=self.timeout)
        conn.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.sock.settimeout(self.timeout)
            conn.sock.connect(self.sock)
            conn.request("GET", "/tasks")
            answer = conn.getresponse()
            body = answer.read()
        except (OSError, http.client.HTTPException) as e:
            raise EngineError(f"GET /tasks on {self.sock}: {e}") from None
        finally:
            conn.close()
        if answer.status != 200:
            raise EngineError(f"GET /tasks answered {answer.status}: {body[:200]!r}")
        return json.loads(body)

    def self_id(self) -> str:
        return self._run("info", "--format", "{{.Swarm.NodeID}}").strip()

    def remove(self, args: tuple[str, ...]) -> None:
        self._run("node", "rm", *args)


class Scaler:
    def __init__(self, swarm: Swarm, client_for, admit_dir: str, log, clock=time.time):
        self.swarm, self.client_for, self.admit_dir, self.log, self.clock = swarm, client_for, admit_dir, log, clock
        self.admitting: dict[str, threading.Thread] = {}
        self.last: dict[str, str] = {}  # pool -> its last decision, "<time> <what>: <why>"
        self.said: list[str] = []  # the reports last said (the same news each round is said once)
        self.status = ""
        self.leader = False

    def round(self, region: str, pools: list[scale_plan.Pool]) -> dict:
        report = {"leader": None, "actions": [], "errors": [], "reports": []}
        try:
            report["leader"] = self.leader = self.swarm.is_leader()
            if not report["leader"] or not pools:
                return report
            nodes, tasks = self.swarm.nodes(), self.swarm.tasks()
        except EngineError as e:
            report["errors"].append(str(e))
            return report
        client = self.client_for(region)
        try:
            found = client.describe_groups([p.group for p in pools])
        except aws_api.AwsError as e:
            report["errors"].append(f"DescribeAutoScalingGroups: {e}")
            return report
        groups = {name: scale_plan.Group(g["desired"], g["min"], g["max"], g["instances"]) for name, g in found.items()}
        self.admitting = {n: t for n, t in self.admitting.items() if t.is_alive()}
        now = int(self.clock())
        result = scale_plan.plan(pools, nodes, tasks, {p.group: groups.get(p.group) for p in pools}, now,
                                 frozenset(self.admitting))
        by_name = {p.name: p for p in pools}
        for action in result.actions:
            try:
                self._act(action, by_name[action.pool], client)
            except (EngineError, aws_api.AwsError) as e:
                report["errors"].append(f"pool {action.pool}: {action.kind} {action.node or action.desired}: {e}")
                continue
            if action.kind != "label":
                self.last[action.pool] = f"{now} {action.kind}{f' {action.node}' if action.node else ''}: {action.reason}"
            report["actions"].append({"kind": action.kind, "pool": action.pool, "node": action.node,
                                      "desired": action.desired, "reason": action.reason})
        report["reports"] = result.reports
        if result.reports != self.said:
            for line in result.reports:
                self.log(f"waiting: {line}")
            self.said = list(result.reports)
        self._publish(result.status)
        return report

    def _act(self, a: scale_plan.Action, pool: scale_plan.Pool, client) -> None:
        who = f"pool {a.pool}: node {a.node} ({a.node_id[:12]})" if a.node_id else f"pool {a.pool}"
        if a.kind == "scale-out":
            client.set_desired_capacity(pool.group, a.desired)
            self.log(f"{who}: desired capacity {a.desired}: {a.reason}")
        elif a.kind == "terminate":
            try:
                client.terminate_instance(a.instance, a.decrement)
            except aws_api.AwsError as e:
                if e.code == "ValidationError" and "min size" in e.message and a.give_back:  # at its min by now
                    self.swarm.update(a.give_back)
                    self.log(f"{who}: given back: the group refused to shrink below its min ({e.message})")
                    return
                raise
            self.swarm.update(a.args)
            self.log(f"{who}: instance {a.instance} terminated{' and the group shrinks' if a.decrement else ''}: "
                     f"{a.reason}")
        elif a.kind == "forget":
            self.swarm.remove(a.args)
            self.log(f"{who}: removed from the swarm: {a.reason}")
        elif a.kind == "admit":
            script = os.path.join(self.admit_dir, f"{a.pool}{AUTOSCALE_ADMIT_SUFFIX}")
            thread = threading.Thread(target=self._admit, args=(script, a, who), daemon=True)
            self.admitting[a.node_id] = thread
            thread.start()
            self.log(f"{who}: admitting: {a.reason}")
        else:  # label, pause, drain, give-back: docker node update
            self.swarm.update(a.args)
            if a.kind != "label":
                self.log(f"{who}: {a.kind}: {a.reason}")

    def _admit(self, script: str, a: scale_plan.Action, who: str) -> None:
        try:
            done = subprocess.run(["bash", script, a.node_id], capture_output=True, text=True,
                                  timeout=ADMIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.log(f"{who}: admit failed: {e}")
            return
        if done.returncode == 0:
            self.log(f"{who}: admitted: {(done.stdout.strip().splitlines() or [''])[-1][:300]}")
        else:
            self.log(f"{who}: admit failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-600:]}")

    def _publish(self, status: dict) -> None:
        doc = {pool: {**numbers, "last": self.last.get(pool, "")} for pool, numbers in sorted(status.items())}
        text = json.dumps(doc, separators=(",", ":"), sort_keys=True)
        if text != self.status:
            self.swarm.update(("--label-add", f"{AUTOSCALE_STATUS_LABEL}={text}", self.swarm.self_id()))
            self.status = text


# Prometheus's text format: what the scaler last published, per pool; on a manager that is not the leader, only
# gpu_swarm_autoscale_leader 0. Served on METRICS_PORT of the managers (no GPU exporter runs there), which the
# security group opens between cluster members; stacks/monitoring/prometheus.yml scrapes the managers there.
GAUGES = (("desired", "nodes_desired", "the group's desired capacity, as the scaler last set or read it"),
          ("ready", "nodes_ready", "admitted nodes taking tasks"),
          ("booting", "nodes_pending", "nodes launched or asked for, not admitted yet"),
          ("leaving", "nodes_leaving", "nodes being paused, drained or terminated"),
          ("waiting", "tasks_waiting", "pending GPU tasks given to the pool in the last round"))


def metrics_text(leader: bool, status: dict) -> str:
    out = ["# HELP gpu_swarm_autoscale_leader 1 on the manager whose scaler acts", "# TYPE gpu_swarm_autoscale_leader "
           "gauge", f"gpu_swarm_autoscale_leader {int(bool(leader))}"]
    if not leader:
        return "\n".join(out) + "\n"
    for key, name, help_text in GAUGES:
        out += [f"# HELP gpu_swarm_autoscale_{name} {help_text}", f"# TYPE gpu_swarm_autoscale_{name} gauge"]
        out += [f'gpu_swarm_autoscale_{name}{{pool="{pool}"}} {int(n.get(key) or 0)}' for pool, n in status.items()]
    out += ["# HELP gpu_swarm_autoscale_last_decision_timestamp_seconds when the pool's last decision was made, by kind",
            "# TYPE gpu_swarm_autoscale_last_decision_timestamp_seconds gauge"]
    for pool, n in status.items():
        at, _, rest = str(n.get("last") or "").partition(" ")
        if at.isdigit():
            out.append(f'gpu_swarm_autoscale_last_decision_timestamp_seconds{{pool="{pool}",decision='
                       f'"{rest.split(":", 1)[0].split(" ", 1)[0]}"}} {at}')
    return "\n".join(out) + "\n"


def serve_metrics(scaler: "Scaler", port: int) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = metrics_text(scaler.leader, json.loads(scaler.status or "{}")).encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def main(argv=None, sleep=time.sleep) -> int:
    parser = argparse.ArgumentParser(description="On the swarm leader, size the elastic pools' Auto Scaling groups "
                                                 "for the GPU tasks that wait, and remove idle nodes. Exit 0 ok, "
                                                 "1 (--once) errors, 2 bad input.")
    parser.add_argument("--interval", type=_interval, default=5.0, help="seconds between rounds (default 5)")
    parser.add_argument("--pools", default=AUTOSCALE_POOLS_PATH, help=f"the program's settings ({AUTOSCALE_POOLS_PATH})")
    parser.add_argument("--admit-dir", default=AUTOSCALE_DIR, help="where each pool's admit script is")
    parser.add_argument("--docker", default="docker", metavar="PATH")
    parser.add_argument("--docker-socket", default=DOCKER_SOCKET, metavar="PATH")
    parser.add_argument("--metrics-port", type=int, default=METRICS_PORT,
                        help=f"serve Prometheus metrics on this port (default {METRICS_PORT}; 0: none)")
    parser.add_argument("--once", action="store_true", help="one round, print its report as JSON, exit")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr if args.once else sys.stdout, flush=True)

    imds = aws_api.Imds()
    scaler = Scaler(Swarm(args.docker, args.docker_socket), lambda region: aws_api.Client(region, imds.credentials),
                    args.admit_dir, log)
    if args.metrics_port and not args.once:
        serve_metrics(scaler, args.metrics_port)
    was_leader, last_errors = None, None
    while True:
        try:
            region, pools = read_pools(args.pools)
        except (OSError, ValueError, KeyError) as e:
            log(f"error: {args.pools} is unreadable ({e}); trying again")
            region, pools = "", []
        report = scaler.round(region, pools)
        if report["leader"] is not None and report["leader"] != was_leader:
            log("this manager is the swarm leader: scaling the elastic pools" if report["leader"] else
                "this manager is not the leader: doing nothing")
            was_leader = report["leader"]
        if report["errors"] != last_errors:
            for error in report["errors"]:
                log(f"error: {error}; trying again in {args.interval:g}s")
            last_errors = report["errors"]
        if args.once:
            print(json.dumps(report), flush=True)
            for thread in scaler.admitting.values():
                thread.join()
            return 1 if report["errors"] else 0
        sleep(args.interval)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
