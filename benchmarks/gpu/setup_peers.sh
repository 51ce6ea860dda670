#!/usr/bin/env bash
# Installs the peers that benchmarks/bench_peers.py times and the GPU machine lacks, offline, from the git-ignored
# carry folder (made here by benchmarks/gpu/make_carry.sh; the device tool's `run` carries it):
#   gpu_carry/wheels/*.whl, gpu_carry/sdists/*.tar.gz   omegaconf 2.3.0 (+ antlr4 4.9.3), hjson, pydantic (DeepSpeed's)
#   gpu_carry/deepspeed-0.19.8.tar.gz                   DeepSpeed's source archive; no ops prebuilt (DS_BUILD_OPS=0)
#   gpu_carry/tutel/                                    microsoft/tutel's source (git archive); its C++ extension
#                                                        tutel_custom_kernel (NVRTC, CUDA driver) is built here
# Each part is timed; one that fails leaves its peer out (bench_peers.py then prints why) and the others go on.
set -u
cd "$(dirname "$0")/../.."
CARRY="${CARRY:-gpu_carry}"
PY="${PYTHON:-python3}"
rc=0

timed() {
  local start=$SECONDS
  echo "== $*"
  "$@"
  local code=$?
  echo "-- rc=$code in $((SECONDS - start)) s"
  [ "$code" -eq 0 ] || rc=1
}

if [ ! -d "$CARRY" ]; then
  echo "no $CARRY/: DeepSpeed, omegaconf and Tutel are not installed (make it with benchmarks/gpu/make_carry.sh)"
  exit 3
fi
export DS_BUILD_OPS=0 MAX_JOBS=8
PIP=("$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check)
timed "${PIP[@]}" "$CARRY"/wheels/*.whl "$CARRY"/sdists/*.tar.gz
timed "${PIP[@]}" "$CARRY"/deepspeed-*.tar.gz
# Tutel's setup.py tries the extension with NCCL, then without NCCL (enough for one process), then without CUDA.
# Built from a fresh copy: an in-tree build/ left by an earlier build elsewhere (a CPU one) would be reused.
TUTEL_SRC="$(mktemp -d)/tutel"
cp -r "$CARRY/tutel" "$TUTEL_SRC" && rm -rf "$TUTEL_SRC/build" "$TUTEL_SRC"/*.egg-info
timed "${PIP[@]}" "$TUTEL_SRC"
timed "$PY" -c "import deepspeed, omegaconf, tutel, tutel_custom_kernel as k; \
print('deepspeed', deepspeed.__version__, 'omegaconf', omegaconf.__version__, 'tutel', tutel.__file__, \
'extension with CUDA', hasattr(k, 'inject_source'))"
exit "$rc"
