#!/usr/bin/env bash
# One device call: GPU tests of the engine, decode-vs-floor, and a small serving matrix.
# Usage (on the GPU machine, repo root): OUT=/some/dir bash bench/device/gpu_suite.sh
# Each stage writes under $OUT and is bounded in time; a failing stage does not stop the rest.
set -u
OUT=${OUT:-/tmp/jfp8kv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
stage() { local name=$1 limit=$2; shift 2; echo "=== $name (<= ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"; }
stage gpu-e2e 170 python3 -m pytest -q -m gpu tests/engine/test_gpu_e2e.py -k "not mla_engine" -p no:cacheprovider  # MLA: gpu_offline.sh mla-tests
stage floor 120 python3 -m bench.decode_floor --model random:qwen3-8b --batch 64 --context 8192 \
  --configs "bfloat16:,fp8_e4m3:channel,fp8_e4m3:token" --out "$OUT/decode-floor-h200.json"
stage serving ${SERVING_LIMIT:-260} python3 -m bench.serving.matrix --shapes random:qwen3-0.6b \
  --kv bfloat16,fp8_e4m3 --workloads 2048:128:32:64,8192:128:16:32 --warmup off --max-num-batched-tokens 8192 \
  --kv-cache-memory 16000000000 --floor "$OUT/decode-floor-h200.json" --log-dir "$OUT" \
  --out "$OUT/serving-h200.json"
ls -la "$OUT"
