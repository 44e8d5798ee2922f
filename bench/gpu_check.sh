#!/usr/bin/env bash
# One command on a GPU machine: the GPU tests and the GPU benchmark, JSON out.
#
#   bash bench/gpu_check.sh --prepare   # HERE, where pip works: wheels the GPU box lacks -> .whl/
#   bash bench/gpu_check.sh --dry-run   # here: everything that needs no GPU
#   bash bench/gpu_check.sh --kernels   # GPU, short: environment, warm-up, host path + graph capture,
#                                       # model, tuning sweep and benchmark (no GPU tests, host profile or HF step)
#   bash bench/gpu_check.sh             # on the GPU machine, < 10 minutes (timeouts bound each step)
#
# With the device tool: run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=600)
# after `--prepare` here (the H200 image has cupy, CUDA torch, cuda-bindings, NVRTC, numpy,
# ml_dtypes, pytest, jinja2, triton -- but not array-api-compat, which polynorm needs, nor
# Liger-Kernel; nothing can be fetched there).
#
# Writes under $OUT if set (the device runner's output folder), else bench/results/:
#   gpu_env.txt         what was found / installed (nvidia-smi, versions, backends)
#   gpu_tests.txt       pytest -k "cupy and not emul": tests/test_cupy_gpu.py and the suite's cupy cases
#   gpu-<date>.json     the benchmark records (polynorm.bench.gpu); its table in gpu_bench.txt
#   gpu_overhead.txt    a small call's host time against its kernels alone, and its profile
#   host-path-<date>.json  the torch-CUDA host path: host time per call with and without launch
#   gpu_host.txt        records, torch's F.rms_norm beside it, CUDA graph capture + replay bits
#   gpu_model.txt       the launch model's prediction for every case (no GPU needed), to set
#                       beside the measured table
#   tune-<date>.json    the pn_fwd_rows launch sweep (polynorm.bench.tune: every candidate of
#   tuning/<dev>.json   each case, kernels alone) and the table it makes, also installed into
#                       this checkout's polynorm/backends/cuda/tuning/ so the benchmark uses it
#                       (commit the table from $OUT)
#   hf-gpu-<date>.json  bench/hf.py on the GPU: a tiny Llama training step, HF vs patched
#                       (where transformers imports; hf_bench.txt says why not otherwise)
#
# No virtual environment: the machine's python3 (PYTHON=...) keeps its own packages (on the
# H200 image python3 is itself a venv, which a nested venv would hide); extra wheels go to
# $PN_SITE (default $TMPDIR/polynorm-site) on PYTHONPATH, after this checkout.
# Knobs: PN_WHEELHOUSE (default .whl), PN_BENCH_BUDGET (s, default 240), PN_TUNE_BUDGET (s,
# default 90; the sweep, 84 cases (fwd, add, bwd), stops starting cases after it), PN_GPU_TORCH=1
# (pip-install torch==2.13.0 when no CUDA torch is there and an index is reachable).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

MODE=run
KERNELS_ONLY=0
for a in "$@"; do
    case "$a" in
        --dry-run) MODE=dry ;;
        --prepare) MODE=prepare ;;
        --kernels) KERNELS_ONLY=1 ;;
        *) echo "usage: bash bench/gpu_check.sh [--prepare | --dry-run | --kernels]" >&2; exit 2 ;;
    esac
done

PY="${PYTHON:-python3}"
WH="${PN_WHEELHOUSE:-$ROOT/.whl}"
SITE="${PN_SITE:-${TMPDIR:-/tmp}/polynorm-site}"
BUDGET="${PN_BENCH_BUDGET:-240}"
TUNE_BUDGET="${PN_TUNE_BUDGET:-90}"

if [ "$MODE" = prepare ]; then
    # pure-Python wheels for the GPU image's Python 3.12; .whl/ is git-ignored locally
    mkdir -p "$WH" "$ROOT/.git/info"
    grep -qxF "/.whl/" "$ROOT/.git/info/exclude" 2>/dev/null || echo "/.whl/" >>"$ROOT/.git/info/exclude"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WH" \
        "array-api-compat>=1.11" liger-kernel || { echo "pip download failed" >&2; exit 1; }
    ls -la "$WH"
    echo "now: device run(command=\"bash bench/gpu_check.sh\", carry=[\".whl\"])"
    exit 0
fi

