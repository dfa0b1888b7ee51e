#!/usr/bin/env python3
"""The GPU health watcher (node/gpu_health.py) left running on real GPUs: does it ever cry wolf, and what does it cost?

    python3 bench/health_soak.py start [--interval 10]     # starts it in its own session
    python3 bench/health_soak.py report --seconds 600      # waits until it has run that long
    python3 bench/health_soak.py --smoke     # both, for 5 s, on 2 stand-in GPUs (bench/gpu_standins.py)

Both as root (sudo, if you are not).

`start` runs the watcher in NVML mode on a private copy of a daemon.json that advertises
every GPU of this machine, with a stand-in process as "dockerd" to receive its SIGHUPs, and
returns at once; the watcher keeps running after the shell that started it is gone.
`report` waits until the watcher has run --seconds, then prints: the events it registered
for (from its own log), every condition it reported, its CPU time and memory, and stops it.
It exits 1 when the watcher reported anything but healthy, or died.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOME = Path("/var/lib/gpu-swarm-soak")
STATE = HOME / "soak.json"


def start(interval: int) -> int:
    HOME.mkdir(parents=True, exist_ok=True)
    uuids = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                           text=True, check=True).stdout.split()
    (HOME / "daemon.json").write_text(json.dumps({"node-generic-resources": [f"NVIDIA-GPU={u}" for u in uuids]}))
    # Something to receive the SIGHUPs that would make dockerd reload its labels.
    # Both outlive this command, so neither may hold its stdin or stdout: a pipe they keep open
    # (`... | tee log`) would never end.
    quiet = {"stdin": subprocess.DEVNULL, "start_new_session": True}
    hup = subprocess.Popen(["sh", "-c", "trap 'echo hup >>hups' HUP; while :; do sleep 1; done"], cwd=HOME,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **quiet)
    (HOME / "dockerd.pid").write_text(f"{hup.pid}\n")
    watcher = subprocess.Popen(
        [sys.executable, str(REPO / "node" / "gpu_health.py"), "--json", "--kind", "NVIDIA-GPU",
         "--daemon-json", str(HOME / "daemon.json"), "--dockerd-pidfile", str(HOME / "dockerd.pid"),
         "--state-file", str(HOME / "state.json"), "--interval", str(interval), "--no-spot"],
        stdout=open(HOME / "reports.jsonl", "ab"), stderr=open(HOME / "watcher.log", "ab"), **quiet)
    STATE.write_text(json.dumps({"pid": watcher.pid, "hup_pid": hup.pid, "started": time.time(),
                                 "interval": interval, "gpus": uuids}))
    print(f"watcher {watcher.pid} started on {len(uuids)} GPU(s), checking every {interval} s")
    return 0


def _proc(pid: int) -> dict:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"cpu_s": (int(stat[11]) + int(stat[12])) / ticks, "rss_kib": int(status["VmRSS"].split()[0]),
            "peak_rss_kib": int(status["VmHWM"].split()[0]), "state": stat[0]}


def report(seconds: int) -> int:
    info = json.loads(STATE.read_text())
    pid = info["pid"]
    wait = info["started"] + seconds - time.time()
    if wait > 0:
        print(f"waiting {wait:.0f} s more, until the watcher has run {seconds} s", flush=True)
        time.sleep(wait)
    alive = Path(f"/proc/{pid}").exists()
    usage = _proc(pid) if alive else {}
    ran = time.time() - info["started"]
    reports = [json.loads(line) for line in (HOME / "reports.jsonl").read_text().splitlines() if line.strip()]
    log = (HOME / "watcher.log").read_text()
    conditions = sorted({r.get("condition", "?") for r in reports})
    hups = len((HOME / "hups").read_text().splitlines()) if (HOME / "hups").exists() else 0
    for p in (pid, info["hup_pid"]):
        try:
            os.kill(p, 15)
        except ProcessLookupError:
            pass
    print("\nwatcher log (its own words):")
    lines = log.splitlines()
    print("\n".join(f"  {line}" for line in (lines if len(lines) <= 30 else lines[:15] + ["..."] + lines[-15:])))
    rows = [
        ("ran for", f"{ran:.0f} s, checking every {info['interval']} s, on {len(info['gpus'])} GPU(s)"),
        ("still alive at the end", str(alive)),
        ("reports written", str(len(reports))),
        ("conditions reported", ", ".join(conditions)),
        ("label reloads (SIGHUP to dockerd)", str(hups)),
        ("NVML event registration", "; ".join(line.replace(": watching events: ", ": ") for line in log.splitlines()
                                               if "watching events" in line) or "none logged"),
        ("CPU time", f"{usage.get('cpu_s', 0):.2f} s ({100 * usage.get('cpu_s', 0) / max(ran, 1):.3f}% of one core)"),
        ("memory", f"{usage.get('rss_kib', 0) / 1024:.1f} MiB RSS, peak {usage.get('peak_rss_kib', 0) / 1024:.1f} MiB"),
    ]
    print("\n| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    ok = alive and conditions == ["healthy"] and "watching events" in log
    print(f"\n{'no false condition' if ok else 'FAILED: see above'}")
    return 0 if ok else 1


def smoke() -> int:
    """start and report, checking every second for 5 s, on stand-in GPUs and in a folder of its own."""
    global HOME, STATE
    import tempfile
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_standins
    with tempfile.TemporaryDirectory(prefix="health-soak-") as tmp:
        HOME, STATE = Path(tmp) / "soak", Path(tmp) / "soak" / "soak.json"
        os.environ.update(gpu_standins.write_tools(Path(tmp), 2))
        start(1)
        return report(5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="start and report for 5 s on 2 stand-in GPUs "
                        "(no GPU): that the bench runs")
    sub = parser.add_subparsers(dest="command")
    st = sub.add_parser("start")
    st.add_argument("--interval", type=int, default=10)
    rp = sub.add_parser("report")
    rp.add_argument("--seconds", type=int, default=600)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root")
    if args.smoke:
        return smoke()
    if not args.command:
        parser.error("say start or report (or --smoke)")
    return start(args.interval) if args.command == "start" else report(args.seconds)


if __name__ == "__main__":
    sys.exit(main())
