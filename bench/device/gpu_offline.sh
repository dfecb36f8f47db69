#!/usr/bin/env bash
# One device call: the GPU tests, then offline throughput against the ideal time
# (bench.offline) on Qwen3-0.6B's and Qwen3-8B's shapes, bf16 vs fp8 in one invocation each.
# Usage (on the GPU machine, repo root): OUT=/some/dir bash bench/device/gpu_offline.sh
# STAGES (default "tests small large") picks stages ("mla-tests" the MLA engine GPU test; "capacity" runs capacity-fp8 and
# capacity-bf16, "cap1024" the same pool with 1,024 output tokens; "profile" the 0.6B decode
# step's kernel profile, "prefill" one 8B prefill step's); each is bounded in time
# and a failing stage does not stop the rest. Results: $OUT/offline-h200.json (+ .png),
# $OUT/*.log. The device tool returns at most 8 files from $OUT: pick few stages per call.
# STAGES=moe (or moe-lite, moe-lite-bfloat16 / moe-lite-fp8, moe-30b alone): random-weight DeepSeek-V2-Lite (MLA + MoE) and
# Qwen3-30B-A3B (MoE, 61 GB of bf16 weights + the 8 GB pool fit one H200), bf16 vs fp8 KV at
# a fixed KV budget sized so that bf16 holds about half the 64 sequences and fp8 all of them
# (V2-Lite 2.5e9 B: 31,104 vs 16,524 B/token with block scales, 34 vs 65 sequences of 2304
# tokens; 30B-A3B 8e9 B: 98,304 vs 50,688 B/token with token scales, 35 vs 68).
# Results: $OUT/offline-moe-h200.json (+ .png).
STAGES=${STAGES:-"tests small large"}
source "$(dirname "$0")/lib.sh"
json="$OUT/offline-h200.json"
stage tests ${TESTS_LIMIT:-200} python3 -m pytest -q -m gpu tests/kernels tests/engine/test_gpu_e2e.py \
  -k "not mla_engine" -p no:cacheprovider
# the MLA model through the engine (4 cases, ~200 s on 2026-12-03, most of it compiling two
# engines per case: XLA's GEMM autotuning is off for it, a correctness test)
stage mla-tests ${MLA_TESTS_LIMIT:-300} env XLA_FLAGS=--xla_gpu_autotune_level=0 python3 -m pytest \
  -q -m gpu tests/engine/test_gpu_e2e.py -k mla_engine -p no:cacheprovider
stage small ${SMALL_LIMIT:-150} python3 -m bench.offline --model random:qwen3-0.6b --num-prompts 32 \
  --input-len 512 --output-len 128 --kv-cache-dtype bfloat16,fp8 --out "$json" --append
stage large ${LARGE_LIMIT:-240} python3 -m bench.offline --model random:qwen3-8b --num-prompts 64 \
  --input-len 4096 --output-len 256 --kv-cache-dtype bfloat16,fp8 --out "$json" --append
# capacity: one KV dtype per stage (a bf16 run with its full warm-up took ~150 s on 2026-12-02)
stage capacity-fp8 ${CAP_LIMIT:-200} python3 -m bench.offline --model random:qwen3-8b --num-prompts 96 \
  --input-len 4096 --output-len 256 --kv-cache-memory 16e9 --kv-cache-dtype fp8 --out "$json" --append
stage capacity-bf16 ${CAP_LIMIT:-200} python3 -m bench.offline --model random:qwen3-8b --num-prompts 96 \
  --input-len 4096 --output-len 256 --kv-cache-memory 16e9 --kv-cache-dtype bfloat16 --out "$json" --append
# capacity at 1,024 output tokens (issue target: fp8/bf16 above 1.5x), one KV dtype per stage
stage cap1024-fp8 ${CAP_LIMIT:-220} python3 -m bench.offline --model random:qwen3-8b --num-prompts 96 \
  --input-len 4096 --output-len 1024 --kv-cache-memory 16e9 --kv-cache-dtype fp8 --out "$json" --append
stage cap1024-bf16 ${CAP_LIMIT:-220} python3 -m bench.offline --model random:qwen3-8b --num-prompts 96 \
  --input-len 4096 --output-len 1024 --kv-cache-memory 16e9 --kv-cache-dtype bfloat16 --out "$json" --append
# decode step against its floor with kernels per step (docs/lab/engine-notes.md)
stage profile ${PROFILE_LIMIT:-120} python3 -m bench.decode_floor --model random:qwen3-0.6b --batch 32 \
  --context 512 --configs bfloat16:,fp8_e4m3:token --profile --out "$OUT/decode-floor-06b-h200.json"
# one engine prefill step of the 8B shape (2 x 4096 tokens), kernels by kind (docs/lab/engine-notes.md)
stage prefill-profile ${PPROF_LIMIT:-150} python3 -m bench.prefill_profile --model random:qwen3-8b \
  --rows 2 --chunk 4096 --configs bfloat16:,fp8_e4m3:token,fp8_e4m3:tensor \
  --out "$OUT/prefill-profile-h200.json"
