#!/usr/bin/env bash
# One real-GPU session on a bare GPU machine (driver and nvidia-smi, but no Docker, no toolkit,
# no internet): installs .kit (bench/build_gpu_kit.sh), boots the engine the way a node does
# (the agent writes daemon.json and the toolkit's swarm-resource, then containerd and dockerd
# start), builds the stand-in CUDA image, then runs bench programs, each in its own time
# budget, and packs what they wrote into $OUT in at most 8 files. As root.
#
#   bash bench/gpu_session.sh [options] 'NAME[:SECONDS]=PROGRAM [ARGS...]' ...
#   bash bench/gpu_session.sh 'e2e:300=bench/gpu_e2e.py --start-runs 21' 'mps:150=bench/gpu_mps.py'
#
# Each program runs as `PROGRAM ARGS --out $OUT/NAME` (ARGS split at spaces; a .py with the
# node software's venv python, a .sh with bash), from the repository root, in the order given,
# under `timeout` for SECONDS (default 180, and never past the session's deadline), in a cgroup
# of its own so that whatever it leaves running (an engine it started, and that engine's
# containers) is ended before the next one. $OUT/NAME does not exist yet: the program makes
# it a folder, or writes a file there.
# A program that fails, times out or is missing is recorded; the others still run.
# Options:
#   --out DIR       where results go (default $OUT, else /tmp/gpu-session-out)
#   --deadline S    the whole session's seconds (default 560: the device allows 600)
#   --kit DIR       the kit (default .kit beside bench/)
#   --prefix DIR    install and run everything under DIR, not the machine's own paths
#   --no-gpu        a simulated GPU for the agent (with --prefix: a rehearsal without a GPU)
#   --no-setup      no kit, engine or images: run the programs on what the machine has
#                   (with $GPU_SESSION_PYTHON as their python, when set)
#   --smoke         no GPU, kit or set-up, in a temporary prefix and $OUT: the runner, its budgets
#                   and packing, with one program, bench/gpu_metrics.py --smoke (stand-in GPUs:
#                   root and the rehearsal's engine); the repository's .venv as the python
# What a program finds in its environment:
#   DOCKER_HOST               the session's engine: default runtime the guard, no default bridge
#                             (so an engine a program starts itself keeps docker0); swarm not
#                             initialised; images nvidia/cuda:12.6.3-base-ubuntu24.04 (the
#                             stand-in, with /usr/bin/cuda-probe) and the post-join check's
#   GPU_SESSION_PYTHON        the venv with nvidia-ml-py, PyYAML and prometheus_client (pinned)
#   CUDA_PROBE                a built bench/cuda_probe.c;  GPU_SESSION_CUDA_IMAGE  the stand-in
#   MPS_PEER                  a built bench/mps_peer.c (static), in the stand-in image as /usr/bin/mps-peer
#   GPU_SESSION_ENGINE        up, or down when the engine did not start
#   GPU_SESSION_ENDS_AT       unix time at which the program's budget ends
# In $OUT: session.log (everything printed), summary.json, session.tar.gz (kit versions as run
# here, the agent's report, daemon.json, config.toml, engine logs, nvidia-smi -q) and one
# NAME.tar.gz per program (what it wrote at --out, and console.log): so at most 5 programs.
set -uo pipefail

T0=$(date +%s)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT:-/tmp/gpu-session-out} DEADLINE=560 KIT_SRC=$repo/.kit PREFIX="" NO_GPU=0 NO_SETUP=0 SMOKE_TMP=""
SPECS=()
usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while (($#)); do
  case $1 in
    --out) OUT_DIR=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --kit) KIT_SRC=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --no-gpu) NO_GPU=1; shift ;;
    --no-setup) NO_SETUP=1; shift ;;
    --smoke)
      SMOKE_TMP=$(mktemp -d /tmp/gpu-session-smoke.XXXXXX)
      PREFIX=$SMOKE_TMP/root OUT_DIR=$SMOKE_TMP/out NO_GPU=1 NO_SETUP=1 DEADLINE=240
      SPECS+=("metrics:150=bench/gpu_metrics.py --smoke")
      if [ -z "${GPU_SESSION_PYTHON:-}" ] && [ -x "$repo/.venv/bin/python" ]; then
        export GPU_SESSION_PYTHON=$repo/.venv/bin/python
      fi
      shift
      ;;
    -h | --help) usage; exit 0 ;;
    --) shift; SPECS+=("$@"); break ;;
    -*) echo "gpu_session: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) SPECS+=("$1"); shift ;;
  esac
