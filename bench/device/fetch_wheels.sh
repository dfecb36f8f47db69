#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has no package registry), downloaded here into .whl/
# (git-ignored: `echo /.whl/ >> .git/info/exclude`) for Python 3.12 x86-64. Carry `.whl` in
# every device call; the bench/device scripts install them with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
# and put /tmp/site first on PYTHONPATH.
# What each is for: gguf (GGUF models), beartype (the tests' jaxtyping checks), absl-py (jax's
# Mosaic GPU module imports it: the Mosaic kernels), and the
# server's stack (jfp8kv.serve, bench.serving): fastapi with its imports, which the machine's
# image does not hold (fastapi 0.16x imports opentelemetry-api; starlette, pydantic,
# pydantic-core, annotated-types, typing-inspection, uvicorn). Versions: those tested here.
#   bash bench/device/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl gguf==0.19.0 beartype==0.23.1 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 \
  pydantic_core==2.50.5 uvicorn==0.54.0 annotated-types==0.8.0 typing-inspection==0.4.5 \
  opentelemetry-api==1.45.2 absl-py==2.3.1
ls -la .whl
