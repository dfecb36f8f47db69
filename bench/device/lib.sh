# Shared preamble of the stage scripts (gpu_offline.sh, gpu_v4.sh): source it after setting
# STAGES. Sets OUT (default /tmp/jfp8kv-out), the environment, installs the carried wheels
# (.whl/, see fetch_wheels.sh; .whl-jla/, kernels/delta_prefill.py) into /tmp/site, prints
# the GPU, and defines
#   stage NAME LIMIT CMD...   run CMD for at most LIMIT s when STAGES names NAME (or its
#                             prefix before the first or last "-"); log in $OUT/NAME.log
set -u
OUT=${OUT:-/tmp/jfp8kv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92} JFP8KV_CACHE=/tmp/jfp8kv-cache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
if [ -d .whl-jla ]; then  # jax-linear-attention (the DeltaNet prefill's Hopper kernel), no deps
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-jla/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
stage() { local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*|*" ${name%%-*} "*|*" ${name%-*} "*) ;; *) return;; esac
  echo "=== $name (<= ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 25; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"; }
