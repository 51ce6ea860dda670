#!/usr/bin/env bash
# Makes the git-ignored gpu_carry/ that benchmarks/gpu/setup_peers.sh installs on the GPU machine (which has no
# network), on a machine that has one:
#
#     bash benchmarks/gpu/make_carry.sh
#
# gpu_carry/deepspeed-0.19.8.tar.gz: DeepSpeed's source archive from PyPI; gpu_carry/wheels/: omegaconf and
# DeepSpeed's pure-Python needs the GPU image lacks (hjson, pydantic and its parts), for CPython 3.12 x86-64;
# gpu_carry/sdists/: antlr4-python3-runtime 4.9.3 (omegaconf's; published as a source archive only).
# Tutel is fetched code, not a registry package: this script neither packs nor builds it (docs/development.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PIP_CONSTRAINT="$PWD/constraints.txt"
rm -rf gpu_carry/wheels gpu_carry/sdists gpu_carry/deepspeed-*.tar.gz
mkdir -p gpu_carry/wheels gpu_carry/sdists
python3 -m pip download -q --no-deps --no-binary :all: -d gpu_carry deepspeed==0.19.8
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d gpu_carry/wheels omegaconf==2.3.0 hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5
python3 -m pip download -q --no-deps --no-binary :all: -d gpu_carry/sdists antlr4-python3-runtime==4.9.3
du -sh gpu_carry
