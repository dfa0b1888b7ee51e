#!/usr/bin/env python3
"""Issue 17's access, on real machines: pinned host keys checked by real OpenSSH, Elastic IPs, any live manager.

    sudo flock /tmp/lsw.lock .venv/bin/python bench/access_rehearsal.py [--json] [--smoke]

Runs the program itself (`localswarm pulumi up`: Pulumi's real CLI, real cloud-init, real sshd,
real SSH) with three managers and one GPU node, then:
1. each machine's sshd has exactly the host key its user data brought, and it is the key every
   connection of the program pins (the stack's state holds the connections: `pulumi stack export`);
2. real OpenSSH, with that pin, reaches a worker through a manager's Elastic IP; with another
   node's key pinned it refuses ("Host key verification failed"), for the node and for the proxy;
3. the first manager's machine is stopped; the next `pulumi up` goes through the second manager:
   every worker command's proxy and the swarm steps name its address, and what runs again only
   checks (which commands ran, and that no instance was replaced, is printed);
4. everything is removed (`localswarm down`), also when a step fails.
It exits 1 when an expectation above does not hold (each named). --smoke is the smallest real
run: one manager and the GPU node, steps 1, 2 and 4 (step 3 needs a second manager).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localswarm import machines, pulumi_cli, rehearsal, ssh  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def pulumi(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "localswarm", "pulumi", "--stack", "dev", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=1500)
    if done.returncode != 0:
        raise RuntimeError(f"pulumi {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def up(managers: int) -> dict:
    """`pulumi up` with managerCount set: its seconds, the CLI's change counts, the commands that ran."""
    pulumi("config", "set", "gpu-swarm:managerCount", str(managers))
    started = time.monotonic()
    out = pulumi("up", "--yes").stdout
    tail = out.rsplit("\nResources:\n", 1)[1].split("\n\n", 1)[0]
    counts = {m[2]: int(m[1]) for m in re.finditer(r"^\s+(?:[-+~] )?(\d+) (\w+)", tail, re.M)}
    return {"seconds": round(time.monotonic() - started, 1), "commands": pulumi_cli.last_run()["commands"],
            "resources": {"create": counts.get("created", 0), "replace": counts.get("replaced", 0)}}


def state_now() -> dict:
    """The stack's resources by name (`pulumi stack export`) and the machines behind its instances."""
    return {"resources": {r["urn"].rsplit("::", 1)[1]: r for r in pulumi_cli.exported("dev")},
            "machines": pulumi_cli.world()["machines"]}


def connections(state: dict) -> dict[str, dict]:
    """Each command's connection, by the command's name."""
    return {name: r["inputs"]["connection"] for name, r in state["resources"].items()
            if r["type"] == "command:remote:Command"}


def machine_of(state: dict, hostname: str) -> machines.Machine:
    record = next(r for r in state["machines"].values() if r["hostname"] == hostname)
    return machines.Machine(record["machine"], record["index"])


def check_pins(state: dict, out: dict) -> None:
    conns = connections(state)
    keys = {}
    for record in state["machines"].values():
        m = machines.Machine(record["machine"], record["index"])
        on_disk = machines.run(m, "ls /etc/ssh/ | grep '^ssh_host_.*_key$'; cat /etc/ssh/ssh_host_ed25519_key.pub",
                               timeout=30).stdout.split()
        # "ssh-ed25519 AAAA...", and no comment: pulumi-tls's public_key_openssh has none.
        at = on_disk.index("ssh-ed25519") if "ssh-ed25519" in on_disk else len(on_disk)
        keys[record["hostname"]] = " ".join(on_disk[at:at + 2])
        out.setdefault("host_key_files", {})[record["hostname"]] = [w for w in on_disk if w.startswith("ssh_host_")]
    pinned = {c["hostKey"] for c in conns.values()}
    out["distinct_pinned_keys"] = len(pinned)
    out["every_pin_is_a_machines_own_key"] = pinned <= set(keys.values())
    out["every_connection_pins"] = all(c.get("hostKey") for c in conns.values()) and all(
        c["proxy"].get("hostKey") for c in conns.values() if c.get("proxy"))


