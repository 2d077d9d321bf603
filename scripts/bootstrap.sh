#!/usr/bin/env bash
# Installs everything `make up` and `make test` need on a fresh machine; safe to rerun.
# System: Debian's libibverbs1 (Mooncake's binaries link it even for TCP).
# Python: .venv with torch 2.13.0 (the CPU build without a GPU, the CUDA build with one) and the
# project, whose Mooncake wheel is the non-CUDA one on every machine (docs: "GPUs").
# `--test` only adds what the tests need on top: Debian's chromium, for the dashboard test, and
# iproute2 and util-linux, for the multi-host test's network namespaces.
# `--plan` prints what this machine would get and why, and changes nothing (the tests run it
# with a GPU faked by an nvidia-smi on PATH and a torch faked by VENV's python).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0  # the version the tests cover
# Mooncake wheels that would write into the same mooncake/ folder as the one we install.
OTHER_MOONCAKES="mooncake-transfer-engine mooncake-transfer-engine-cuda13"

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
    echo "bootstrap: installing $*"
    sudo_if_needed apt-get update -qq
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

mode=install
case "${1:-}" in
    --test)
        command -v chromium >/dev/null 2>&1 || apt_install chromium
        command -v ip >/dev/null 2>&1 || apt_install iproute2
        command -v unshare >/dev/null 2>&1 || apt_install util-linux
        exit 0 ;;
    --plan) mode=plan ;;
esac

# What is here: a GPU, and what the venv holds (its torch build, other Mooncake wheels).
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu=yes
else
    gpu=no
fi
read -r have_torch have_cuda have_mooncakes < <(
    { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$OTHER_MOONCAKES" 2>/dev/null <<'PY'
import importlib.metadata as metadata
import sys
try:
    import torch
    version, cuda = torch.__version__, torch.version.cuda or "none"
except ImportError:
    version, cuda = "none", "none"
found = []
for name in sys.argv[1].split():
    try:
        metadata.version(name)
        found.append(name)
    except metadata.PackageNotFoundError:
        pass
print(version, cuda, ",".join(found) or "-")
PY
    } || echo "none none -")

# The decisions. A +cpu torch satisfies `torch>=2.4` on a GPU machine, and `device=auto` would
# then run on the CPU without a word: on a GPU machine the CUDA build replaces it.
torch_action=keep
if [ "$gpu" = yes ]; then
    if [ "$have_torch" != "$TORCH_VERSION" ] || [ "$have_cuda" = none ]; then
        torch_action="install the CUDA build of torch $TORCH_VERSION (have: $have_torch, CUDA $have_cuda)"
    fi
elif [ "${have_torch%%+*}" != "$TORCH_VERSION" ]; then
    torch_action="install the CPU build of torch $TORCH_VERSION (have: $have_torch)"
fi
mooncake_action=keep
if [ "$have_mooncakes" != "-" ]; then
    mooncake_action="remove ${have_mooncakes//,/ } (they share the mooncake/ folder), then reinstall the non-CUDA wheel"
fi

if [ "$mode" = plan ]; then
    echo "gpu: $gpu"
    echo "torch: $torch_action"
    echo "mooncake: $mooncake_action"
    [ "$gpu" = yes ] && echo "check: torch.cuda.is_available() after the install"
    exit 0
fi

ldconfig -p | grep -q 'libibverbs\.so\.1' || apt_install libibverbs1

if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip

if [ "$torch_action" != keep ]; then
    echo "bootstrap: $torch_action"
    if [ "$gpu" = yes ]; then
        # No find-links: a CPU wheel kept on local disk has the same version and would win.
        PIP_FIND_LINKS="" "${pip[@]}" install -q --force-reinstall "torch==$TORCH_VERSION"
    else
        # A CPU build from local disk where the machine keeps one; an unpinned torch would
        # pull a multi-GB CUDA build.
        "${pip[@]}" install -q "torch==$TORCH_VERSION"
    fi
fi
if [ "$mooncake_action" != keep ]; then
    echo "bootstrap: $mooncake_action"
    # shellcheck disable=SC2086  # one word per distribution
    "${pip[@]}" uninstall -q -y ${have_mooncakes//,/ }
    "${pip[@]}" install -q --force-reinstall --no-deps "$(grep -o 'mooncake-transfer-engine-non-cuda==[^"]*' pyproject.toml)"
fi
echo "bootstrap: installing diffcache[dev]"
"${pip[@]}" install -q -e ".[dev]"
if [ "$gpu" = yes ] && ! "$VENV/bin/python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "bootstrap: nvidia-smi lists a GPU, but torch $TORCH_VERSION sees none (driver older than its CUDA runtime?)" >&2
    exit 1
fi
touch "$VENV/.installed"