done
[[ $DEADLINE =~ ^[0-9]+$ ]] || { echo "gpu_session: --deadline $DEADLINE: expected whole seconds" >&2; exit 2; }
MAX_PROGRAMS=5 DEFAULT_BUDGET=180 GRACE=30 RESERVE=15  # RESERVE: packing after the last program
NAMES=() BUDGETS=() COMMANDS=()
for spec in "${SPECS[@]}"; do
  if ! [[ $spec =~ ^([A-Za-z0-9_-]+)(:([0-9]+))?=(.+)$ ]]; then
    echo "gpu_session: '$spec': expected NAME[:SECONDS]=PROGRAM [ARGS...], NAME in letters, digits, _ and -" >&2
    exit 2
  fi
  name=${BASH_REMATCH[1]}
  case " session summary ${NAMES[*]} " in
    *" $name "*) echo "gpu_session: program name '$name' is taken; give each program its own" >&2; exit 2 ;;
  esac
  NAMES+=("$name") BUDGETS+=("${BASH_REMATCH[3]:-$DEFAULT_BUDGET}") COMMANDS+=("${BASH_REMATCH[4]}")
done
if ((${#NAMES[@]} > MAX_PROGRAMS)); then
  echo "gpu_session: ${#NAMES[@]} programs, at most $MAX_PROGRAMS: \$OUT brings back 8 files" >&2
  exit 2
fi

# ---------------------------------------------------------------- paths: the node's, or under --prefix
P=${PREFIX%/}
KITROOT=$P/opt/gpu-swarm-kit BIN=$P/usr/local/bin NVBIN=$P/usr/bin ETC=$P/etc
NODE_DIR=$P/opt/gpu-swarm RUN=$P/run/gpu-session STATE=$P/var/lib/gpu-session
SOFTWARE=$NODE_DIR/software VENV=$NODE_DIR/venv LOGS=$STATE/logs
DOCKER_SOCK=$P/var/run/docker.sock
# Not containerd's default socket: an engine that a program starts itself (gpu_e2e.py) then
# starts a containerd of its own, as on a machine without this session.
CONTAINERD_SOCK=$RUN/containerd.sock
CUDA_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04  # what stacks/*.yml name
mkdir -p "$OUT_DIR" "$RUN" "$LOGS" "${DOCKER_SOCK%/*}" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
exec > >(trap '' TERM INT HUP; exec tee -a "$OUT_DIR/session.log") 2>&1
TEE_PID=$!
PY=$(command -v python3 || echo python3)  # the machine's own, before PATH changes
for dir in "$NVBIN" "$BIN"; do
  case ":$PATH:" in *":$dir:"*) ;; *) PATH=$dir:$PATH ;; esac
done
export PATH DOCKER_HOST="unix://$DOCKER_SOCK" PYTHONUNBUFFERED=1
if [ -n "$P" ]; then export XDG_CONFIG_HOME=$ETC; fi  # the toolkit then reads $ETC/nvidia-container-runtime
PYTHON=$VENV/bin/python

say() { printf 'session %s %s\n' "$(date -u +%T)" "$*"; }
left() { echo $((T0 + DEADLINE - $(date +%s))); }
SETUP_FAILED="" ENGINE=down STEP_T=0
STEPS_TSV=$STATE/steps.tsv PROGRAMS_TSV=$STATE/programs.tsv
: >"$STEPS_TSV"
: >"$PROGRAMS_TSV"
step() {  # step TITLE FUNCTION: times it, records it; a failure stops the set-up
  STEP_T=$(date +%s.%N)
  say "== $1"
  "$2"
  local rc=$? secs
  secs=$(awk -v a="$STEP_T" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\n' "$1" "$rc" "$secs" >>"$STEPS_TSV"
  if ((rc)); then
    say "!! $1 failed (exit $rc) after $secs s"
    SETUP_FAILED=$1
  else
    say "   $1: done in $secs s"
  fi
  return "$rc"
}

# ---------------------------------------------------------------- set-up steps
machine_facts() {
  {
    echo "kernel $(uname -r), $(nproc) cores, $(awk '/MemTotal/ { print $2 " kB" }' /proc/meminfo)"
    ldd --version 2>&1 | head -n1
    echo "python3: $PY ($("$PY" --version 2>&1))"
    echo "cgroup: $(stat -fc %T /sys/fs/cgroup 2>&1)"
    if ((NO_GPU)); then echo "no GPU (--no-gpu)"; else
      nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,mig.mode.current,compute_mode \
        --format=csv 2>&1
    fi
  } | tee "$LOGS/machine.txt"
  if [[ $(uname -r) == 4.4.0 ]]; then
    say "WARNING: kernel 4.4.0 is gVisor, where dockerd is unlikely to run: ask for nvidia-h100-x1 (Firecracker)"
  fi
  ((NO_GPU)) || { nvidia-smi -q >"$LOGS/nvidia-smi-q.txt" 2>&1; nvidia-smi -L >/dev/null; }
}

install_kit() {
  [ -f "$KIT_SRC/kit.tar.xz" ] || { say "no $KIT_SRC/kit.tar.xz: run bash bench/build_gpu_kit.sh and carry .kit"; return 1; }
  (cd "$KIT_SRC" && sha256sum -c --quiet SHA256SUMS) || { say "the kit does not match its SHA256SUMS"; return 1; }
  mkdir -p "$KITROOT" "$BIN" "$NVBIN"
  if cmp -s "$KIT_SRC/SHA256SUMS" "$KITROOT/SHA256SUMS"; then
    say "   $KITROOT already holds this kit"
  else
    rm -rf "${KITROOT:?}"/* && chmod 0755 "$KIT_SRC/busybox"
    if command -v xz >/dev/null; then xz -dc "$KIT_SRC/kit.tar.xz"; else "$KIT_SRC/busybox" unxz -c "$KIT_SRC/kit.tar.xz"; fi |
      tar -x -C "$KITROOT" || return 1
    cp "$KIT_SRC/SHA256SUMS" "$KITROOT/SHA256SUMS"
  fi
  install -m 0755 "$KIT_SRC/busybox" "$BIN/busybox"
  local bin name missing=""
  for bin in "$KITROOT"/bin/*; do
    name=${bin##*/}
    case $name in
      nvidia-*) install -m 0755 "$bin" "$NVBIN/$name" ;;  # where the toolkit's package puts them
      cuda-probe | mps-peer) ;;  # go into images only
      *) install -m 0755 "$bin" "$BIN/$name" ;;
    esac
    if ldd "$bin" 2>&1 | grep -q 'not found'; then missing+=" $name: $(ldd "$bin" 2>&1 | grep 'not found' | paste -sd' ');"; fi
  done
  # trixie's runc needs glibc >= 2.38 (the GPU machines have 2.39). A rehearsal under --prefix
  # on an older machine uses that machine's runc; a real session cannot do without it.
  if [ -n "$P" ] && [[ $missing == *" runc: "* ]] && command -v /usr/sbin/runc >/dev/null; then
    say "   the kit's runc cannot run here (--prefix rehearsal): using /usr/sbin/runc"
    rm -f "$BIN/runc" && ln -s /usr/sbin/runc "$BIN/runc"
    missing=$(printf '%s' "$missing" | sed 's/ runc: [^;]*;//')
  fi
  if [ -n "$missing" ]; then say "these cannot run here:$missing"; return 1; fi
  {
    for tool in dockerd docker containerd runc docker-init docker-proxy nvidia-ctk nvidia-container-runtime; do
      # nvidia-container-runtime goes on with the version of the runc it finds: cut there.
      printf '%-26s %s\n' "$tool" "$("$tool" --version 2>&1 | sed '2,${/^runc version/,$d}' | head -n2 | paste -sd' ')"
    done
    printf '%-26s %s\n' busybox "$(busybox 2>&1 | head -n1)"
  } | tee "$LOGS/versions-here.txt"
}

