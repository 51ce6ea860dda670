#!/usr/bin/env bash
# One-call GPU check of issues 33 and 34. On a bare GPU machine with Python, a CUDA PyTorch, Triton, nvcc and
# transformers (no network needed), from anywhere in the checkout:
#
#     bash benchmarks/gpu/run.sh              # the fast set: at most 6 minutes (the sum of its steps' limits)
#     bash benchmarks/gpu/run.sh --slow-only  # the slow benchmarks alone, a later call (at most 7 minutes)
#     bash benchmarks/gpu/run.sh --tests      # every CUDA test file alone, a later call (at most 6 minutes)
#     bash benchmarks/gpu/run.sh --full       # all three (longer than one 10-minute device call: not for the tool)
#
# Results under $RESULTS (default ./gpu-results, git-ignored): per step <step>.log and a line "<step> rc=<code>"
# in summary.txt; the scripts' JSON; last, ONE table of every target of issues 33 and 34 (benchmarks/gpu/summary.py,
# also in summary_table.txt). Where $OUT is set (the device tool's folder that comes back, at most 8 files), they
# are packed into $OUT/gpu-results.tgz, the table beside it. The exit code is 0 only when every step passed.
#
# Every set first installs this checkout (pip -e, no dependencies, offline). The fast set: peers_setup in the
# background (benchmarks/gpu/setup_peers.sh: DeepSpeed and omegaconf from the git-ignored gpu_carry/; Tutel, fetched
# code, is built there by a command typed into the session's call, docs/development.md); launches_graphs (profiler
# launch counts against the budgets, host time, CUDA-graph replays against eager); fp8_probe; fsdp_mixtral_gpu
# (FSDP2, swapped vs HF's own); first_runs (moe-plugin train on cuda and the DeepSpeed example, each checked);
# peers (bench_peers.py at the default, HF and SonicMoE shapes: ours eager and graphed, the floors, HF, DeepSpeed,
# Tutel where installed, fairseq-style einsum). The slow benchmarks: the fused grouped GEMMs against today's passes
# (fused_kernels.py), fsdp_fine_gpu, fsdp_mixtral_gpu_compiled (decoder layers compiled on both sides),
# torch.compile(mode="reduce-overhead") against eager, torch.compile'd ours at the HF and SonicMoE shapes, profiler
# tables at those two shapes. The tests: every CUDA test file (in 4 worker
# processes), the Triton kernels compiled; compile_amp_check (torch.compile with fp32 expert weights under
# autocast, per gradient).
# tests/test_gpu_script.py checks this file: every file it names exists, every step has a limit, the fast set's
# limits sum to at most 360 s with the background step inside the foreground steps before its wait, and the
# other sets' to at most 420 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=fast
case "${1:-}" in
  "") ;;
  --full) MODE=full ;;
  --slow-only) MODE=slow ;;
  --tests) MODE=tests ;;
  *) echo "usage: bash benchmarks/gpu/run.sh [--slow-only | --tests | --full]" >&2; exit 2 ;;
