#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (it has torch, triton, transformers 5.17, aiohttp, uvloop; no
# package registry), downloaded here into .whl/ (ignored by git) for a device call that names
# `.whl` in `carry`: tests/bench/gpu_device_run.sh installs whatever lies there. Python 3.12, x86-64.
#   bash tests/bench/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
PIP=${PIP:-.venv/bin/python -m pip}
# the versions this checkout is tested with (CPU venv), so the GPU runs import the same code
PACKAGES="pyzmq==27.3.0 msgspec==0.23.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pyeclib==1.8.0 crc32c==2.9.post0
  transformers==5.23.0 pytest-asyncio hypothesis==6.170.27 sortedcontainers==2.4.0 pytest-timeout==2.4.0"
PLATFORMS=""
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do PLATFORMS="$PLATFORMS --platform manylinux_${n}_x86_64"; done
mkdir -p .whl
for pkg in $PACKAGES; do
  # shellcheck disable=SC2086  # word lists
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$pkg"
done
ls -la .whl
du -sh .whl
