#!/usr/bin/env bash
# Instance metadata (IMDS) for root only: packets from this host to 169.254.169.254 are
# accepted from uid 0 and rejected from every other user (an owner match in the OUTPUT
# chain), as AWS ParallelCluster's `Imds: Secured` does. Why: the node's user data holds its
# private SSH host key (components/node_pool.py), and IMDS hands user data to any local
# process that asks. Containers on bridge and overlay networks are kept out already: their
# packets cross FORWARD, not OUTPUT, and an IMDSv2 token's hop limit is 1. Root, on the host
# or in a host-network container, still reads it; so do root's services (cloud-init, the
# SSM agent, the health watcher's spot checks).
# gpu-swarm-imds.service runs it at every boot (iptables rules do not outlive a reboot, and a
# spot `stop` is a reboot), before the network comes up. Idempotent: a second run changes nothing.
set -euo pipefail
chain=GPU-SWARM-IMDS
imds=169.254.169.254/32

# present ARGS...: iptables -C (or -L) ARGS: 0 when it is there, 1 when it is not. Any other
# exit (2: a bad parameter or a match module this kernel lacks, 4: another holds the lock past
# the wait) ends the run with iptables' own words and exit code.
present() {
  local rc=0 err
  err=$(iptables -w 10 "$@" 2>&1 >/dev/null) || rc=$?
  case $rc in
    0) return 0 ;;
    1) return 1 ;;
    *) echo "iptables -w 10 $* failed (exit $rc): $err" >&2; exit "$rc" ;;
  esac
}

command -v iptables >/dev/null || { echo "iptables not found: install the iptables package" >&2; exit 1; }
present -n -L "$chain" || iptables -w 10 -N "$chain"
# Root first (inserted at the top), then everyone else refused (appended last).
present -C "$chain" -m owner --uid-owner 0 -j ACCEPT || iptables -w 10 -I "$chain" 1 -m owner --uid-owner 0 -j ACCEPT
present -C "$chain" -j REJECT || iptables -w 10 -A "$chain" -j REJECT
# First in OUTPUT: no earlier rule may accept these packets.
present -C OUTPUT -d "$imds" -j "$chain" || iptables -w 10 -I OUTPUT 1 -d "$imds" -j "$chain"
echo "IMDS ($imds) answers root only: OUTPUT -> $chain (uid 0 accepted, every other user rejected)"
