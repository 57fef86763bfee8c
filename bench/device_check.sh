#!/usr/bin/env bash
# One GPU-machine check, under 8 minutes: the GPU kernel benchmarks (H200 targets first), the GPU
# test tier (pytest -m gpu), a model benchmark, and a summary table with the targets' pass/fail.
#
#   bench/device_check.sh            on the GPU machine (from the repository root or anywhere)
#   bench/device_check.sh --dry-run  the same steps on a CPU at tiny sizes (Triton under its
#                                    interpreter): checks the script before first GPU contact
#
# Writes to $OUT if set, else bench/out/device_check/ (6 files: summary.md, device_check.log,
# kernels_linear.csv, kernels_moe.csv, model_moe.csv, model_moe.png). Nothing is downloaded: the
# machine's torch/triton are used (torch 2.11 / triton 3.6 on the H200 image), quantpass is imported
# from this checkout, and wheels in .whl/ (torchao, which the image lacks: bench/README.md) are
# installed with pip --no-index into a private folder put on PYTHONPATH.
set -u
cd "$(dirname "$0")/.."

DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
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
    local start
    start=$(wc -l <"$LOG")
    timeout --kill-after=10 "$cap" "$@" >>"$LOG" 2>&1
    local status=$?
    local tail_line
    tail_line=$(tail -n +$((start + 1)) "$LOG" | grep -E " (passed|failed|error)| in [0-9.]+s|^wrote" | tail -1)
    echo "| $name | $status$([ $status = 124 ] && echo ' (time cap)') | ${cap}s | ${tail_line//|/\\|} |" >>"$STEPS"
    log "step $name: exit $status"
}

# -- environment -----------------------------------------------------------------------------------
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

if [ $DRY_RUN = 1 ]; then  # tiny shapes; the interpreter takes ~1 s per MoE call: one round each
    SUITE=(--bench-suite tiny --bench-triton-interpret --bench-threads 1 --benchmark-max-time=0.05 --benchmark-min-rounds=1)
    MODEL=(--device cpu --threads 1 --formats int8_weight_only,fp8_per_channel --prompt-length 8 --new-tokens 2)
else
    SUITE=(--bench-suite gpu-quick --benchmark-max-time=0.2 --benchmark-min-rounds=5)
    MODEL=(--device cuda --formats fp8_per_channel,int4_weight_only)
fi
BENCH=(-m pytest -q -rs -p no:cacheprovider --benchmark-only --benchmark-group-by=group
    --benchmark-columns=min,median,rounds "${SUITE[@]}")

# -- steps: ~460 s of caps in all (the device tool's per-command limit is 600 s) --------------------
step linear-bench 160 $PYTHON "${BENCH[@]}" bench/test_bench_linear.py --bench-csv "$OUT_DIR/kernels_linear.csv"
step moe-bench 100 $PYTHON "${BENCH[@]}" bench/test_bench_moe.py --bench-csv "$OUT_DIR/kernels_moe.csv"
step gpu-tests 115 $PYTHON -m pytest tests -q -rs -m gpu -p no:cacheprovider
step model-bench 75 $PYTHON bench/model_bench.py --model moe "${MODEL[@]}" --compile-formats "" --out "$OUT_DIR"

# -- summary -------------------------------------------------------------------------------------
SUMMARY="$OUT_DIR/summary.md"
$PYTHON bench/summary.py "$OUT_DIR/kernels_linear.csv" "$OUT_DIR/kernels_moe.csv" --out "$SUMMARY" >/dev/null 2>>"$LOG" ||
    echo "summary.py failed: see device_check.log" >"$SUMMARY"
{
    echo
    echo "## Steps ($(date -u +%Y-%m-%dT%H:%MZ), ${SECONDS}s in all$([ $DRY_RUN = 1 ] && echo ', DRY RUN on CPU'))"
    echo
    echo "| step | exit | cap | last result line |"
    echo "| --- | --- | --- | --- |"
    cat "$STEPS"
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
