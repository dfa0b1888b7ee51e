#!/usr/bin/env bash
# Sets up this machine (scripts/setup.sh: the engine, the node image, Pulumi's CLI from its Go
# module) and runs Pulumi's real `pulumi up --stack dev` of the unchanged program against local
# machines: each instance boots the program's user data with real cloud-init, each command of the
# program runs over real SSH, and Pulumi's own engine orders and records every step (the
# providers are the rehearsal's, localswarm/provider_plugin.py). Then the report, read from the
# stack's outputs. Run as root; extra arguments go to `pulumi up` (e.g. --parallel 4,
# --replace URN); `.venv/bin/python -m localswarm pulumi --stack dev destroy --yes` undoes it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m localswarm pulumi --stack dev --report up --yes "$@"
