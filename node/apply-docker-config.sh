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
# Asked first: docker's package ships an init script too, so `enable` runs systemd-sysv-install
# (update-rc.d) each time, 0.27 s even when the unit is enabled already. --no-reload: the links
# are for the next boot.
systemctl is-enabled -q docker 2>/dev/null || systemctl enable --no-reload -q docker
# dockerd has read the file if it started after the file last changed: on a node's first boot it
# started after cloud-init wrote it, and on a GPU node the agent restarted it moments ago. A
# restart then only cost time (1-2 s of every first boot). Unknown (systemd < 248): restart.
started_after_change() {
  local started
  started=$(systemctl show docker -p ExecMainStartTimestamp --value --timestamp=us+utc 2>/dev/null) &&
    [ -n "$started" ] && started=$(date -d "$started" +%s.%6N 2>/dev/null) &&
    awk -v changed="$(stat -c %.6Y "$conf")" -v started="$started" 'BEGIN { exit !(changed < started) }'
}
if systemctl is-active -q docker && { [ "$sum" = "$(cat "$stamp" 2>/dev/null)" ] || started_after_change; }; then
  echo "$sum" >"$stamp"
  skip "dockerd has $conf"
fi
# A deliberate restart: the agent's unit may have restarted docker moments ago, and systemd's
# start limit (3 in 60 s for docker.service) must not turn this one into a failure.
systemctl reset-failed docker 2>/dev/null || :
systemctl restart docker
echo "$sum" >"$stamp"
