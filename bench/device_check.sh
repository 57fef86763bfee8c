#!/usr/bin/env bash
# One GPU-machine check in ~7.3 minutes including install (budget per step: bench/README.md): a
# preflight, the Triton cache warmed in parallel, the H200 targets' benchmarks, the GPU tests at
# K = 8192 (FP8 row, block, MoE FP8), the other benchmark rows, the rest of the GPU test tier, a
# memory row, a model benchmark, and summary.md with every target and every row's accuracy PASS/FAIL.
#
#   bench/device_check.sh             on the GPU machine (from the repository root or anywhere)
#   bench/device_check.sh --tune-moe  only the fused-MoE tuning sweep for the target shape (a run of
#                                     its own: ~4 minutes; writes the config file into $OUT)
#   bench/device_check.sh --dry-run   the same steps on a CPU at tiny sizes (Triton under its
#                                     interpreter): checks the script before first GPU contact
#
# Writes to $OUT if set, else bench/out/device_check/: summary.md, device_check.log, kernels.csv,
# model_moe.csv, model_moe.png (and the tuned config file with --tune-moe). Nothing is downloaded:
# the machine's torch/triton are used (torch 2.11 / triton 3.6 on the H200 image), quantpass is
# imported from this checkout, and wheels in .whl/ (torchao, which the image lacks: bench/README.md)
# are installed with pip --no-index into a private folder put on PYTHONPATH.
set -u
cd "$(dirname "$0")/.."

DRY_RUN=0
TUNE_MOE=0
for arg in "$@"; do
    case $arg in
    --dry-run) DRY_RUN=1 ;;
    --tune-moe) TUNE_MOE=1 ;;
    *)
        echo "usage: bench/device_check.sh [--dry-run] [--tune-moe]"
        exit 2
        ;;
    esac
done
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-bench/out/device_check}
SITE=/tmp/quantpass_device_site
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/device_check.log"
STEPS="$OUT_DIR/steps.txt"
: >"$LOG"
: >"$STEPS"

log() { echo "[device_check +${SECONDS}s] $*" | tee -a "$LOG"; }

# step NAME SECONDS CMD...: run CMD with a time cap, its output appended to the log; the exit status
# (124 = stopped at the cap) goes into the summary. A failed step does not stop the others.
step() {
    local name=$1 cap=$2
    shift 2
    log "step $name (cap ${cap}s): $*"
    local start began=$SECONDS
    start=$(wc -l <"$LOG")
    timeout --kill-after=10 "$cap" "$@" >>"$LOG" 2>&1
    local status=$?
    local tail_line
    tail_line=$(tail -n +$((start + 1)) "$LOG" | grep -E "[0-9]+ (passed|failed|errors?|skipped)|^wrote|^memory:|: [0-9]+ failed$" | tail -1)
    echo "| $name | $status$([ $status = 124 ] && echo ' (time cap)') | $((SECONDS - began))s of ${cap}s | ${tail_line//|/\\|} |" >>"$STEPS"
    log "step $name: exit $status"
}

