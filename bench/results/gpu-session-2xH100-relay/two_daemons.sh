#!/usr/bin/env bash
# Evidence for uneven slots (issue 23 item 4), not a check: can two MPS control daemons, each with
# its own pipe folder and its own memory ceiling, serve clients on one GPU at once? Compute mode
# Default first (Exclusive_Process admits one process, the first server), then Exclusive_Process.
#   bash two_daemons.sh --out DIR    (bench/gpu_session.sh runs it after the benches; root, a GPU)
set -u
out=${2:-/tmp/two-daemons}
mkdir -p "$out"
exec > >(tee "$out/two-daemons.log") 2>&1
probe=${CUDA_PROBE:?bench/gpu_session.sh sets CUDA_PROBE}
gpu=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0)
w=$(mktemp -d /tmp/two-daemons.XXXXXX)
ctl() { local pipe=$1; shift; echo "$*" | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 10 nvidia-cuda-mps-control; echo "[rc $?]"; }
client() { # PIPE MIB: a client that holds its memory 4 s, then says what it got
  CUDA_VISIBLE_DEVICES=$gpu CUDA_MPS_PIPE_DIRECTORY=$1 timeout 30 "$probe" "$2" & local p=$!
  sleep 4; kill "$p" 2>/dev/null; wait "$p"; echo "[probe $1 $2 MiB: rc $?]"
}
for mode in DEFAULT EXCLUSIVE_PROCESS; do
  echo "===== compute mode $mode: daemon a (ceiling 1024M), daemon b (ceiling 3072M), one GPU $gpu"
  nvidia-smi -i "$gpu" -c "$mode"
  for d in a b; do
    mkdir -p "$w/$mode/$d/pipe" "$w/$mode/$d/log"
    CUDA_VISIBLE_DEVICES=$gpu CUDA_MPS_PIPE_DIRECTORY=$w/$mode/$d/pipe CUDA_MPS_LOG_DIRECTORY=$w/$mode/$d/log \
      nvidia-cuda-mps-control -d
  done
  sleep 1
  ctl "$w/$mode/a/pipe" set_default_device_pinned_mem_limit 0 1024M
  ctl "$w/$mode/b/pipe" set_default_device_pinned_mem_limit 0 3072M
  ctl "$w/$mode/a/pipe" start_server -uid 0
  ctl "$w/$mode/b/pipe" start_server -uid 0
  sleep 2
  for d in a b; do echo "servers of $d: $(echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$w/$mode/$d/pipe nvidia-cuda-mps-control)"; done
  client "$w/$mode/a/pipe" 2000 & c1=$!
  client "$w/$mode/b/pipe" 2000 & c2=$!
  sleep 2
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
  wait "$c1" "$c2"
  client "$w/$mode/a/pipe" 800 & c1=$!
  client "$w/$mode/b/pipe" 2500 & c2=$!
  wait "$c1" "$c2"
  for d in a b; do ctl "$w/$mode/$d/pipe" quit; done
  sleep 2
  for d in a b; do echo "--- $mode $d control.log"; tail -n 25 "$w/$mode/$d/log/control.log"; done
done
nvidia-smi -i "$gpu" -c DEFAULT
echo "===== end"
