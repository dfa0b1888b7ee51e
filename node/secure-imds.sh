#!/usr/bin/env bash
# IMDS for root only (imds-root-only.sh), now and at every boot: the node's user data holds its
# private SSH host key, which any local user could otherwise read from the metadata service.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_service gpu-swarm-imds.service