python_env() {
  local site=$VENV/site
  if [ -x "$PYTHON" ] && [ ! -d "$site" ] || "$PY" -m venv --without-pip "$VENV"; then
    site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  else
    say "   python3 -m venv failed: a plain folder on PYTHONPATH instead"
    mkdir -p "$VENV/bin" "$site"
    # shellcheck disable=SC2016  # $PYTHONPATH and $@ are the wrapper's, at its run time
    printf '#!/bin/sh\nPYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n' "$site" "$PY" >"$PYTHON"
    chmod 0755 "$PYTHON"
  fi
  # The kit's wheels go in as files (no pip needed); the PyYAML built for this Python if there
  # is one (any other still works, in pure Python). The outer Python's packages stay visible
  # after ours (a .pth), for programs that want them.
  "$PYTHON" - "$KITROOT/wheels" "$site" "$("$PY" -c 'import site; print(":".join(site.getsitepackages()))')" \
    <<'EOF' || return 1
import glob, os, sys, zipfile
wheels, site, outer = sys.argv[1], sys.argv[2], [p for p in sys.argv[3].split(":") if p]
tag = "-cp%d%d-" % sys.version_info[:2]
chosen = {}
for wheel in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    project = os.path.basename(wheel).split("-")[0].lower()
    if project not in chosen or tag in os.path.basename(wheel):
        chosen[project] = wheel
for wheel in chosen.values():
    zipfile.ZipFile(wheel).extractall(site)
with open(os.path.join(site, "zz-outer-python.pth"), "w") as f:  # addsitedir: their own .pth files too
    f.write("".join(f"import site; site.addsitedir({p!r})\n" for p in outer if p != site))
print(f"   {sys.executable}: " + ", ".join(os.path.basename(w) for w in chosen.values()) + f" -> {site}")
EOF
  # shellcheck source=../node/versions.env
  . "$repo/node/versions.env"
  "$PYTHON" - "$NVIDIA_ML_PY_VERSION" "$PROMETHEUS_CLIENT_VERSION" <<'EOF'
import sys
from importlib.metadata import version
import prometheus_client, pynvml, yaml  # noqa: F401  (each must import)
have = (version("nvidia-ml-py"), version("prometheus_client"))
print(f"   nvidia-ml-py {have[0]}, PyYAML {yaml.__version__}, prometheus_client {have[1]} ({pynvml.__file__})")
sys.exit(0 if have == tuple(sys.argv[1:]) else f"   not the versions node/versions.env pins: {sys.argv[1:]}")
EOF
}

