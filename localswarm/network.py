"""The rehearsal's network: one bridge, one namespace per node on a veth pair.

Nodes see each other on one L2 segment as EC2 instances in a subnet do; the
host keeps the bridge address, where the local registry listens.
"""
from __future__ import annotations

import ipaddress
import shutil
import time

from localswarm import lane
from localswarm.host import run

# Each lane (localswarm/lane.py) is its own segment: lane 0 is lswbr0 on 192.168.213.0/24, lane 1 lswbr1
# on 192.168.214.0/24, and so on.
BRIDGE = f"lswbr{lane.LANE}"
SUBNET = ipaddress.ip_network(f"192.168.{213 + lane.LANE}.0/24")
BRIDGE_ADDR = str(SUBNET.network_address + 1)
NETNS_PREFIX = lane.name("lsw") + "-"
VETH_PREFIX = lane.name("lsw") + "v"
# What marks the rehearsal's iptables rules as this lane's (`our_rules` and teardown match it whole).
COMMENT = lane.name("localswarm")


def node_addr(index: int) -> str:
    return str(SUBNET.network_address + 10 + index)


def netns_name(node: str) -> str:
    return NETNS_PREFIX + node


def _veth(index: int) -> str:
    return f"{VETH_PREFIX}{index}"  # interface names are limited to 15 characters


# Lets nodes talk across the bridge even when FORWARD drops by default; a host dockerd
# puts its own policy in front of FORWARD, and DOCKER-USER is where it lets us in.
_CHAINS = ("FORWARD", "DOCKER-USER")


def _rule(chain: str) -> list[str]:
    return [chain, "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT", "-m", "comment", "--comment", COMMENT]


# The machines' instance metadata: what they send to 169.254.169.254:80 reaches the bridge's server
# (localswarm/fake_imds.py) with its source address kept, so the server knows which instance asks. Only
# packets that come from the bridge: the host's own metadata service, if it has one, is left alone.
IMDS_ADDR, IMDS_PORT = "169.254.169.254", 80
_IMDS_RULE = ["PREROUTING", "-i", BRIDGE, "-d", f"{IMDS_ADDR}/32", "-p", "tcp", "--dport", str(IMDS_PORT),
              "-j", "DNAT", "--to-destination", f"{BRIDGE_ADDR}:{IMDS_PORT}", "-m", "comment", "--comment", COMMENT]


def create_bridge() -> None:
    run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "addr", "add", f"{BRIDGE_ADDR}/{SUBNET.prefixlen}", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])
    for chain in _CHAINS:
        if run(["iptables", "-w", "-nL", chain], check=False).returncode == 0:
            run(["iptables", "-w", "-I", *_rule(chain)])
    route_imds()


def route_imds() -> None:
    """The DNAT of the machines' metadata requests, once (a bridge made by an older release lacks it)."""
    if run(["iptables", "-w", "-t", "nat", "-C", *_IMDS_RULE], check=False).returncode != 0:
        run(["iptables", "-w", "-t", "nat", "-I", *_IMDS_RULE])


def create_node_netns(node: str, index: int) -> None:
    ns = netns_name(node)
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", _veth(index), "type", "veth", "peer", "name", "eth0", "netns", ns])
    run(["ip", "link", "set", _veth(index), "master", BRIDGE, "up"])
    run(["ip", "-n", ns, "addr", "add", f"{node_addr(index)}/{SUBNET.prefixlen}", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    run(["ip", "-n", ns, "route", "add", "default", "via", BRIDGE_ADDR])


def our_netns() -> list[str]:
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NETNS_PREFIX)]


def netns_pids(ns: str) -> list[int]:
    out = run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split()]


def _our_links() -> list[str]:
    out = run(["ip", "-o", "link", "show"], check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.split(":")[1].strip().startswith((VETH_PREFIX, BRIDGE))]


def our_rules() -> list[str]:
    """The iptables rules the rehearsal added, as `iptables -S` prints them."""
    out = "".join(run(["iptables", "-w", *table, "-S"], check=False).stdout for table in ([], ["-t", "nat"])) \
        if shutil.which("iptables") else ""
    return [line for line in out.splitlines() if f"--comment {COMMENT} " in line + " "]


def teardown_network() -> None:
    """Remove namespaces, bridge and rules; each step tolerates what is already gone."""
    for ns in our_netns():
        run(["ip", "netns", "del", ns], check=False)  # deleting a namespace deletes its veth too
    run(["ip", "link", "del", BRIDGE], check=False)
    # The kernel frees a deleted namespace's veth asynchronously; wait so `down` is complete
    # when it returns.
    deadline = time.monotonic() + 10
    while _our_links() and time.monotonic() < deadline:
        time.sleep(0.1)
    for chain in _CHAINS:
        while shutil.which("iptables") and run(["iptables", "-w", "-C", *_rule(chain)], check=False).returncode == 0:
            run(["iptables", "-w", "-D", *_rule(chain)], check=False)
    while shutil.which("iptables") and run(["iptables", "-w", "-t", "nat", "-C", *_IMDS_RULE], check=False).returncode == 0:
        run(["iptables", "-w", "-t", "nat", "-D", *_IMDS_RULE], check=False)


def remove_node_netns(node: str) -> None:
    """Remove one node's namespace (its veth goes with it)."""
    run(["ip", "netns", "del", netns_name(node)], check=False)
