#!/usr/bin/env bash
# What a GPU machine shows of EFA, read-only, for the lead's real-GPU session:
#   bash bench/efa_probe.sh        (writes $OUT/efa-probe.txt, or ./efa-probe.txt without $OUT)
# It runs node/efa_detect.py (the agent's efa.count and install-efa.sh's check) against the real
# /sys/class/infiniband, lists every RDMA device with its driver, and, where libfabric is there,
# asks it for the efa provider. On a machine without EFA it says so: that is a result too (the
# agent then sets no efa.* label). Nothing is installed or changed. It exits 1 when
# node/efa_detect.py fails: the probe's one part that is the project's own.
#   bash bench/efa_probe.sh --smoke   # on any machine (no EFA: the answer says so), output in a temp folder
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "${1:-}" = --smoke ]; then
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
fi
out=${OUT:-.}/efa-probe.txt
mkdir -p "$(dirname "$out")"
{
  echo "== host"; uname -r; grep -s "^PRETTY_NAME=" /etc/os-release
  curl -s -m 2 -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 60' http://169.254.169.254/latest/api/token >/tmp/imds.tok 2>/dev/null &&
    echo "instance type: $(curl -s -m 2 -H "X-aws-ec2-metadata-token: $(cat /tmp/imds.tok)" \
      http://169.254.169.254/latest/meta-data/instance-type)" || echo "instance type: (no IMDS: not EC2)"
  echo "== RDMA devices (/sys/class/infiniband) and their drivers"
  for dev in /sys/class/infiniband/*; do
    [ -e "$dev" ] || { echo "none"; break; }
    echo "$(basename "$dev") driver=$(basename "$(readlink -f "$dev/device/driver")")"
  done
  echo "== node/efa_detect.py (what the agent labels efa.count)"
  PYTHONPATH="$here/node" python3 "$here/node/efa_detect.py" || echo "efa_detect.py FAILED (exit $?)"
  echo "== /dev/infiniband"; ls -l /dev/infiniband 2>&1
  echo "== efa kernel module"; lsmod | grep -E '^efa ' || echo "not loaded"
  echo "== libfabric's efa provider"
  fi_info=$(command -v fi_info || echo /opt/amazon/efa/bin/fi_info)
  if [ -x "$fi_info" ]; then "$fi_info" -p efa -t FI_EP_RDM 2>&1 | head -20; else echo "no fi_info"; fi
  echo "== GPU and NIC topology"; nvidia-smi topo -m 2>&1 | head -40
} >"$out" 2>&1
cat "$out"
if grep -q "^efa_detect.py FAILED" "$out"; then exit 1; fi
