#!/usr/bin/env bash
# The last step of an elastic pool's node: join the swarm by itself, drained, from the pool's SSM join
# parameter (swarm_join.py, system python3). The leader's scaler admits it after the same GPU check a fixed
# node gets. A fixed node has no join parameter: `pulumi up` joins it over SSH, and this step skips.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ -z "${GPU_SWARM_JOIN_PARAMETER:-}" ]; then skip "not an elastic pool's node: pulumi up joins it"; fi
: "${GPU_SWARM_REGION:?node.env names no region}" "${GPU_SWARM_ELASTIC_POOL:?node.env names no pool}"
python3 "$(dirname "${BASH_SOURCE[0]}")/swarm_join.py" --parameter "$GPU_SWARM_JOIN_PARAMETER" \
  --region "$GPU_SWARM_REGION" --pool "$GPU_SWARM_ELASTIC_POOL" --daemon-json "$DOCKER_DAEMON_JSON"
