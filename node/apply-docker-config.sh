#!/usr/bin/env bash
# Last step: drop live-restore (swarm mode refuses it), restart dockerd if daemon.json
# changed since we last did (it reads runtimes and generic resources only at start).
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
conf=$DOCKER_DAEMON_JSON stamp=$GPU_SWARM_STATE/daemon.json.applied
mkdir -p "$(dirname "$conf")"
[ -s "$conf" ] || echo '{}' >"$conf"
python3 - "$conf" <<'PY'
import json, os, sys
path = sys.argv[1]
with open(path) as f:
    config = json.load(f)
if "live-restore" in config:
    del config["live-restore"]
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=2)
    os.replace(path + ".tmp", path)
    print("removed live-restore from", path)
PY
systemctl enable -q docker
sum=$(sha256sum "$conf")
if [ "$sum" = "$(cat "$stamp" 2>/dev/null)" ] && systemctl is-active -q docker; then skip "dockerd has $conf"; fi
systemctl restart docker
echo "$sum" >"$stamp"
