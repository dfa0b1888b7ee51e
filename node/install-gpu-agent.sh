#!/usr/bin/env bash
# The GPU agent: its venv (install-agent-venv.sh), its unit installed from the node software,
# enabled and run now; and the runtime guard's server (gpu-swarm-guard.service).
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
here=$(dirname "${BASH_SOURCE[0]}")
# The venv: done already when the boot's background run of install-agent-venv got there first
# (it waits for that run). Not a step's status of its own here: this step installs the units.
STEP_STATUS_FILE="" bash "$here/install-agent-venv.sh" || die "the agent's venv could not be made (install-agent-venv.sh)"
install_unit "$here/gpu-swarm-agent.service"
run_unit gpu-swarm-agent.service start
# The runtime guard's server (guard_server.py): restarted, so new node software runs at once.
install_service gpu-swarm-guard.service
# A changed GPU configuration (the first boot's, MPS turned on, a new GPU) makes the agent's unit
# queue a docker restart and return (--no-block: see the unit). The guard's server above needs no
# docker, so it was installed while docker restarted. The steps after this one talk to docker
# (apply-docker-config first): the restart must be over before they run, or they meet a docker that
# is going down. With no change, no job is queued.
end=$((SECONDS + 180))
while [ -n "$(systemctl list-jobs --no-legend docker.service 2>/dev/null)" ]; do
  [ "$SECONDS" -lt "$end" ] || die "docker's restart for the new GPU configuration is still queued after 180 s (systemctl list-jobs)"
  sleep 0.2
done
