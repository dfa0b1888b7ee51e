#!/usr/bin/env bash
# Sets up this machine (scripts/setup.sh) and runs the Pulumi program itself against local
# machines: `localswarm program up --stack dev`, a `pulumi up` under Pulumi's mocks in which every
# instance boots the program's user data with real cloud-init and every command of the program
# runs over real SSH. Run as root; extra arguments go to `program up` (see
# `.venv/bin/python -m localswarm program --help`), e.g. --stack prod, --json.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m localswarm program up --stack dev "$@"