node_boot() {  # what a node's boot does before docker starts: its software, the toolkit config, the agent
  mkdir -p "$SOFTWARE" "$ETC/docker" "$ETC/nvidia-container-runtime" "$ETC/gpu-swarm"
  cp -R "$repo/node/." "$SOFTWARE/" && rm -rf "$SOFTWARE/__pycache__"
  local toml=$ETC/nvidia-container-runtime/config.toml
  if [ -f "$toml" ]; then say "   kept $toml"; else
    nvidia-ctk config default --output "$toml" || return 1  # as the toolkit's package does
  fi
  local inventory=()
  if ((NO_GPU)); then
    printf '[{"index": 0, "uuid": "GPU-5e551011-0000-4000-8000-000000000001", "name": "Simulated GPU", "memory_mib": 81559}]\n' \
      >"$STATE/inventory.json"
    inventory=(--inventory "$STATE/inventory.json")
  fi
  "$PYTHON" "$SOFTWARE/gpu_agent.py" --json "${inventory[@]}" --daemon-json "$ETC/docker/daemon.json" \
    --toolkit-config "$toml" --runtime-config "$ETC/gpu-swarm/runtime.env" --guard "$SOFTWARE/gpu-swarm-runtime" \
    --guard-server "$GUARD_DIR" --runtime-delegate "$NVBIN/nvidia-container-runtime" >"$LOGS/agent-report.json" || return 1
  cp "$ETC/docker/daemon.json" "$toml" "$ETC/gpu-swarm/runtime.env" "$LOGS/"
  "$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print("   advertised:", " ".join(r["resources"]) or "nothing", "| warnings:", r.get("warnings") or "none")' \
    "$LOGS/agent-report.json"
  say "   toolkit: $(grep -E '^[[:space:]]*(swarm-resource|mode)[[:space:]]*=' "$toml" | paste -sd' ')"
}

