#!/usr/bin/env bash
# One command on a GPU machine: the GPU tests and the GPU benchmark, JSON out.
#
#   bash bench/gpu_check.sh             # real run (needs an NVIDIA GPU + driver), < 8 minutes
#   bash bench/gpu_check.sh --dry-run   # everything that needs no GPU (run on CPU machines)
#
# Writes under $OUT if set (the device runner's output folder), else bench/results/:
#   gpu_env.txt        what was found/installed (nvidia-smi, versions)
#   gpu_tests.txt/.xml pytest tests/test_cupy_gpu.py
#   gpu-<date>.json    the benchmark records (polynorm._bench.gpu), plus its table in gpu_bench.txt
#
# Packages: a venv with --system-site-packages reuses whatever the machine has
# (cupy, CUDA torch, liger-kernel, quack).  Missing ones are pip-installed when
# an index is reachable (PIP_INDEX_URL / PN_WHEELHOUSE=<dir of wheels> for an
# offline box); anything that cannot be installed is reported and skipped, not fatal.
# Knobs: PN_GPU_VENV (default $TMPDIR/polynorm-gpu-venv), PN_GPU_TORCH=0 (do not install CUDA torch),
# PN_GPU_PEERS=0 (do not install liger-kernel / quack-kernels), PN_BENCH_BUDGET (s, default 200).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=0
for a in "$@"; do
    case "$a" in
        --dry-run) DRY=1 ;;
        *) echo "usage: bash bench/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
    esac
done

RESULTS="${OUT:-$ROOT/bench/results}"
mkdir -p "$RESULTS"
VENV="${PN_GPU_VENV:-${TMPDIR:-/tmp}/polynorm-gpu-venv}"
BUDGET="${PN_BENCH_BUDGET:-200}"
T0=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*" | tee -a "$RESULTS/gpu_env.txt"; }
: > "$RESULTS/gpu_env.txt"

# ---- environment
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV" || { log "cannot create venv $VENV"; exit 1; }
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # polynorm from this checkout, no build needed

pipi() {
    # pip install, offline-friendly; never fatal
    local extra=()
    [ -n "${PN_WHEELHOUSE:-}" ] && extra=(--find-links "$PN_WHEELHOUSE")
    timeout "${PIP_TIMEOUT:-240}" python -m pip install -q --disable-pip-version-check --retries 1 --timeout 20 \
        "${extra[@]}" "$@" \
        >>"$RESULTS/gpu_env.txt" 2>&1 && log "installed $*" || log "could not install $* (continuing)"
}
has() { python -c "import $1" >/dev/null 2>&1; }

has numpy || pipi numpy
has array_api_compat || pipi array-api-compat
has ml_dtypes || pipi ml_dtypes
has pytest || pipi pytest
has hypothesis || pipi hypothesis
has jinja2 || pipi jinja2

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L >>"$RESULTS/gpu_env.txt" 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$RESULTS/gpu_env.txt" 2>&1
else
    log "nvidia-smi not found"
fi

if [ "$DRY" = 0 ]; then
    has cupy || pipi "cupy-cuda12x>=13"
    python -c "import nvidia.cuda_runtime" >/dev/null 2>&1 || pipi nvidia-cuda-runtime-cu12
    # polynorm compiles its kernels with NVRTC (IEEE float32); without it CuPy compiles them
    has cuda.bindings.nvrtc || pipi "cuda-bindings>=12.6,<13" nvidia-cuda-nvrtc-cu12
    if [ "${PN_GPU_TORCH:-1}" = 1 ] && ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
        # PyPI's Linux torch wheel is the CUDA build; pinned as the project requires
        PIP_TIMEOUT=300 pipi "torch==2.13.0"
    fi
    if [ "${PN_GPU_PEERS:-1}" = 1 ] && python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
        has liger_kernel || PIP_TIMEOUT=120 pipi --no-deps liger-kernel
        has quack || PIP_TIMEOUT=120 pipi quack-kernels
    fi
else
    log "dry run: not installing cupy / CUDA torch / peers"
fi

python - >>"$RESULTS/gpu_env.txt" 2>&1 <<'EOF'
import importlib
for m in ("numpy", "cupy", "torch", "liger_kernel", "quack", "cuda.bindings"):
    try:
        mod = importlib.import_module(m)
        print(f"{m}: {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{m}: missing ({type(exc).__name__})")
import polynorm as pn
print("polynorm backends:", pn.backends())
EOF
log "environment ready"

# ---- tests (the GPU tests skip cleanly where there is no usable GPU)
status=0
timeout 180 python -m pytest -q -p no:cacheprovider -o addopts="" -rs \
    tests/test_cupy_gpu.py --junitxml "$RESULTS/gpu_tests.xml" >"$RESULTS/gpu_tests.txt" 2>&1 || status=$?
tail -n 5 "$RESULTS/gpu_tests.txt"
log "GPU tests exit status $status"

# ---- benchmark
stamp=$(date -u +%Y%m%dT%H%M)
if [ "$DRY" = 1 ]; then
    python bench/gpu.py --dry-run 2>&1 | tee "$RESULTS/gpu_bench.txt"
    bstatus=${PIPESTATUS[0]}
else
    timeout $(( BUDGET + 60 )) python bench/gpu.py --budget "$BUDGET" --out "$RESULTS/gpu-$stamp.json" \
        >"$RESULTS/gpu_bench.txt" 2>"$RESULTS/gpu_bench.log"
    bstatus=$?
    tail -n 30 "$RESULTS/gpu_bench.txt"
fi
log "benchmark exit status $bstatus; results in $RESULTS"
# the test status is what a caller should act on; a benchmark failure is reported too
[ "$status" = 0 ] || [ "$status" = 5 ] || exit "$status"
exit "$bstatus"
