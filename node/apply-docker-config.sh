#!/usr/bin/env bash
# Last step: drop live-restore (swarm mode refuses it), restart dockerd if what it reads only at
# start (runtimes, generic resources, ...) changed since we last did. Labels are left out: the
# health watcher changes them while the node runs, and dockerd reloads them on SIGHUP.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
conf=$DOCKER_DAEMON_JSON stamp=$GPU_SWARM_STATE/daemon.json.applied
mkdir -p "$(dirname "$conf")"
[ -s "$conf" ] || echo '{}' >"$conf"
sum=$(python3 - "$conf" <<'PY'
import hashlib, json, os, sys
path = sys.argv[1]
with open(path) as f:
    config = json.load(f)
if "live-restore" in config:
    del config["live-restore"]
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=2)
    os.replace(path + ".tmp", path)
    print("removed live-restore from", path, file=sys.stderr)
config.pop("labels", None)
print(hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest())
PY
)
systemctl enable -q docker
if [ "$sum" = "$(cat "$stamp" 2>/dev/null)" ] && systemctl is-active -q docker; then skip "dockerd has $conf"; fi
# A deliberate restart: the agent's unit may have restarted docker moments ago, and systemd's
# start limit (3 in 60 s for docker.service) must not turn this one into a failure.
systemctl reset-failed docker 2>/dev/null || :
systemctl restart docker
echo "$sum" >"$stamp"
