#!/usr/bin/env bash
# Creates ./.venv (once) with what splitserve needs to run, or with an extra of pyproject.toml on
# top (scripts/test passes `test`: pytest, the linters, lm-eval, the benchmarks' plotting...).
#   scripts/setup_env.sh [EXTRA]
# torch: where the invoking python already has torch (say a CUDA build), the venv sees it through
# --system-site-packages; otherwise the CPU wheel is installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
EXTRA="${1:-}"
STAMP="$VENV/.splitserve-installed${EXTRA:+-$EXTRA}"

# Our int4 decode kernel as a torch op (EngineConfig.int4_kernel=own), compiled once into
# ~/.cache/splitserve/kernels here, ahead of the first launch (an engine start that finds no build
# compiles it itself, once: engine_worker/int4_decode.py). The stamp records the build
# (or "none" where it cannot be built: no g++, no AVX-512 BF16, which torch's kernel then serves);
# it is redone when the kernel's sources are newer or the recorded build is gone.
KERNEL_STAMP="$VENV/.splitserve-int4-kernel"
build_kernel() {
    local built=""
    [[ -f "$KERNEL_STAMP" ]] && built="$(cat "$KERNEL_STAMP")"
    if [[ -z "$built" || ( "$built" != none && ! -f "$built" ) \
          || "$ROOT/engine_worker/int4_decode.cpp" -nt "$KERNEL_STAMP" \
          || "$ROOT/engine_worker/int4_decode_op.cpp" -nt "$KERNEL_STAMP" ]]; then
        local out
        out="$("$VENV/bin/python" -m engine_worker.int4_decode | tail -n 1)" || true
        echo "[setup] $out" >&2
        if [[ "$out" == "int4 decode op: "* ]]; then
            echo "${out#int4 decode op: }" > "$KERNEL_STAMP"
        else
            echo none > "$KERNEL_STAMP"
        fi
    fi
}

if [[ -f "$STAMP" && "$STAMP" -nt "$ROOT/pyproject.toml" ]]; then
    build_kernel
    exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    if "$PY" -c "import torch" >/dev/null 2>&1; then
        echo "[setup] using the torch already installed for $PY" >&2
        "$PY" -m venv --system-site-packages "$VENV"
    else
        "$PY" -m venv "$VENV"
    fi
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing torch (CPU wheel)" >&2
    "$VPY" -m pip install -q "torch==2.13.0" 2>/dev/null \
        || "$VPY" -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<3"
fi
echo "[setup] installing splitserve${EXTRA:+ with its $EXTRA extra}" >&2
"$VPY" -m pip install -q -e "$ROOT${EXTRA:+[$EXTRA]}"
build_kernel
touch "$STAMP" "$VENV/.splitserve-installed"  # an extra comes with what running needs