moe_json="$OUT/offline-moe-h200.json"
# one KV dtype per stage: both in one command took over 300 s on 2026-12-02 (the bf16 run
# with its warm-up ~200 s; each dtype compiles its own MLA executables)
for kv in bfloat16 fp8; do
  stage moe-lite-$kv ${MOE_LITE_LIMIT:-240} python3 -m bench.offline --model random:deepseek-v2-lite \
    --num-prompts 64 --input-len 2048 --output-len 256 --kv-cache-memory ${MOE_LITE_KV:-2.5e9} \
    --kv-cache-dtype $kv --out "$moe_json" --append
done
stage moe-30b ${MOE_30B_LIMIT:-420} python3 -m bench.offline --model random:qwen3-30b-a3b \
  --num-prompts 64 --input-len 2048 --output-len 256 --kv-cache-memory ${MOE_30B_KV:-8e9} \
  --kv-cache-dtype bfloat16,fp8 --out "$moe_json" --append
# STAGES=hybrid (or hybrid-bfloat16 / hybrid-fp8 / hybrid-131k): random-weight Qwen3.6-35B-A3B
# (Gated DeltaNet + gated attention + MoE, 69 GB of bf16 weights; docs/lab/qwen3-hybrid.md).
# Fixed 3.0e9 B budget = 34 float32 DeltaNet state slots (2.24e9) + pages: 10 attention
# layers x 2 KV heads x 256 = 20,480 B/token bf16 vs 10,400 fp8 (token scales), so bf16 holds
# ~17 of the 32 sequences of 2,176 tokens and fp8 all 32. hybrid-131k: one 131,072-token
# prompt with an fp8 cache (pool sized from free memory), 16 tokens out.
hyb_json="$OUT/offline-hybrid-h200.json"
# hybrid-tiny: the preset random:qwen3.6-tiny through the GPU kernels (both cache dtypes), a
# first run of the hybrid engine on the GPU before the 35B-A3B stages spend minutes
stage hybrid-tiny ${HYBRID_TINY_LIMIT:-150} python3 -m bench.offline --model random:qwen3.6-tiny \
  --num-prompts 8 --input-len 256 --output-len 32 --kv-cache-dtype bfloat16,fp8 \
  --out "$OUT/offline-hybrid-tiny-h200.json"
for kv in bfloat16 fp8; do
  stage hybrid-$kv ${HYBRID_LIMIT:-240} python3 -m bench.offline --model random:qwen3.6-35b-a3b \
    --num-prompts 32 --input-len 2048 --output-len 128 --max-model-len 2176 --max-num-seqs 32 \
    --kv-cache-memory ${HYBRID_KV:-3.0e9} --kv-cache-dtype $kv --out "$hyb_json" --append
done
# hybrid-pair: both cache dtypes in one process (the 69 GB of weights made once); hybrid-serve:
# issue 41's done-when, one 131,072-token request through python -m jfp8kv.serve (fp8 cache,
# pool from free memory, no warm-up: the first TTFT includes compiling; --repeat times it warm)
stage hybrid-pair ${HYBRID_PAIR_LIMIT:-320} python3 -m bench.offline --model random:qwen3.6-35b-a3b \
  --num-prompts 32 --input-len 2048 --output-len 128 --max-model-len 2176 --max-num-seqs 32 \
  --kv-cache-memory ${HYBRID_KV:-3.0e9} --kv-cache-dtype bfloat16,fp8 --out "$hyb_json" --append
stage hybrid-serve ${HYBRID_SERVE_LIMIT:-250} python3 -m bench.long_request \
  --model random:qwen3.6-35b-a3b --prompt-tokens 131072 --max-tokens 16 --repeat \
  --startup-timeout 150 --out "$OUT/long-request-hybrid-h200.json" -- --kv-cache-dtype fp8_e4m3 \
  --max-model-len 131088 --max-num-seqs 4 --warmup off
# hybrid-long: the 131,072-token request's TTFT and decode speed (256 tokens out, sent twice:
# the second TTFT is the prefill alone) through the server, fp8 cache; the JSON's "summary".
# HYBRID_LONG_ARGS: more server flags (e.g. "--kv-cache-memory 4e9 --max-num-batched-tokens
# 2048", docs/lab/qwen3-hybrid.md, if the pool leaves the prefill too little memory)
stage hybrid-long ${HYBRID_LONG_LIMIT:-470} python3 -m bench.long_request \
  --model random:qwen3.6-35b-a3b --prompt-tokens 131072 --max-tokens 256 --repeat \
  --startup-timeout 150 --request-timeout 200 --out "$OUT/long-request-hybrid-256.json" -- \
  --kv-cache-dtype fp8_e4m3 --max-model-len 131328 --max-num-seqs 4 --warmup off ${HYBRID_LONG_ARGS:-}
stage hybrid-131k ${HYBRID_131K_LIMIT:-240} python3 -m bench.offline --model random:qwen3.6-35b-a3b \
  --num-prompts 1 --input-len 131072 --output-len 16 --max-model-len 131088 --max-num-seqs 1 \
  --kv-cache-dtype fp8 --warmup off --out "$hyb_json" --append
for j in "$json" "$moe_json" "$hyb_json"; do [ -f "$j" ] && python3 -m bench.offline --plot-only "$j" >/dev/null 2>&1; done
ls -la "$OUT"