def check_openssh(state: dict, out: dict) -> None:
    conns = connections(state)
    worker = next(c for n, c in conns.items() if n.endswith("-join") and c.get("proxy"))
    keys = [c["hostKey"] for c in conns.values()]
    # Another machine's key for each: not the node's own, and for the proxy not the proxy's own
    # (with one manager, the first key that is not the worker's is the proxy's).
    not_node = next(k for k in keys if k != worker["hostKey"])
    not_proxy = next(k for k in keys if k != worker["proxy"]["hostKey"])
    quick = {"dialErrorLimit": 1, "perDialTimeout": 10}
    started = time.monotonic()
    good = ssh.run({**worker, **quick}, "hostname; cat /etc/ssh/ssh_host_ed25519_key.pub")
    out["worker_through_proxy"] = {"ok": True, "answer": good.stdout.splitlines()[0], "seconds": good.seconds,
                                   "proxy": worker["proxy"]["host"], "host": worker["host"]}
    for what, conn in (("node", {**worker, **quick, "hostKey": not_node}),
                       ("proxy", {**worker, **quick, "proxy": {**worker["proxy"], "hostKey": not_proxy, **quick}})):
        try:
            ssh.run(conn, "true", sleep=lambda s: None)
            out[f"wrong_{what}_key"] = "ACCEPTED (a failure of the pin)"
        except ssh.CommandFailed as e:
            out[f"wrong_{what}_key"] = "refused: " + next((line for line in str(e).splitlines()
                                                           if "verification failed" in line.lower()), str(e)[:160])
    out["openssh_seconds"] = round(time.monotonic() - started, 1)


def unmet(out: dict, machines_up: int) -> list[str]:
    """The expectations of the docstring that the run's findings do not meet."""
    second = out.get("second_up")
    expected = [
        ("every connection pins a host key, its proxy's too", out.get("every_connection_pins") is True),
        ("every pin is a machine's own key", out.get("every_pin_is_a_machines_own_key") is True),
        ("one distinct key per machine", out.get("distinct_pinned_keys") == machines_up),
        ("another node's key is refused for the node", str(out.get("wrong_node_key")).startswith("refused")),
        ("another node's key is refused for the proxy", str(out.get("wrong_proxy_key")).startswith("refused")),
    ]
    if second is not None:
        expected += [
            ("the second up goes through the second manager", second["proxies"] == [second["manager_1"]]
             and second["swarm_steps_on"] == [second["manager_1"]]),
            ("the second up creates and replaces nothing", second["resources"].get("create") == 0
             and second["resources"].get("replace") == 0),
        ]
    return [what for what, ok in expected if not ok]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="one manager, no failover: the smallest real run")
    args = parser.parse_args()
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    managers_wanted = 1 if args.smoke else 3
    out: dict = {}
    failed = ["the run did not finish"]  # its exception says why
    try:
        rehearsal.down(progress=say)
        first = up(managers_wanted)
        out["first_up"] = {"seconds": first["seconds"], "commands": len(first["commands"])}
        state = state_now()
        check_pins(state, out)
        check_openssh(state, out)
        managers = sorted(r["hostname"] for r in state["machines"].values() if r["role"] == "manager")
        eips = {r["outputs"]["publicIp"] for r in state["resources"].values() if r["type"] == "aws:ec2/eip:Eip"}
        out["manager_elastic_ips"] = sorted(eips)
        if not args.smoke:  # the failover needs a second manager
            machines.stop(machine_of(state, managers[0]))
            say(f"stopped {managers[0]}; a second up must go through {managers[1]}")
            second = up(managers_wanted)
            state = state_now()
            conns = connections(state)
            manager_1 = next(c["host"] for n, c in conns.items() if n == "gpu-swarm-member-managers-1-join")
            proxies = {c["proxy"]["host"] for c in conns.values() if c.get("proxy")}
            out["second_up"] = {
                "seconds": second["seconds"], "resources": second["resources"],
                "proxies": sorted(proxies), "manager_1": manager_1,
                "swarm_steps_on": sorted({conns[n]["host"] for n in conns if n.endswith(("-cordon", "-admit"))}),
                "ran": sorted(f"{c['name']} ({c['action']})" for c in second["commands"]),
            }
        failed = unmet(out, len(out.get("host_key_files", {})))
        say("FAILED: " + "; ".join(failed) if failed else "every expectation held")
    finally:
        rehearsal.down(progress=say)
        print(json.dumps(out, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
