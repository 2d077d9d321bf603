#!/usr/bin/env bash
# Installs everything `make up` and `make test` need on a fresh machine; safe to rerun.
# System: Debian's libibverbs1 (Mooncake's binaries link it even for TCP).
# Python: .venv with torch (a pinned CPU build where there is no GPU) and the project.
# `--test` only adds what the tests need on top: Debian's chromium, for the dashboard test, and
# iproute2 and util-linux, for the multi-host test's network namespaces.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
    echo "bootstrap: installing $*"
    sudo_if_needed apt-get update -qq
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

if [ "${1:-}" = "--test" ]; then
    command -v chromium >/dev/null 2>&1 || apt_install chromium
    command -v ip >/dev/null 2>&1 || apt_install iproute2
    command -v unshare >/dev/null 2>&1 || apt_install util-linux
    exit 0
fi

ldconfig -p | grep -q 'libibverbs\.so\.1' || apt_install libibverbs1

if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv"
    "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    flavour=cuda
else
    flavour=cpu
    # A CPU build from local disk; an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
echo "bootstrap: installing diffcache[dev,$flavour]"
.venv/bin/python -m pip install -q -e ".[dev,$flavour]"
touch .venv/.installed
