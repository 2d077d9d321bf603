#!/usr/bin/env bash
# The device check (bench/gpu_check.py) on a lent GPU machine, which has Python 3.12 and a CUDA
# torch but neither diffusers nor the pinned transformers, reaches no registry, and takes 64 MiB
# of tree and carried files a call (docs: "GPUs").
#
#   scripts/gpu_check.sh prepare        here: the models (default presets) and the wheels the
#                                       check imports, into .gpu_check/ (ignored by git)
#   scripts/gpu_check.sh run [ARGS]     there: installs the carried wheels beside the machine's
#                                       own packages, runs the check, figures into $OUT
#
# With the device tool: run(command="bash scripts/gpu_check.sh run", carry=[".gpu_check"],
# timeout_s=540). Here, without a GPU: scripts/gpu_check.sh run --device cpu --smoke.
set -euo pipefail
cd "$(dirname "$0")/.."

HERE=${GPU_CHECK_DIR:-.gpu_check}
PYTHON=${PYTHON:-python3}
# What bench.gpu_check imports that the lent machine lacks; each at the version the tests here
# ran (this venv's), for the machine's Python.
CARRIED="diffusers transformers pydantic pydantic-core pydantic-settings annotated-types
typing-inspection python-dotenv redis"

case "${1:-run}" in
    prepare)
        rm -rf "$HERE" && mkdir -p "$HERE/wheels"
        .venv/bin/python -m bench.gpu_check --prepare "$HERE/models" --preset default
        pins=$(.venv/bin/python - $CARRIED <<'PY'
import importlib.metadata as metadata
import sys
print(" ".join(f"{name}=={metadata.version(name)}" for name in sys.argv[1:]))
PY
)
        # shellcheck disable=SC2086  # one word per requirement
        .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 -d "$HERE/wheels" $pins
        du -sh "$HERE"/* ;;
    run)
        shift || true
        if [ -d "$HERE/wheels" ]; then
            site=$(mktemp -d)
            "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
                "$HERE"/wheels/*.whl
            export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        fi
        models=()
        [ -d "$HERE/models" ] && models=(--models "$HERE/models")
        PYTHONUNBUFFERED=1 "$PYTHON" -m bench.gpu_check "${models[@]}" \
            ${OUT:+--out "$OUT"} "$@" ;;
    *)
        echo "usage: scripts/gpu_check.sh prepare | run [bench.gpu_check arguments]" >&2
        exit 2 ;;
esac