await_up() {  # PID LOG WHAT CMD...: until CMD succeeds (30 s at most) while PID lives; else the end of LOG
  local pid=$1 log=$2 what=$3 i
  shift 3
  for ((i = 0; i < 150; i++)); do
    "$@" && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  say "   $what did not start; the end of its log:"
  tail -n 20 "$log"
  return 1
}

# The guard's server, as gpu-swarm-guard.service runs it before docker on a node, so that the
# programs measure a node's real path. Its folder is the session's own (a program may start a
# server of its own in the node's path, /run/gpu-swarm/guard).
GUARD_DIR=$RUN/guard GUARD_PID=""
start_guard() {
  rm -f "$GUARD_DIR/server.pid"
  /usr/bin/python3 -I -S "$SOFTWARE/guard_server.py" "$GUARD_DIR" >"$LOGS/guard-server.log" 2>&1 &
  GUARD_PID=$!
  await_up "$GUARD_PID" "$LOGS/guard-server.log" "the guard's server" test -e "$GUARD_DIR/server.pid" || return 1
  say "   guard server $GUARD_PID in $GUARD_DIR"
}

CONTAINERD_PID="" DOCKERD_PID=""
start_engine() {
  mkdir -p "$STATE/containerd" "$RUN/containerd-state" "$ETC/containerd"
  # No CRI: nothing here is Kubernetes, and it would look for CNI plugins.
  printf 'version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n' >"$ETC/containerd/gpu-session.toml"
  containerd --config "$ETC/containerd/gpu-session.toml" --root "$STATE/containerd" \
    --state "$RUN/containerd-state" --address "$CONTAINERD_SOCK" >"$LOGS/containerd.log" 2>&1 &
  CONTAINERD_PID=$!
  # The flags a machine without iptables needs stay on the command line: dockerd refuses a
  # setting given in daemon.json as well. No default bridge (see the header).
  DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1 dockerd --config-file "$ETC/docker/daemon.json" \
    --containerd "$CONTAINERD_SOCK" --data-root "$STATE/docker" --exec-root "$RUN/docker" \
    --pidfile "$RUN/dockerd.pid" -H "unix://$DOCKER_SOCK" --iptables=false --ip6tables=false --bridge=none \
    >"$LOGS/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  await_up "$DOCKERD_PID" "$LOGS/dockerd.log" dockerd engine_answers || return 1
  ENGINE=up
  say "   engine $(docker version --format '{{.Server.Version}}') up, default runtime" \
    "$(docker info --format '{{.DefaultRuntime}}'), resources $(docker info --format '{{json .GenericResources}}' | head -c 300)"
}

engine_answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

