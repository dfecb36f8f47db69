#!/usr/bin/env bash
# One device call: the fp8 cast and decode-variant GPU tests, then the kernel comparisons
# (store casts and the engine's prologue store, each size's rows timed side by side, and
# decode variants beside bf16) into $OUT/kernels-h200.json;
# STAGES="mla" (not a default): the MLA kernel's GPU tests, then its decode timings (sweep, best
# per storage) into $OUT/mla-kernels-h200.json. STAGES="mosaic": the Mosaic GPU kernels (below).
# Usage (on the GPU machine, repo root): OUT=/some/dir bash bench/device/gpu_kernels.sh
# Issue 14's rotation cost, its own call: OUT=/some/dir STAGES=rotation bash bench/device/gpu_kernels.sh
set -u
OUT=${OUT:-/tmp/jfp8kv-out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests store decode"}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
stage() { local name=$1 limit=$2; shift 2; case " $STAGES " in *" $name "*) ;; *) return;; esac
  echo "=== $name (<= ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 30; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"; }
case " $STAGES " in *" tests "*|*" store "*|*" decode "*|*" pages "*|*" splits "*|*" rotation "*)
  cp bench/results/kernels-h200.json "$OUT/kernels-h200.json";; esac
stage tests ${TESTS_LIMIT:-100} python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_store.py tests/kernels/test_decode.py -k "cast or bit_exact or variants"
stage store ${STORE_LIMIT:-150} python3 -m bench.kernels --compare store,prologue --budget-s $(( ${STORE_LIMIT:-150} - 40 )) \
  --out "$OUT/kernels-h200.json"
stage decode ${DECODE_LIMIT:-200} python3 -m bench.kernels --compare decode --budget-s $(( ${DECODE_LIMIT:-200} - 40 )) \
  --out "$OUT/kernels-h200.json"
# STAGES=pages / splits (not defaults): decode at page sizes 16/32/64; the one-wave no-split
# rule against the split rule, and whole-wave split counts (docs/lab/kernels-notes.md)
stage pages ${PAGES_LIMIT:-150} python3 -m bench.kernels --compare pages --budget-s $(( ${PAGES_LIMIT:-150} - 40 )) \
  --out "$OUT/kernels-h200.json"
stage splits ${SPLITS_LIMIT:-200} python3 -m bench.kernels --compare splits,waves --budget-s $(( ${SPLITS_LIMIT:-200} - 40 )) \
  --out "$OUT/kernels-h200.json"
# STAGES=mosaic (not a default): both Mosaic GPU kernels' native tests, then the prefill
# kernel and the decode kernel beside the Triton kernels into $OUT/kernels-mosaic-h200.json
stage mosaic ${MOSAIC_LIMIT:-420} bash -c "cp bench/results/kernels-mosaic-h200.json $OUT/ && \
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mosaic_prefill.py tests/lab/test_mosaic_decode.py; \
  python3 -m bench.kernels --compare mosaic_prefill,mosaic --budget-s $(( ${MOSAIC_LIMIT:-420} - 150 )) --out $OUT/kernels-mosaic-h200.json"
stage mla ${MLA_LIMIT:-300} bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mla_kernel.py && python3 -m bench.mla_kernels --sweep --out $OUT/mla-kernels-h200.json"
# Issue 14 (STAGES=rotation; not run by default): the K transform's cost at the dispatcher
# (kernels.store_kv / paged_attention, where the transform runs), e4m3 token/block/tensor,
# kv_rotation none vs hadamard, smooth and smooth+hadamard side by side on the same data
# (decode, then prefill, then the store; head dims 128 and 64); rows under "rotation", per op
# under "rotation_summary", and the verdict against the < 3% target (store of the step's rows
# + attention, vs attention, per phase) under "rotation_phase_summary" in kernels-h200.json.
stage rotation ${ROTATION_LIMIT:-540} python3 -m bench.kernels --kv-rotation all \
  --rotation-ops decode,prefill,store --budget-s $(( ${ROTATION_LIMIT:-540} - 90 )) \
  --out "$OUT/kernels-h200.json"
# STAGES=fp8-prefill (issue 34, not a default): the Mosaic prefill kernel's native tests (the
# fp8-products cases too) and the engine option's, then bf16 / fp8 dequant / fp8 products side
# by side with accuracy rows (bench.prefill_fp8) into $OUT/prefill-fp8-h200.json
stage fp8-prefill ${FP8_PREFILL_LIMIT:-270} bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_mosaic_prefill.py tests/kernels/test_fp8_attention_compute.py; \
  python3 -m bench.prefill_fp8 --out $OUT/prefill-fp8-h200.json"
# STAGES=v4 (issue 40, not a default): DeepSeek-V4's sparse decode (bf16 vs fp8 rows, error
# against the twin) and indexer kernels timed, with the pools' capacity model
stage v4 ${V4_LIMIT:-150} python3 -m bench.v4_kernels --out "$OUT/v4-kernels-h200.json"
ls -la "$OUT"
