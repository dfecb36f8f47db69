#!/usr/bin/env bash
# One device call (stages sum to <= 540 s): Qwen3-8B's shape through the real server
# (python -m jfp8kv.serve), bf16 vs fp8_e4m3 (default scale mode), then the outside peer
# (transformers generate with a static cache). Issue #6.
#
# Usage (GPU machine, repo root, .whl/ carried):  OUT=/some/dir bash bench/device/gpu_serving.sh
# Writes to $OUT (four files): serving-h200-8b.json (runs, rewritten after every run),
# peer-hf.json (peer records, rewritten after every config), stages.txt (stage rc and time),
# logs.tar.gz (stage, server and client logs). Merge afterwards, on any machine:
#   python -m bench.serving.merge OUT/serving-h200-8b.json OUT/peer-hf.json
#   python -m bench.serving.plot
#
# Every knob is an environment variable (defaults: the issue #6 subset for one H200); the CPU
# smoke test sets SHAPE=random:qwen3-tiny and tiny WORKLOADS. Workloads are
# IN:OUT:CONC:N[:WARM_N[:WARM_OUT]] in priority order (see bench/serving/matrix.py): the first
# one compiles most buckets in its warm-up and is the KV-bound ITL case; later ones reuse them.
set -u
OUT=${OUT:-/tmp/jfp8kv-out}; mkdir -p "$OUT"
LOGS=${LOGS:-/tmp/jfp8kv-logs}; rm -rf "$LOGS"; mkdir -p "$LOGS"
PY=${PY:-python3}
SHAPE=${SHAPE:-random:qwen3-8b}
WORKLOADS=${WORKLOADS:-8192:1024:32:32:32,8192:128:1:4:1,8192:128:8:8:4,32768:128:1:4:0,512:128:1:4:1,2048:1024:64:64,512:128:64:64,8192:128:32:32:0}
KV_MEM=${KV_MEM:-46000000000}        # same pool bytes for both dtypes; bf16 needs 43.6 GB at 8192:1024 x 32
MEM_FRACTION=${MEM_FRACTION:-0.47}   # per server: two servers share the GPU (weights 16.4 GB each)
BUDGET_TOKENS=${BUDGET_TOKENS:-8192} # --max-num-batched-tokens, as the earlier server runs
SERVING_LIMIT=${SERVING_LIMIT:-385}
PEER_LIMIT=${PEER_LIMIT:-130}
PEER_SHAPES=${PEER_SHAPES:-qwen3-8b,qwen3-0.6b}
PEER_CONFIGS=${PEER_CONFIGS:-8x512,1x512,8x2048}
PEER_OUT_LEN=${PEER_OUT_LEN:-128}
TOKEN_RANGE=${TOKEN_RANGE:-1000 30000}
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
T0=$SECONDS
: > "$OUT/stages.txt"
stage() { local name=$1 limit=$2; shift 2; echo "=== $name (<= ${limit}s) at $((SECONDS - T0))s"
  local t0=$SECONDS; timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  tail -n 40 "$LOGS/$name.log"
  echo "$name rc=$rc in $((SECONDS - t0))s (limit ${limit}s)" | tee -a "$OUT/stages.txt"; }
kill_servers() {  # only the server processes this script's harness started, if still running
  for pid in $(cat "$LOGS/server.pids" 2>/dev/null); do
    if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q "jfp8kv.serve"; then
      echo "killing leftover server $pid"; kill -9 "$pid"; fi; done; }

SITE=""; SITE_DIR=${SITE_DIR:-/tmp/site}
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE_DIR" .whl/*.whl > "$LOGS/pip.log" 2>&1 && SITE=$SITE_DIR:
fi
(nvidia-smi || true) > "$LOGS/nvidia-smi.txt" 2>&1
echo "setup in $((SECONDS - T0))s" | tee -a "$OUT/stages.txt"

PYTHONPATH=$SITE$PWD stage serving "$SERVING_LIMIT" $PY -m bench.serving.matrix --shapes "$SHAPE" \
  --kv bfloat16,fp8_e4m3 --parallel-servers --mem-fraction "$MEM_FRACTION" \
  --kv-cache-memory "$KV_MEM" --max-num-batched-tokens "$BUDGET_TOKENS" --workloads "$WORKLOADS" \
  --deadline-s $((SERVING_LIMIT - 20)) --run-timeout 150 --token-id-range $TOKEN_RANGE \
  --log-dir "$LOGS" --out "$OUT/serving-h200-8b.json"
kill_servers
(nvidia-smi --query-gpu=memory.used --format=csv || true) >> "$LOGS/nvidia-smi.txt" 2>&1

# The peer runs without /tmp/site (the server's wheels are not its dependencies).
PYTHONPATH=$PWD stage peer "$PEER_LIMIT" $PY -m bench.peer_hf --shapes "$PEER_SHAPES" \
  --configs "$PEER_CONFIGS" --output-len "$PEER_OUT_LEN" --deadline-s $((PEER_LIMIT - 30)) \
  --token-id-range $TOKEN_RANGE --out "$OUT/peer-hf.json"

echo "total $((SECONDS - T0))s" | tee -a "$OUT/stages.txt"
tar czf "$OUT/logs.tar.gz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
ls -la "$OUT"
