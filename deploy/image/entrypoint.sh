#!/bin/sh
# Every spopp container starts here. The shared bearer token: SPOPP_API_TOKEN when .env sets one,
# else the one the `data` step generated once into the secrets volume (readable by the services
# only). Then the driver check, then the command itself, as PID 1's only child under tini (signals
# reach it; zombies of sandboxed tool calls are reaped).
set -e
secrets="${SPOPP_SECRETS_DIR:-/secrets}"
if [ -z "${SPOPP_API_TOKEN:-}" ] && [ -r "$secrets/api-token" ]; then
    SPOPP_API_TOKEN="$(cat "$secrets/api-token")"
    export SPOPP_API_TOKEN
fi
# The node's NVIDIA driver against this image's CUDA build of torch, before any work: a driver too old
# stops here with one line naming both (spopp/machine/cuda_driver.py; SPOPP_DRIVER_CHECK=0 skips it).
if [ "${SPOPP_DRIVER_CHECK:-1}" != 0 ]; then
    python3 -m spopp.machine.cuda_driver || exit $?
fi
exec "$@"
