#!/usr/bin/env bash
# One-call GPU check. On a bare GPU machine that has Python with a CUDA PyTorch and Triton (no network
# needed), from anywhere in the checkout:
#
#     bash benchmarks/gpu/run.sh          # results under $OUT (default: ./gpu-results)
#
# It installs moe_plugin from this checkout (pip --no-deps --no-index: nothing is downloaded), then runs
#   1. every CUDA test of the suite (CUDA_TESTS below), the Triton routing kernels compiled for real
#      among them, each file with -rs so a skip shows its reason;
#   2. the GPU benchmarks: the layer under bf16 autocast against a grouped_mm floor and the bare
#      bmm GEMMs, eager and compiled, with HF's Mixtral block on grouped_mm and DeepSpeed's MoE layer
#      where they import; then the HF shape again with bf16 parameters; then a small Mixtral under FSDP2,
#      swapped against HF's own blocks;
# each step with its own time limit, about 8 minutes in all (6.5 on an H100 before the FSDP2 step was added).
# Per step: $OUT/<step>.log, and one line "<step> rc=<code>" in $OUT/summary.txt; the exit code is 0 only
# when every step passed. DeepSpeed and omegaconf, where the machine lacks them, can travel as wheels
# (benchmarks/RESULTS.md, "The first GPU run", says which).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-results}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export PYTHONUNBUFFERED=1
failed=0

# the test files holding CUDA tests (tests/test_gpu_script.py checks that each exists)
CUDA_TESTS=(
  tests/ops/test_triton_kernels.py
  tests/ops/test_grouped_mm.py
  tests/ops/test_kernel_choice.py
  tests/test_mixed_precision.py
  tests/test_compile.py
)

step() {   # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/summary.txt"
  tail -n 15 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || failed=1
}

{ nvidia-smi || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  "$PY" -c "import triton; print('triton', triton.__version__)" || true
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

step install 120 "$PY" -m pip install --no-deps --no-index --no-build-isolation --use-pep517 -e .
# the Triton interpreter run is the CPU check of the same kernels (CI runs it); here they run compiled
step cuda_tests 300 "$PY" -m pytest -q -rs -p no:cacheprovider "${CUDA_TESTS[@]}" \
  --deselect tests/ops/test_triton_kernels.py::test_interpreter_run

BENCH=("$PY" -m moe_plugin.cli bench --device cuda --autocast bf16 --rounds 10 --warmup 3 --skip einsum --compile)
step bench_default 90 "${BENCH[@]}" --json
BENCH_HF_SHAPE=(--hf --activation swiglu --no-bias --capacity-factor 0 --model-dim 2048 --hidden-size 1408 \
  --num-experts 64 --top-k 6 --tokens 16384 --json)
step bench_hf_shape 180 "${BENCH[@]}" "${BENCH_HF_SHAPE[@]}"
# the same with bf16 parameters and no autocast: no weight casts in any candidate (HF's block runs its own path)
step bench_hf_shape_bf16 150 "$PY" -m moe_plugin.cli bench --device cuda --dtype bf16 --rounds 10 --warmup 3 \
  --skip einsum "${BENCH_HF_SHAPE[@]}"
# FSDP2 on this one GPU: swapped vs HF's own blocks under the same sharding (bf16 mixed precision)
step fsdp_swapped_vs_hf 120 "$PY" benchmarks/bench_fsdp.py --worlds --hf --device cuda --hf-world 1 --bf16 \
  --hf-model mixtral_gpu --steps 10
exit "$failed"
