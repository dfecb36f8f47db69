#!/usr/bin/env bash
# One device call: the GPU tests, then offline throughput against the ideal time
# (bench.offline) on Qwen3-0.6B's and Qwen3-8B's shapes, bf16 vs fp8 in one invocation each.
# Usage (on the GPU machine, repo root): OUT=/some/dir bash bench/device/gpu_offline.sh
# STAGES (default "tests small large") picks stages; each is bounded in time and a failing
# stage does not stop the rest. Results: $OUT/offline-h200.json (+ .png), $OUT/*.log.
set -u
OUT=${OUT:-/tmp/jfp8kv-out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests small large"}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 JFP8KV_CACHE=/tmp/jfp8kv-cache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
stage() { local name=$1 limit=$2; shift 2; case " $STAGES " in *" $name "*) ;; *) return;; esac
  echo "=== $name (<= ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 25; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"; }
json="$OUT/offline-h200.json"
stage tests ${TESTS_LIMIT:-200} python3 -m pytest -q -m gpu tests/kernels tests/engine/test_gpu_e2e.py \
  -p no:cacheprovider
stage small ${SMALL_LIMIT:-150} python3 -m bench.offline --model random:qwen3-0.6b --num-prompts 32 \
  --input-len 512 --output-len 128 --kv-cache-dtype bfloat16,fp8 --out "$json" --append
stage large ${LARGE_LIMIT:-240} python3 -m bench.offline --model random:qwen3-8b --num-prompts 64 \
  --input-len 4096 --output-len 256 --kv-cache-dtype bfloat16,fp8 --out "$json" --append
stage capacity ${CAP_LIMIT:-240} python3 -m bench.offline --model random:qwen3-8b --num-prompts 96 \
  --input-len 4096 --output-len 256 --kv-cache-memory 16e9 --kv-cache-dtype bfloat16,fp8 \
  --out "$json" --append
[ -f "$json" ] && python3 -m bench.offline --plot-only "$json" >/dev/null 2>&1
ls -la "$OUT"
