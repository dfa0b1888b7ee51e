#!/usr/bin/env bash
# Evidence call (issue 23): how a CUDA client's connection to an MPS control daemon differs from
# nvidia-cuda-mps-control's, through wire_log_relay.py; then whether two daemons share one GPU.
# As root on a GPU machine with the driver; .kit carried (for cuda-probe). Writes to $OUT.
set -u
OUT=${OUT:-/tmp/explore-out}; mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
exec > >(tee "$OUT/steps.log") 2>&1
tar -xJf .kit/kit.tar.xz -C /tmp bin/cuda-probe
probe=/tmp/bin/cuda-probe
nvidia-smi --query-gpu=name,driver_version,uuid --format=csv
command -v strace nvidia-cuda-mps-control python3
W=/tmp/mps; P=$W/real R=$W/relay R2=$W/relay2 L=$W/log
mkdir -p $P $R $R2 $L
gpu=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0)
nvidia-smi -i 0 -c EXCLUSIVE_PROCESS
export CUDA_VISIBLE_DEVICES=$gpu
CUDA_MPS_PIPE_DIRECTORY=$P CUDA_MPS_LOG_DIRECTORY=$L nvidia-cuda-mps-control -d
sleep 1
ctl() { local pipe=$1; shift; echo "$*" | CUDA_MPS_PIPE_DIRECTORY=$pipe timeout 10 nvidia-cuda-mps-control; echo "[rc $?]"; }
ctl $P set_default_device_pinned_mem_limit 0 4096M
ctl $P start_server -uid 0
sleep 2
ls -la $P
python3 "$here/wire_log_relay.py" $P $R "$OUT/wire.jsonl" & r1=$!
python3 "$here/wire_log_relay.py" $P $R2 "$OUT/wire2.jsonl" & r2=$!
sleep 1
for f in control_lock nvidia-cuda-mps-control.pid log control_privileged; do ln -s $P/$f $R2/$f; done
mark() { echo "===== $*"; echo "{\"step\": \"$*\"}" >>"$OUT/wire.jsonl"; echo "{\"step\": \"$*\"}" >>"$OUT/wire2.jsonl"; }
client() { local pipe=$1 mib=$2; shift 2; env CUDA_MPS_PIPE_DIRECTORY="$pipe" "$@" "$probe" "$mib" & local p=$!; sleep 4; kill $p 2>/dev/null; wait $p; echo "[probe rc $?]"; }
server=$(echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$P nvidia-cuda-mps-control)
echo "server: $server"
mark "client 64 via relay (control only)"; client $R 64
mark "client 5000 via relay (over the 4096 ceiling)"; client $R 5000
mark "client 64 via relay2 (control + symlinks)"; client $R2 64
mark "client env 0=1G asks 2000 via relay"; client $R 2000 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G
mark "ui get_server_list via relay"; ctl $R get_server_list
mark "ui get_default_device_pinned_mem_limit via relay"; ctl $R get_default_device_pinned_mem_limit 0
mark "ui get_device_pinned_mem_limit via relay"; ctl $R get_device_pinned_mem_limit "$server" 0
mark "ui set_device_pinned_mem_limit 200G via relay"; ctl $R set_device_pinned_mem_limit "$server" 0 200G
mark "client 5000 via relay after the raise"; client $R 5000
mark "ui set_device_pinned_mem_limit back 4096M via relay"; ctl $R set_device_pinned_mem_limit "$server" 0 4096M
mark "ui set_default 200G via relay"; ctl $R set_default_device_pinned_mem_limit 0 200G
mark "ui get_server_list via relay2"; ctl $R2 get_server_list
mark "two clients at once via relay"; client $R 64 & client $R 64; wait
mark "done"
ctl $P quit
sleep 2
kill $r1 $r2
cp $L/control.log "$OUT/control.log"; cp $L/server.log "$OUT/server.log" 2>/dev/null
# Item 4 evidence: two control daemons, two pipe folders, one GPU (compute mode Default).
echo "===== two daemons on one GPU"
nvidia-smi -i 0 -c DEFAULT
for d in a b; do mkdir -p $W/$d/pipe $W/$d/log; CUDA_MPS_PIPE_DIRECTORY=$W/$d/pipe CUDA_MPS_LOG_DIRECTORY=$W/$d/log nvidia-cuda-mps-control -d; done
sleep 1
ctl $W/a/pipe set_default_device_pinned_mem_limit 0 1024M
ctl $W/b/pipe set_default_device_pinned_mem_limit 0 3072M
ctl $W/a/pipe start_server -uid 0
ctl $W/b/pipe start_server -uid 0
sleep 2
echo "a: $(echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$W/a/pipe nvidia-cuda-mps-control) b: $(echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$W/b/pipe nvidia-cuda-mps-control)"
(echo "client a 2000 (ceiling 1024)"; client $W/a/pipe 2000) & (sleep 0.5; echo "client b 2000 (ceiling 3072)"; client $W/b/pipe 2000) &
sleep 2; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; wait
(echo "client a 800"; client $W/a/pipe 800) & (echo "client b 2500"; client $W/b/pipe 2500) &
sleep 2; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; wait
for d in a b; do ctl $W/$d/pipe quit; done
sleep 1
for d in a b; do cp $W/$d/log/control.log "$OUT/two-$d-control.log"; done
nvidia-smi -i 0 -c DEFAULT
echo "===== end"
