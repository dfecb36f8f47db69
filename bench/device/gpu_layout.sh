#!/usr/bin/env bash
# The memory plan on the GPU with default flags: the long and wide requests that ran out of
# memory before the pool was sized by measuring the step, each with the start-up plan line
# and the allocator's peak beside the reserve (bench.common.reserve_check).
# Usage (GPU machine, repo root, .whl carried): OUT=/some/dir STAGES="hybrid" bash bench/device/gpu_layout.sh
#   hybrid  random:qwen3.6-35b-a3b, one 131,072-token request through the server, fp8 cache
#   dense   Qwen3-8B's shape, 16 prompts of ~32k at --max-model-len 32768 (bench.offline)
#   v4      random:deepseek-v4-flash-4l at its defaults, one 4,096-token request
# No XLA_PYTHON_CLIENT_MEM_FRACTION is set for the server: it claims --gpu-memory-utilization
# (0.9) itself. bench.offline builds its LLM after measuring the card's rates (JAX starts
# first), so that stage sets the fraction the server would.
set -u
OUT=${OUT:-/tmp/jfp8kv-out}; mkdir -p "$OUT"
STAGES=${STAGES:-"hybrid dense v4"}
# JFP8KV_CACHE may name a folder kept between calls on a warm machine (an ignored path)
export PYTHONUNBUFFERED=1 JFP8KV_CACHE=${JFP8KV_CACHE:-/tmp/jfp8kv-cache}
unset XLA_PYTHON_CLIENT_MEM_FRACTION
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
run() { local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return;; esac
  echo "=== $name (<= ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 12 "$OUT/$name.log"; echo "=== $name rc=$rc in $((SECONDS - t0))s"; }
run hybrid ${HYBRID_LIMIT:-540} python3 -m bench.long_request --model random:qwen3.6-35b-a3b \
  --prompt-tokens 131072 --max-tokens 64 --startup-timeout ${HYBRID_STARTUP:-420} --request-timeout 300 \
  --log-dir "$OUT" --out "$OUT/long-hybrid-131k-default.json" -- --kv-cache-dtype fp8_e4m3 \
  --log-level info
run dense ${DENSE_LIMIT:-300} env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 -m bench.offline \
  --model random:qwen3-8b --num-prompts 16 --input-len 32704 --output-len 64 \
  --max-model-len 32768 --kv-cache-dtype fp8 --warmup off --out "$OUT/offline-8b-32k-default.json"
run v4 ${V4_LIMIT:-420} python3 -m bench.long_request --model random:deepseek-v4-flash-4l \
  --prompt-tokens 4096 --max-tokens 64 --startup-timeout 360 --request-timeout 200 \
  --log-dir "$OUT" --out "$OUT/long-v4-default.json" -- --kv-cache-dtype fp8_e4m3 --log-level info
grep -h "memory plan\|max_num_batched_tokens\|max_num_seqs\|max_model_len .*->\|KV cache:" \
  "$OUT"/soak-server-*.log "$OUT"/*.log 2>/dev/null | sort -u | head -20