RESULTS="${OUT:-$ROOT/bench/results}"
mkdir -p "$RESULTS"
T0=$(date +%s)
: >"$RESULTS/gpu_env.txt"
log() { echo "[gpu_check +$(($(date +%s) - T0))s] $*" | tee -a "$RESULTS/gpu_env.txt"; }

# ---- environment
if ls "$WH"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WH"/*.whl >>"$RESULTS/gpu_env.txt" 2>&1 &&
        log "installed carried wheels: $(cd "$WH" && ls ./*.whl | tr '\n' ' ')" ||
        log "could not install the carried wheels (continuing)"
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"   # polynorm from this checkout
export PYTHONUNBUFFERED=1

pipi() {  # pip install into $SITE when an index is reachable; fails fast offline; never fatal
    timeout "${PIP_TIMEOUT:-120}" "$PY" -m pip install -q --disable-pip-version-check --retries 1 \
        --timeout 15 --target "$SITE" "$@" >>"$RESULTS/gpu_env.txt" 2>&1 &&
        log "installed $*" || log "could not install $* (continuing)"
}
has() { "$PY" -c "import $1" >/dev/null 2>&1; }

has numpy || pipi numpy
has array_api_compat || pipi "array-api-compat>=1.11"
has ml_dtypes || pipi ml_dtypes
has pytest || pipi pytest

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$RESULTS/gpu_env.txt" 2>&1
else
    log "nvidia-smi not found"
