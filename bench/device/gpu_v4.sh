#!/usr/bin/env bash
# One device call for DeepSeek-V4 through the engine (issue 40; docs/lab/deepseek-v4.md).
# Usage (on the GPU machine, repo root): OUT=/some/dir bash bench/device/gpu_v4.sh
# STAGES (default "v4-tests v4-pair v4-serve") picks stages; each is bounded in time and a
# failing stage does not stop the rest:
#   v4-tests     the V4 kernels' native GPU tests and the engine's GPU case (tiny preset)
#   v4-bfloat16  bench.offline, random:deepseek-v4-flash-4l (layers 0-1 window-only, 2 CSA,
#   v4-fp8       3 HCA; 52.6 GB of bf16 weights: 4 x 256 experts x 3 x 4096 x 2048 x 2 B +
#                embedding and LM head 2.1 GB + attention 0.2 GB per layer), one KV dtype per
#                stage, 64 prompts of 2,048 + 128 tokens at a fixed 9.6e7-byte pool: 66 slots
#                (bf16 1,110,016 B each: window ring + fp32 compressor state; fp8 864,256 B)
#                then pages of 128 tokens (bf16 41,984 B, fp8 26,144 B), so bf16 holds 540
#                pages = 31 of the 64 sequences (17 pages each) and fp8 1,489 = all 64.
#                Prefill chunks of 2,048 tokens (one prompt per dispatch, four 512-token
#                passes), so the run compiles one prefill shape and the decode buckets.
#   v4-pair      both KV dtypes in one process (the weights made once; each run is written
#                to the JSON as it ends, so a stage cut short keeps the bf16 run)
#   v4-serve     python -m jfp8kv.serve on the same model with an fp8 pool (bench.long_request)
# Issue 57 (the pools read in place, the model's context by default), each <= 480 s, STAGES
# "v4-long" runs them all, one per device call:
#   v4-long-tests    the in-place kernels' native tests, the engine's GPU cases (tiny preset,
#                    150-token prompts through the compiled kernels over NaN-filled pools)
#   v4-long-decode   bench.decode_floor, flash-4l fp8, batch 32, contexts 4k-128k per row
#                    (decode tok/s per context, one engine; summary: each over 4k)
#   v4-long-width    the same, one 4,096-token row, page tables of 8,192 vs 1,048,576 tokens
#   v4-long-dtypes   the same, batch 32 at 64k, bf16 and fp8 pools (summary: fp8/bf16)
#   v4-long-prefill  bench.offline --prefill-only, 64 x 2,048 tokens, fp8, against the ideal
#                    that counts the sparse attention
#   v4-long-serve    one 131,072-token request through the server at the default
#                    max_model_len (the model's 1,048,576 as the pool holds it), TTFT
# Results: $OUT/offline-v4-h200.json, $OUT/v4-*.log, $OUT/v4-serve.json. The device tool
# runs one command for at most 600 s: one stage per call (each stage's limit is below it;
# the Flash-4l stages compile one prefill and up to six decode executables in the warm-up).
STAGES=${STAGES:-"v4-tests v4-pair v4-serve"}
MODEL=${V4_MODEL:-random:deepseek-v4-flash-4l}
source "$(dirname "$0")/lib.sh"
stage v4-tests ${V4_TESTS_LIMIT:-300} python3 -m pytest -q -m gpu tests/kernels/test_v4_sparse.py \
  tests/engine/test_v4_engine.py -p no:cacheprovider
json="$OUT/offline-v4-h200.json"
for kv in bfloat16 fp8; do
  stage v4-$kv ${V4_LIMIT:-560} python3 -m bench.offline --model "$MODEL" --num-prompts 64 \
    --input-len 2048 --output-len 128 --max-model-len 2176 --max-num-seqs 64 \
    --max-num-batched-tokens 2048 \
    --kv-cache-memory ${V4_KV:-9.6e7} --kv-cache-dtype $kv --out "$json" --append
done
stage v4-pair ${V4_PAIR_LIMIT:-560} python3 -m bench.offline --model "$MODEL" --num-prompts 64 \
  --input-len 2048 --output-len 128 --max-model-len 2176 --max-num-seqs 64 \
  --max-num-batched-tokens 2048 \
  --kv-cache-memory ${V4_KV:-9.6e7} --kv-cache-dtype bfloat16,fp8 --out "$json" --append
# v4-serve: issue 40's done-when through bench.long_request (started server, /health, one
# streamed greedy completion of 1,024 prompt tokens, then the same again with its shapes
# compiled; JSON with the machine and both timings)
stage v4-serve ${V4_SERVE_LIMIT:-400} python3 -m bench.long_request --model "$MODEL" \
  --prompt-tokens ${V4_SERVE_TOKENS:-1024} --max-tokens 16 --repeat --startup-timeout 300 \
  --out "$OUT/v4-serve.json" -- --kv-cache-dtype fp8_e4m3 --max-model-len 4096 --warmup off
L=${V4_LONG_LIMIT:-480}
stage v4-long-tests $L python3 -m pytest -q -m gpu tests/kernels/test_v4_paged_sparse.py \
  tests/engine/test_v4_engine.py tests/engine/test_v4_long_context.py -p no:cacheprovider
stage v4-long-decode $L python3 -m bench.decode_floor --model "$MODEL" --batch 32 \
  --context 4096,16384,65536,131072 --configs fp8_e4m3:block --steps 8 --reps 5 \
  --max-num-batched-tokens 2048 --out "$OUT/v4-long-decode.json"
stage v4-long-width $L python3 -m bench.decode_floor --model "$MODEL" --batch 1 --context 4096 \
  --max-model-len 8192,1048576 --configs fp8_e4m3:block --steps 8 --reps 10 \
  --max-num-batched-tokens 2048 --out "$OUT/v4-long-width.json"
stage v4-long-dtypes $L python3 -m bench.decode_floor --model "$MODEL" --batch 32 --context 65536 \
  --configs bfloat16:,fp8_e4m3:block --steps 8 --reps 5 --max-num-batched-tokens 2048 \
  --out "$OUT/v4-long-dtypes.json"
stage v4-long-prefill $L python3 -m bench.offline --model "$MODEL" --num-prompts 64 \
  --input-len 2048 --output-len 1 --max-model-len 2176 --max-num-seqs 64 \
  --max-num-batched-tokens 2048 --kv-cache-memory 9.6e7 --kv-cache-dtype fp8 --prefill-only \
  --out "$OUT/offline-v4-prefill.json"
stage v4-long-serve $L python3 -m bench.long_request --model "$MODEL" --prompt-tokens 131072 \
  --max-tokens 16 --startup-timeout 300 --request-timeout 300 --out "$OUT/v4-long-serve.json" \
  -- --kv-cache-dtype fp8_e4m3 --max-num-seqs 8 --warmup off
[ -f "$json" ] && python3 -m bench.offline --plot-only "$json" > /dev/null 2>&1
ls -la "$OUT"