esac
wants() { [[ " $* " == *" $MODE "* ]]; }   # wants MODE...: this run's mode is one of them
RESULTS="${RESULTS:-$PWD/gpu-results}"
PY="${PYTHON:-python3}"
mkdir -p "$RESULTS"
# a warm machine keeps an earlier run's files
rm -f "$RESULTS"/*.log "$RESULTS"/*.json "$RESULTS"/*.txt "$RESULTS"/*.tgz
: > "$RESULTS/summary.txt"
pack() {
  if [ -n "${OUT:-}" ] && [ "$OUT" != "$RESULTS" ]; then
    mkdir -p "$OUT"
    tar czf "$OUT/gpu-results.tgz" -C "$RESULTS" .
    [ ! -f "$RESULTS/summary_table.txt" ] || cp "$RESULTS/summary_table.txt" "$OUT/"
  fi
}
trap pack EXIT
export PYTHONUNBUFFERED=1
failed=0

# the test files holding CUDA tests (tests/test_gpu_script.py checks that each exists)
CUDA_TESTS=(
  tests/ops/test_triton_kernels.py
  tests/ops/test_triton_grouped.py
  tests/ops/test_grouped_mm.py
  tests/ops/test_kernel_choice.py
  tests/core/test_mixed_precision.py
  tests/core/test_compile.py
  tests/core/test_cuda_graph_ready.py
  tests/one_process/test_node_cuda.py
  tests/core/test_recompute.py
  tests/train/test_train_window.py
  tests/parallel/test_global_balance_loss_cuda.py
)

step() {   # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name (limit ${limit} s): $*"
  timeout -k 10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" >> "$RESULTS/summary.txt"
  echo "-- $name rc=$rc in $((SECONDS - start)) s"
  [ "$name" = summary ] || tail -n 8 "$RESULTS/$name.log"    # the summary's table is printed whole, last
  [ "$rc" -eq 0 ] || failed=1
}

background() {   # background NAME SECONDS COMMAND...: started now, awaited by await_background
  local name=$1 limit=$2
  shift 2
  echo "== $name (background, limit ${limit} s): $*"
  ( timeout -k 10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1; echo "$name rc=$?" >> "$RESULTS/summary.txt" ) &
  BG_PID=$!
}

await_background() {
  wait "$BG_PID"
  tail -n 8 "$RESULTS/$1.log"
  grep -q "^$1 rc=0$" "$RESULTS/summary.txt" || failed=1
}

step environment 15 bash -c "nvidia-smi; $PY -c \"import torch, triton; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__)\""
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "run.sh measures on a GPU: torch sees no CUDA device here, so nothing was run (exit 3)" \
    | tee "$RESULTS/no_gpu.txt"
  exit 3
fi

if wants fast full; then
  background peers_setup 120 bash benchmarks/gpu/setup_peers.sh
fi
# every mode: moe_plugin.integrations lives in integrations/ (setup.py's package_dir), so PYTHONPATH alone does not
# import it; some tests run the installed command
step install 35 "$PY" -m pip install --no-deps --no-index --no-build-isolation --use-pep517 -e .

if wants fast full; then
  step launches_graphs 40 "$PY" benchmarks/gpu/launches_graphs.py --json "$RESULTS/launches_graphs.json"
  step fp8_probe 20 "$PY" benchmarks/gpu/fp8_probe.py --json "$RESULTS/fp8.json"
  # FSDP2 on this one GPU: swapped vs HF's own blocks under the same sharding (bf16 mixed precision)
  step fsdp_mixtral_gpu 60 "$PY" benchmarks/bench_fsdp.py --worlds --hf --device cuda --hf-world 1 --bf16 \
    --hf-model mixtral_gpu --steps 10
  await_background peers_setup
  # moe-plugin train on cuda and the DeepSpeed example in bf16, each checked (the users' first GPU runs)
  step first_runs 75 bash benchmarks/gpu/first_runs.sh
  step peers 100 "$PY" benchmarks/bench_peers.py --device cuda --shapes default,hf,sonic --rounds 7 --warmup 2 \
    --json "$RESULTS/peers.json"
fi

if wants tests full; then
  # the Triton interpreter run is the CPU check of the same kernels (CI runs it); here they run compiled
  step cuda_tests 240 "$PY" -m pytest -q -rs -p no:cacheprovider -n 4 --dist loadfile "${CUDA_TESTS[@]}" \
    --deselect tests/ops/test_triton_kernels.py::test_interpreter_run \
    --deselect tests/ops/test_triton_grouped.py::test_interpreter_run \
    --deselect tests/one_process/test_node_cuda.py::test_interpreter_run
  # torch.compile with fp32 expert weights under bf16 autocast: each variant's gradients against eager
  step compile_amp_check 90 "$PY" benchmarks/gpu/compile_amp_check.py --json "$RESULTS/compile_amp.json"
fi

if wants slow full; then
  # the fused grouped GEMMs (gather_up, dgrad_swiglu, wgrad_gather) against what each replaces, at the three shapes
  step fused_kernels 45 "$PY" benchmarks/gpu/fused_kernels.py --rounds 7 --json "$RESULTS/fused_kernels.json"
  step fsdp_fine_gpu 60 "$PY" benchmarks/bench_fsdp.py --worlds --hf --device cuda --hf-world 1 --bf16 \
    --hf-model fine_gpu --steps 10
  # the same with each decoder layer torch.compile'd on both sides
  step fsdp_mixtral_gpu_compiled 55 "$PY" benchmarks/bench_fsdp.py --worlds --hf --device cuda --hf-world 1 --bf16 \
    --hf-model mixtral_gpu --steps 6 --compile
  step graphs_compiled 60 "$PY" benchmarks/gpu/launches_graphs.py --compile --json "$RESULTS/graphs_compiled.json"
  step peers_compiled 90 "$PY" benchmarks/bench_peers.py --device cuda --shapes hf,sonic --compile --rounds 5 \
    --warmup 2 --only moe_plugin,moe_plugin_compiled,floor_gated --json "$RESULTS/peers_compiled.json"
  step profile_hf_shape 25 "$PY" benchmarks/gpu/profile_layer.py --dtype bf16 --activation swiglu --no-bias \
    --capacity-factor 0 --model-dim 2048 --hidden-size 1408 --num-experts 64 --top-k 6 --tokens 16384
  # SonicMoE's shape: the layer at 2.12x its gated floor on the H200 (2026-11-28), where the HF shape is 1.16x
  step profile_sonic_shape 30 "$PY" benchmarks/gpu/profile_layer.py --dtype bf16 --activation swiglu --no-bias \
    --capacity-factor 0 --model-dim 1536 --hidden-size 256 --num-experts 128 --top-k 8 --tokens 24576
fi

step summary 5 "$PY" benchmarks/gpu/summary.py "$RESULTS"
cp "$RESULTS/summary.log" "$RESULTS/summary_table.txt"
cat "$RESULTS/summary_table.txt"
exit "$failed"
