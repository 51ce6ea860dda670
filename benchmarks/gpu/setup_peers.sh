#!/usr/bin/env bash
# Installs the peers that benchmarks/bench_peers.py times and the GPU machine lacks, offline, from the git-ignored
# carry folder (made here by benchmarks/gpu/make_carry.sh; the device tool's `run` carries it):
#   gpu_carry/wheels/*.whl, gpu_carry/sdists/*.tar.gz   omegaconf 2.3.0 (+ antlr4 4.9.3), hjson, pydantic (DeepSpeed's)
#   gpu_carry/deepspeed-0.19.8.tar.gz                   DeepSpeed's source archive; no ops prebuilt (DS_BUILD_OPS=0)
# Tutel is fetched code: it is built on that machine by a command typed into the session's `run`, not here
# (docs/development.md); bench_peers.py times it where it is installed.
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
  echo "no $CARRY/: DeepSpeed and omegaconf are not installed (make it with benchmarks/gpu/make_carry.sh)"
  exit 3
fi
export DS_BUILD_OPS=0 MAX_JOBS=8
PIP=("$PY" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check)
timed "${PIP[@]}" "$CARRY"/wheels/*.whl "$CARRY"/sdists/*.tar.gz
timed "${PIP[@]}" "$CARRY"/deepspeed-*.tar.gz
timed "$PY" -c "import deepspeed, omegaconf; print('deepspeed', deepspeed.__version__, 'omegaconf', \
omegaconf.__version__)"
exit "$rc"