build_images() {
  GPU_SWARM_VERSIONS="$repo/node/versions.env" GPU_SWARM_NODE_ENV=/nonexistent GPU_SWARM_STATE="$STATE" \
    GPU_SWARM_LOG=/dev/null bash "$repo/node/build-check-image.sh" || return 1
  local peer=()
  if [ -x "$KITROOT/bin/mps-peer" ]; then peer=("$KITROOT/bin/mps-peer"); fi # a kit built before it has none
  bash "$repo/bench/cuda_standin.sh" "$CUDA_IMAGE" "$KITROOT/bin/cuda-probe" "${peer[@]}" || return 1
  docker image ls --format '   {{.Repository}}:{{.Tag}} {{.Size}}'
  if ((NO_GPU)); then  # no GPU: a container that reserved none still goes guard -> nvidia runtime -> runc
    local said
    # shellcheck disable=SC2016  # expanded in the container
    said=$(timeout 60 docker run --rm "$CUDA_IMAGE" sh -c 'echo "started; $(ls /dev | grep -c nvidia) nvidia devices"' 2>&1)
    say "   docker run (no GPU asked): $said"
    [[ $said == started* ]]
    return
  fi
  # One container through the whole chain (guard -> nvidia runtime), as `docker run --gpus` does.
  local seen
  seen=$(timeout 60 docker run --rm --gpus all "$CUDA_IMAGE" nvidia-smi -L 2>&1)
  say "   docker run --gpus all nvidia-smi -L: $seen"
  [[ $seen == *"UUID: GPU-"* ]]
}

# ---------------------------------------------------------------- programs
CG_BASE=""
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then CG_BASE=/sys/fs/cgroup; elif [ -d /sys/fs/cgroup/pids ]; then
  CG_BASE=/sys/fs/cgroup/pids  # cgroup v1: the pids hierarchy has cgroup.procs too