# -- install (~20 s) ---------------------------------------------------------------------------------
if ls .whl/*.whl >/dev/null 2>&1; then
    log "installing $(ls .whl/*.whl | wc -l) wheel(s) from .whl/ into $SITE"
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >>"$LOG" 2>&1 ||
        log "WARNING: wheel install failed (see log)"
fi
# quantpass from this checkout; its dist-info (entry points: backend="quantpass") from a local build.
$PYTHON -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . >>"$LOG" 2>&1 ||
    log "WARNING: could not build quantpass's dist-info (backend=\"quantpass\" by name will not resolve)"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# -- preflight (seconds): one line and stop if what the steps need is missing --------------------------
$PYTHON - >>"$LOG" 2>&1 <<'EOF'
import importlib.util, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA)")
for lib in ("triton", "torchao", "flashinfer", "pytest_benchmark", "transformers", "matplotlib"):
    spec = importlib.util.find_spec(lib)
    version = getattr(__import__(lib), "__version__", "?") if spec else "MISSING"
    print(f"{lib}: {version}")
EOF
grep -E "^(python|device|triton|torchao|flashinfer|pytest_benchmark|transformers|matplotlib)" "$LOG"
MISSING=$($PYTHON -c "
import importlib.util
need = ['pytest', 'pytest_benchmark', 'torchao', 'triton', 'transformers']
print(' '.join(n for n in need if importlib.util.find_spec(n) is None))" 2>&1)
if [ -n "$MISSING" ]; then
    log "PREFLIGHT FAILED: missing $MISSING (carry wheels in .whl/, bench/README.md \"GPU device check\")"
    exit 2
fi
if [ $DRY_RUN = 0 ] && ! $PYTHON -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    log "PREFLIGHT FAILED: no CUDA device (use --dry-run on a CPU)"
    exit 2
fi

if [ $TUNE_MOE = 1 ]; then # the optional sweep, on its own
    TUNE=(--experts 64 --top-k 8 --hidden 4096 --intermediate 1536 --format fp8_per_channel --out "$OUT_DIR")
    step tune-moe 250 $PYTHON -m quantpass.kernels.triton.tune_moe "${TUNE[@]}" --budget-s 220
    cat "$STEPS"
    rm -f "$STEPS"
    exit 0
fi

JOBS=$(($(nproc) < 16 ? $(nproc) : 16))
if [ $DRY_RUN = 1 ]; then # tiny shapes; the interpreter takes ~1 s per MoE call: one round each
    SUITE=(--bench-suite tiny --bench-triton-interpret --bench-threads 1 --benchmark-max-time=0.05 --benchmark-min-rounds=1)
    MODEL=(--device cpu --threads 1 --formats int8_weight_only,fp8_per_channel --prompt-length 8 --new-tokens 2)
    WARM=(--suite tiny --sm 90 --quick --jobs 2)
    # this repository's 2-core CPU is shared: generous caps (they say nothing about the GPU budget)
    CAPS=(warm=480 targets=420 gpu-tests-first=120 bench-rest=300 gpu-tests=120 memory=240 model-bench=480)
else
    SUITE=(--bench-suite gpu-quick --benchmark-max-time=0.2 --benchmark-min-rounds=5)
    MODEL=(--device cuda --formats fp8_per_channel,int4_weight_only)
    WARM=(--suite gpu-quick --device cuda --jobs "$JOBS")
    CAPS=(warm=60 targets=60 gpu-tests-first=40 bench-rest=110 gpu-tests=60 memory=35 model-bench=45)
fi
cap() { for entry in "${CAPS[@]}"; do [ "${entry%%=*}" = "$1" ] && echo "${entry#*=}"; done; }
BENCH=(-m pytest -q -rs -p no:cacheprovider --benchmark-only --benchmark-group-by=group
    --benchmark-columns=min,median,rounds "${SUITE[@]}" bench/test_bench_linear.py bench/test_bench_moe.py)
CSV="$OUT_DIR/kernels.csv"

# -- steps: the targets' rows first, so a run cut short still has them --------------------------------
step warm "$(cap warm)" $PYTHON tests/triton_aot.py "${WARM[@]}"
step targets "$(cap targets)" $PYTHON "${BENCH[@]}" --bench-rows targets --bench-csv "$CSV"
step gpu-tests-first "$(cap gpu-tests-first)" $PYTHON -m pytest tests -q -rs -m gpu -k long_k -p no:cacheprovider
step bench-rest "$(cap bench-rest)" $PYTHON "${BENCH[@]}" --bench-rows rest --bench-append --bench-csv "$CSV"
step gpu-tests "$(cap gpu-tests)" $PYTHON -m pytest tests -q -rs -m gpu -k "not long_k" -p no:cacheprovider
step memory "$(cap memory)" $PYTHON bench/memory_check.py --format fp8_per_channel
step model-bench "$(cap model-bench)" $PYTHON bench/model_bench.py --model moe "${MODEL[@]}" --compile-formats "" --out "$OUT_DIR"

# -- summary -------------------------------------------------------------------------------------
SUMMARY="$OUT_DIR/summary.md"
$PYTHON bench/summary.py "$CSV" --out "$SUMMARY" >/dev/null 2>>"$LOG" ||
    echo "summary.py failed: see device_check.log" >"$SUMMARY"
{
    echo
    echo "## Steps ($(date -u +%Y-%m-%dT%H:%MZ), ${SECONDS}s in all$([ $DRY_RUN = 1 ] && echo ', DRY RUN on CPU'))"
    echo
    echo "| step | exit | took | last result line |"
    echo "| --- | --- | --- | --- |"
    cat "$STEPS"
    echo
    echo "## Memory (an 8-bit format vs unquantized, after compiling)"
    echo
    echo '```'
    grep -E "^memory" "$LOG" || echo "no memory row (see device_check.log)"
    echo '```'
    echo
    echo "## Model benchmark (moe preset)"
    echo
    echo '```'
    sed -n '/^format /,/^wrote/p' "$LOG"
    echo '```'
} >>"$SUMMARY"
rm -f "$STEPS"
log "summary: $SUMMARY"
cat "$SUMMARY"
