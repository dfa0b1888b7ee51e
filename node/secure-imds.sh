#!/usr/bin/env bash
# IMDS for root only (imds-root-only.sh), now and at every boot: the node's user data holds its
# private SSH host key, which any local user could otherwise read from the metadata service.
# Then the node proves that EC2 launched it with IMDSv2 required: a request without a token must be
# refused (401). An instance launched without the program's metadata options (the legacy spot request
# API dropped them) answers it, and then any process that reaches IMDS reads the user data.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_service gpu-swarm-imds.service
imds=${GPU_SWARM_IMDS:-http://169.254.169.254}
# A few tries: the metadata service answers from the first second, but the first packet of a boot may be lost.
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 3 --retry 3 --retry-connrefused --retry-delay 1 \
  "$imds/latest/meta-data/instance-id") || :
case $code in
  401) log "IMDS refuses a request without a token: IMDSv2 is required" ;;
  200) die "IMDS at $imds answered a request without a token (IMDSv1): this instance was launched without" \
    "http_tokens=required, and any process that reaches IMDS can read its user data; replace it" \
    "(pulumi up --replace with its URN)" ;;
  *) die "IMDS at $imds did not answer a request without a token as IMDSv2 does (HTTP ${code:-none}, expected 401)" ;;
esac
