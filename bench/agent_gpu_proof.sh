#!/usr/bin/env bash
# Proof that the GPU agent reads real GPUs correctly, for a machine with NVIDIA
# GPUs, nvidia-smi and python3 with nvidia-ml-py. It works on temp copies of
# daemon.json and config.toml, so the machine's own files are never touched.
# Prints: nvidia-smi -L, a dry-run report, 5 timed dry runs and their median,
# a real run followed by a second run that must report "changed": false, and a
# comparison of the UUID sets. Exits non-zero when any check fails.
# Usage: bash bench/agent_gpu_proof.sh   (PYTHON=/path/to/python to choose one)
#        bash bench/agent_gpu_proof.sh --smoke   # no GPU: 2 stand-in GPUs (bench/gpu_standins.py)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
agent="$here/../node/gpu_agent.py"
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ ${1:-} == --smoke ]]; then
  # The stand-ins' NVML is a module on PYTHONPATH; the repository's venv runs the agent, as the tests do.
  if [[ -z ${PYTHON:-} && -x $here/../.venv/bin/python ]]; then python=$here/../.venv/bin/python; fi
  eval "$("$python" "$here/gpu_standins.py" "$work/standins" --gpus 2)"
elif [[ $# -gt 0 ]]; then
  echo "usage: bash bench/agent_gpu_proof.sh [--smoke]" >&2
  exit 2
fi

fail() { echo "FAIL: $*" >&2; exit 1; }

command -v nvidia-smi >/dev/null || fail "nvidia-smi is not on PATH; run this on a GPU machine"
"$python" -c 'import pynvml' 2>/dev/null || fail "$python cannot import pynvml; install nvidia-ml-py for it"

# Start from the machine's real files when they exist, so the merge is exercised too.
mkdir -p "$work/docker" "$work/nvidia-container-runtime"
if [[ -r /etc/docker/daemon.json ]]; then cp /etc/docker/daemon.json "$work/docker/"; fi
if [[ -r /etc/nvidia-container-runtime/config.toml ]]; then
  cp /etc/nvidia-container-runtime/config.toml "$work/nvidia-container-runtime/"
fi
files=(--daemon-json "$work/docker/daemon.json" --toolkit-config "$work/nvidia-container-runtime/config.toml")

echo "== nvidia-smi -L"
nvidia-smi -L | tee "$work/smi.txt"

echo "== agent --dry-run --json"
"$python" "$agent" "${files[@]}" --dry-run --json | tee "$work/report.json"

echo "== 5 timed dry runs (wall seconds, whole process)"
times=()
for run in 1 2 3 4 5; do
  start=$(date +%s.%N)
  "$python" "$agent" "${files[@]}" --dry-run --json >/dev/null
  end=$(date +%s.%N)
  seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }')
  times+=("$seconds")
  echo "run $run: ${seconds}s"
done
median=$(printf '%s\n' "${times[@]}" | sort -n | sed -n 3p)
echo "median: ${median}s"

echo "== real run on the temp files, then a second run"
"$python" "$agent" "${files[@]}" --json >"$work/first.json"
"$python" "$agent" "${files[@]}" --json >"$work/second.json"
changed() { "$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["changed"])' "$1"; }
echo "first run changed: $(changed "$work/first.json")"
echo "second run changed: $(changed "$work/second.json")"
[[ $(changed "$work/second.json") == False ]] || fail "the second run changed files again: not idempotent"
echo "== resulting daemon.json"
cat "$work/docker/daemon.json"
echo "== resulting toolkit config (swarm-resource and mode lines)"
grep -nE '^[[:space:]]*(swarm-resource|mode)[[:space:]]*=' "$work/nvidia-container-runtime/config.toml" || true

echo "== UUIDs: nvidia-smi -L vs the agent report"
# nvidia-smi -L lists each GPU and, below a GPU in MIG mode, its MIG devices.
# The agent advertises those MIG devices in place of their parent GPU.
"$python" - "$work/smi.txt" >"$work/smi-uuids" <<'EOF'
import re, sys
devices = []  # (GPU UUID, [its MIG UUIDs])
for line in open(sys.argv[1]):
    found = re.search(r"\(UUID: ((GPU|MIG)-[^)]+)\)", line)
    if found and found.group(2) == "GPU":
        devices.append((found.group(1), []))
    elif found and devices:
        devices[-1][1].append(found.group(1))
for gpu, migs in devices:
    print("\n".join(migs) if migs else gpu)
EOF
sort -u -o "$work/smi-uuids" "$work/smi-uuids"
"$python" -c 'import json, sys; [print(g["uuid"]) for g in json.load(open(sys.argv[1]))["gpus"]]' \
  "$work/first.json" | sort -u >"$work/agent-uuids"
[[ -s "$work/smi-uuids" ]] || fail "found no UUIDs in the nvidia-smi -L output"
if diff -u --label nvidia-smi --label agent "$work/smi-uuids" "$work/agent-uuids"; then
  echo "UUIDs match ($(wc -l <"$work/agent-uuids") devices)"
else
  fail "UUID sets differ between nvidia-smi -L (-) and the agent report (+)"
fi