fi
CG_GROUP=$CG_BASE/gpu-session-$$  # this session's own: two sessions at once never share a program's cgroup
kill_all_in() {  # kill_all_in CGROUP_DIR: prints how many processes it ended
  local pid
  local -A ended=()
  for _ in 1 2 3; do
    { while read -r pid; do kill -9 "$pid" && ended[$pid]=1; done <"$1/cgroup.procs"; } 2>/dev/null
    sleep 0.2
  done
  echo "${#ended[@]}"
}
sweep() {  # sweep CGROUP: end what a program left running, and the containers of engines it left
  local cg=$1 n dir pid orphans=0
  n=$(kill_all_in "$cg")
  rmdir "$cg" 2>/dev/null
  ((n)) || return 0
  say "   ended $n process(es) that the program left running"
  # An engine ended above leaves its containers (cgroupfs driver: $CG_BASE/docker/ID) without
  # their shim, so their first process now has PID 1 as its parent. A running engine's
  # containers have a live shim as parent: they are never touched.
  for dir in "$CG_BASE"/docker/*/; do
    [ -f "$dir/cgroup.procs" ] || continue
    while read -r pid; do
      if [ "$(awk '/^PPid:/ { print $2 }' "/proc/$pid/status" 2>/dev/null)" = 1 ]; then
        orphans=$((orphans + $(kill_all_in "$dir")))
        break
      fi
    done <"$dir/cgroup.procs"
  done
  ((orphans == 0)) || say "   ended $orphans process(es) of containers whose engine had gone"
}

unpath() {  # unpath DIR|FILE: the checkout's path and $OUT in its text files become <repo> and <out>: results are committed, paths are not
  # $OUT also where it ends a word (the summary's "files in $OUT_DIR:"), not only inside a longer path.
  grep -rIlF -e "$repo/" -e "$OUT_DIR" "$1" 2>/dev/null | while IFS= read -r file; do
    sed -i -e "s|$repo/|<repo>/|g" -e "s|$OUT_DIR\b|<out>|g" "$file"
  done
}

pack() {  # pack NAME: what the program wrote at $OUT/NAME (a folder or a file) and its console
  # output -> $OUT/NAME.tar.gz, under the 16 MiB a file may have (bigger files are left out, by name)
  local name=$1 limit big
  local stage=$STATE/pack/$name
  rm -rf "$stage" && mkdir -p "$stage"
  if [ -d "$OUT_DIR/$name" ]; then mv "$OUT_DIR/$name" "$stage/$name"; else
    mkdir "$stage/$name"
    if [ -e "$OUT_DIR/$name" ]; then mv "$OUT_DIR/$name" "$stage/$name/out"; fi  # it wrote a file
  fi
  cp "$STATE/console-$name.log" "$stage/$name/console.log"
  unpath "$stage"
  for limit in $((12 * 1024 * 1024)) $((1024 * 1024)); do  # again with small files only, if still too big
    big=$(cd "$stage" && find "$name" -type f -size +"$limit"c -printf '%p (%s bytes)\n')
    if [ -n "$big" ]; then
      printf 'left out of %s.tar.gz (over %s bytes):\n%s\n' "$name" "$limit" "$big" | tee "$stage/$name/LEFT-OUT.txt"
    fi
    (cd "$stage" && find "$name" -type f ! -size +"$limit"c -print0 | tar --null -T - -czf "$OUT_DIR/$name.tar.gz") ||
      return 1
    (($(stat -c %s "$OUT_DIR/$name.tar.gz") < 15 * 1024 * 1024)) && break
  done
  rm -rf "$stage"
}

run_program() {  # run_program INDEX
  local name=${NAMES[$1]} want=${BUDGETS[$1]} command=${COMMANDS[$1]} words program status rc=0 t secs budget
  read -r -a words <<<"$command"
  program=${words[0]}
  [[ $program == /* ]] || program=$repo/$program
  local remaining
  remaining=$(($(left) - RESERVE))
  budget=$want
  ((budget > remaining - GRACE)) && budget=$((remaining - GRACE))
  say "== program $name: $command --out $OUT_DIR/$name (budget ${budget} s)"
  if [ -n "$SETUP_FAILED" ] && [ "$SETUP_FAILED" != "engine" ] && [ "$SETUP_FAILED" != "images" ]; then
    status="not run: set-up failed at '$SETUP_FAILED'" rc=-1
  elif [ ! -f "$program" ]; then
    status="not run: $program does not exist" rc=-1
  elif ((budget < want && budget < 20)); then
    status="not run: $((budget + GRACE)) s left of the session's ${DEADLINE} s, under 20 s plus ${GRACE} s to stop" rc=-1
  fi
  if ((rc == -1)); then
    say "   $status"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" -1 0 "$budget" "$status" "$command" >>"$PROGRAMS_TSV"
    echo "$status" >"$STATE/console-$name.log"
    pack "$name"
    return
  fi
  local run=("$program")
  case $program in *.py) run=("$PYTHON" -u "$program") ;; *.sh) run=(bash "$program") ;; esac
  local cg=""
  if [ -n "$CG_BASE" ] && mkdir -p "$CG_GROUP/$name" 2>/dev/null; then cg=$CG_GROUP/$name; fi
  t=$(date +%s.%N)
  (
    if [ -n "$cg" ]; then echo "$BASHPID" >"$cg/cgroup.procs"; fi
    cd "$repo" && GPU_SESSION_ENDS_AT=$(($(date +%s) + budget)) exec timeout -k "$GRACE" "$budget" \
      "${run[@]}" "${words[@]:1}" --out "$OUT_DIR/$name"
  ) </dev/null 2>&1 | tee "$STATE/console-$name.log"
  rc=${PIPESTATUS[0]}
  secs=$(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  [ -n "$cg" ] && sweep "$cg"
  case $rc in
    0) status=passed ;;
    124 | 137) status="timed out after $budget s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  say "   program $name: $status in $secs s"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$budget" "$status" "$command" >>"$PROGRAMS_TSV"
  pack "$name"
  write_summary
}

write_summary() {  # summary.json from the two tables, rewritten after each program
  "$PY" - "$STEPS_TSV" "$PROGRAMS_TSV" "$OUT_DIR/summary.json" "$T0" "$DEADLINE" "$ENGINE" <<'EOF'
import json, os, sys, time
steps, programs, out, t0, deadline, engine = sys.argv[1:]
rows = lambda p: [line.rstrip("\n").split("\t") for line in open(p) if line.strip()]
summary = {
    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(t0))), "seconds": round(time.time() - int(t0), 1),
    "deadline_s": int(deadline), "engine": engine,
    "setup": [{"step": s, "rc": int(rc), "seconds": float(secs)} for s, rc, secs in rows(steps)],
    "programs": [{"name": n, "rc": int(rc), "seconds": float(secs), "budget_s": int(b), "status": st, "command": c}
                 for n, rc, secs, b, st, c in rows(programs)],
}
summary["ok"] = all(s["rc"] == 0 for s in summary["setup"]) and all(p["rc"] == 0 for p in summary["programs"])
with open(out + ".tmp", "w") as f:
    json.dump(summary, f, indent=2)
os.replace(out + ".tmp", out)
EOF
}

finish() {
  local rc=$?
  trap - EXIT TERM INT
  if [ -n "$DOCKERD_PID" ]; then
    docker swarm leave --force >/dev/null 2>&1
    kill "$DOCKERD_PID" 2>/dev/null && timeout 30 tail --pid="$DOCKERD_PID" -f /dev/null
    # dockerd bind-mounts its data root onto itself, and leaves it mounted.
    if mountpoint -q "$STATE/docker" 2>/dev/null; then umount "$STATE/docker"; fi
  fi
  [ -n "$GUARD_PID" ] && kill "$GUARD_PID" 2>/dev/null
  if [ -n "$CONTAINERD_PID" ]; then
    kill "$CONTAINERD_PID" 2>/dev/null && timeout 15 tail --pid="$CONTAINERD_PID" -f /dev/null
  fi
  unpath "$STATE/logs"
  (cd "$STATE" && tar -czf "$OUT_DIR/session.tar.gz" logs) || say "could not pack $LOGS"
  [ -n "$CG_BASE" ] && rmdir "$CG_GROUP" 2>/dev/null
  write_summary
  say "== summary ($(($(date +%s) - T0)) s of ${DEADLINE} s)"
  awk -F'\t' '{ printf "   set-up  %-28s %s (%s s)\n", $1, ($2 == 0 ? "ok" : "FAILED, exit " $2), $3 }' "$STEPS_TSV"
  awk -F'\t' '{ printf "   program %-28s %s (%s s of %s)\n", $1, $5, $3, $4 }' "$PROGRAMS_TSV"
  say "files in $OUT_DIR: $(find "$OUT_DIR" -mindepth 1 -maxdepth 1 -printf '%f ')"
  local ok
  ok=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["ok"])' "$OUT_DIR/summary.json" 2>/dev/null)
  say "result: $([ "$ok" = True ] && echo "ALL PASSED" || echo "SOMETHING FAILED")"
  exec >&- 2>&-
  wait "$TEE_PID" 2>/dev/null
  unpath "$OUT_DIR/session.log"  # the console as it was printed, now closed: committed like the rest
  if [ -n "$SMOKE_TMP" ]; then rm -rf "$SMOKE_TMP"; fi
  if [ "$ok" = True ] && ((rc == 0)); then exit 0; fi
  exit 1
}
trap finish EXIT
trap 'say "stopped by a signal"; exit 143' TERM INT

say "gpu-swarm GPU session: ${#NAMES[@]} program(s), ${DEADLINE} s, out $OUT_DIR${P:+, prefix $P}$( ((NO_GPU)) && echo ', no GPU')"
step machine machine_facts
if ((NO_SETUP)); then
  PYTHON=${GPU_SESSION_PYTHON:-$PY}
else
  [ -z "$SETUP_FAILED" ] && step kit install_kit
  [ -z "$SETUP_FAILED" ] && step python python_env
  [ -z "$SETUP_FAILED" ] && step node-boot node_boot
  [ -z "$SETUP_FAILED" ] && step guard start_guard
  [ -z "$SETUP_FAILED" ] && step engine start_engine
  [ -z "$SETUP_FAILED" ] && step images build_images
fi
if [ -x "$KITROOT/bin/mps-peer" ]; then export MPS_PEER=$KITROOT/bin/mps-peer; fi # else gpu_mps.py builds one
export GPU_SESSION_PYTHON=$PYTHON CUDA_PROBE=$KITROOT/bin/cuda-probe GPU_SESSION_CUDA_IMAGE=$CUDA_IMAGE \
  GPU_SESSION_ENGINE=$ENGINE GPU_SESSION_KIT=$KITROOT
write_summary
for i in "${!NAMES[@]}"; do run_program "$i"; done