fi
if [ "$MODE" = run ]; then
    has cupy || pipi "cupy-cuda12x>=13"
    # polynorm compiles its kernels with NVRTC through cuda-bindings (IEEE float32); else CuPy does
    has cuda.bindings.nvrtc || pipi "cuda-bindings>=12.6,<13" nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12
    if [ "${PN_GPU_TORCH:-0}" = 1 ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
        PIP_TIMEOUT=300 pipi "torch==2.13.0"   # PyPI's Linux wheel is the CUDA build
    fi
else
    log "dry run: not installing GPU packages"
fi

"$PY" - >>"$RESULTS/gpu_env.txt" 2>&1 <<'EOF'
import importlib, platform
print("python", platform.python_version())
for m in ("numpy", "array_api_compat", "ml_dtypes", "cupy", "torch", "triton", "liger_kernel",
          "quack", "cuda.bindings"):
    try:
        mod = importlib.import_module(m)
        print(f"{m}: {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{m}: missing ({type(exc).__name__}: {exc})")
try:
    import polynorm as pn
    from polynorm.backends.cuda import launch, nvrtc
    print("polynorm backends:", pn.backends())
    print("NVRTC:", nvrtc.available(), "headers:", launch.include_dirs())
except Exception as exc:
    print("polynorm import failed:", type(exc).__name__, exc)
EOF
log "environment ready (details in gpu_env.txt)"

# ---- the CUDA kernels compiled ahead, one NVRTC process per core (a first call compiles its
# kernel on demand, about a second each); into a fresh cache, so nothing stale is measured
export POLYNORM_CACHE_DIR="${POLYNORM_CACHE_DIR:-${TMPDIR:-/tmp}/polynorm-cache}"
if [ "$MODE" = run ]; then
    arch=$("$PY" -c "import cupy; print('sm_' + cupy.cuda.Device().compute_capability)" 2>>"$RESULTS/gpu_env.txt")
    if [ -n "$arch" ]; then
        timeout 240 "$PY" -m polynorm warmup --cuda "$arch" >>"$RESULTS/gpu_env.txt" 2>&1
        log "NVRTC warm-up for $arch exit status $?"
    fi
fi

# ---- tests (they skip cleanly where there is no usable GPU): tests/test_cupy_gpu.py and every
# case of the backend-parametrised suite that runs on the cupy backend
status=0
[ "$KERNELS_ONLY" = 1 ] && status=5 && log "--kernels: GPU tests skipped"
[ "$KERNELS_ONLY" = 1 ] || timeout 180 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rs -k "cupy and not emul" \
    tests/ >"$RESULTS/gpu_tests.txt" 2>&1 || status=$?
[ -f "$RESULTS/gpu_tests.txt" ] && tail -n 15 "$RESULTS/gpu_tests.txt"
log "GPU tests exit status $status (5: nothing collected)"

# ---- the torch-CUDA host path (launch records): host time per call against torch's F.rms_norm
# (target <= 20 us at 4096x1024 bfloat16) and fwd/add/bwd captured in a CUDA graph, replayed
# against eager bits (polynorm.bench.gpu_host)
if [ "$MODE" = dry ]; then
    "$PY" -m polynorm.bench.gpu_host --dry-run >"$RESULTS/gpu_host.txt" 2>&1
    log "host path (dry run) exit status $? (gpu_host.txt)"
else  # --kernels too: the host path and graph capture are short and the issue's acceptance
    timeout 90 "$PY" -m polynorm.bench.gpu_host --out "$RESULTS/host-path-$(date -u +%Y%m%dT%H%M).json" \
        >"$RESULTS/gpu_host.txt" 2>&1
    log "host path exit status $? (gpu_host.txt; 1: a graph replay differed or failed)"
    cat "$RESULTS/gpu_host.txt"
fi

# ---- a small call's host time against its kernels alone (bench/gpu_overhead.py)
if [ "$MODE" = run ] && [ "$KERNELS_ONLY" = 0 ]; then
    timeout 90 "$PY" bench/gpu_overhead.py --op fwd --calls 200 >"$RESULTS/gpu_overhead.txt" 2>&1
    log "host-overhead profile exit status $? (gpu_overhead.txt)"
fi

# ---- the prediction, before the measurement (pure Python: the calibrated launch model, its
# error on the committed H200 records and its prediction of every case's launches)
"$PY" -m polynorm.bench.model >"$RESULTS/gpu_model.txt" 2>&1
log "launch model exit status $? (gpu_model.txt)"

# ---- the launch sweep of pn_fwd_rows and its tuning table (before the benchmark, which then
# launches the tuned configs); JSON rewritten after every case
if [ "$MODE" = dry ]; then
    "$PY" -m polynorm.bench.tune --dry-run >"$RESULTS/gpu_tune.txt" 2>&1
    tstatus=$?
else
    timeout $((TUNE_BUDGET + 60)) "$PY" -m polynorm.bench.tune --budget "$TUNE_BUDGET" --out "$RESULTS" \
        --install >"$RESULTS/gpu_tune.txt" 2>&1
    tstatus=$?
    tail -n 30 "$RESULTS/gpu_tune.txt"
fi
log "tuning sweep exit status $tstatus (gpu_tune.txt)"

# ---- benchmark
stamp=$(date -u +%Y%m%dT%H%M)
if [ "$MODE" = dry ]; then
    "$PY" bench/gpu.py --dry-run 2>&1 | tee "$RESULTS/gpu_bench.txt"
    bstatus=${PIPESTATUS[0]}
else
    timeout $((BUDGET + 60)) "$PY" bench/gpu.py --budget "$BUDGET" --out "$RESULTS/gpu-$stamp.json" \
        >"$RESULTS/gpu_bench.txt" 2>&1
    bstatus=$?
    tail -n 40 "$RESULTS/gpu_bench.txt"
    # the model's prediction beside what was just measured
    "$PY" -m polynorm.bench.model --records "$RESULTS/gpu-$stamp.json" \
        >"$RESULTS/gpu_model_vs_run.txt" 2>&1
    log "model against this run exit status $? (gpu_model_vs_run.txt)"
fi
log "benchmark exit status $bstatus; results in $RESULTS"

# ---- Hugging Face Llama step, HF vs polynorm.torch.patch (tiny model, a few pairs)
if [ "$KERNELS_ONLY" = 1 ]; then
    log "--kernels: HF bench skipped"
elif has transformers && "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
    timeout 100 "$PY" bench/hf.py --device cuda --sizes tiny --dtype bfloat16 --pairs 5 --no-rss \
        --json "$RESULTS/hf-gpu-$stamp.json" >"$RESULTS/hf_bench.txt" 2>&1
    log "HF bench exit status $? (hf_bench.txt)"
elif [ "$MODE" = dry ] && has transformers; then
    timeout 300 "$PY" bench/hf.py --device cpu --sizes tiny --tokens 64 --pairs 1 --no-rss \
        --json "$RESULTS/hf-dry.json" >"$RESULTS/hf_bench.txt" 2>&1
    log "HF bench (dry run on the CPU) exit status $? (hf_bench.txt)"
else
    echo "transformers or a CUDA torch is missing: HF bench skipped" >"$RESULTS/hf_bench.txt"
    log "HF bench skipped (no transformers or no CUDA torch)"
fi
[ "$status" = 0 ] || [ "$status" = 5 ] || exit "$status"
exit "$bstatus"
