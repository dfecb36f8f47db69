"""The device's shape policy: what ``build_engine`` fills in for the knobs a user left
``None`` (decode buckets and steps, prefill chunk and batch tokens, running sequences), and
the CPU's float32 matmul weights. The pools' bytes are the memory plan's
(``engine/memory.py``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jfp8kv.config import EngineConfig

DEFAULT_MAX_NUM_SEQS = 64
# GPU shape policy: decode is memory-bound, so coarse batch buckets cost little and save
# compiles; several decode steps per dispatch hide host overhead.
GPU_DECODE_BUCKETS = (8, 32, 64, 128, 256)
GPU_MIN_CHUNK = 128
GPU_DECODE_STEPS = 8
# Tokens per step: a prefill chunk long enough for full-rate matmuls, and so few prefill
# steps that decode rows interleaved with them stay few (each step reads every weight).
# On an H200, 8B shape, 64 x 4096 in / 256 out: docs/lab/results-history.md's offline table.
GPU_BATCHED_TOKENS = 8192
# CPU shape policy: every shape compiles before /health (~15 s a decode shape, ~30 s a
# prefill one at SmolLM2-135M on one core: docs/lab/cpu-serving.md), so the set is small: one-row
# prefill chunks of 16/64/256 (longer prompts: chunked prefill), decode batches 1/8/64 at
# page-table widths of 256 tokens and max_model_len (reference attention reads every page).
CPU_BATCHED_TOKENS = 256
CPU_MIN_CHUNK = 16
CPU_DECODE_BUCKETS = (1, 8, 64)


def device_defaults(engine: EngineConfig, device) -> EngineConfig:
    """Fill the shape-policy knobs left None: GPU decode is memory-bound (coarse batch
    buckets, several steps per dispatch); CPU takes a few batch buckets and one step."""
    on_gpu = device.platform == "gpu"
    return dataclasses.replace(
        engine,
        decode_steps=engine.decode_steps or (GPU_DECODE_STEPS if on_gpu else 1),
        decode_buckets=engine.decode_buckets or (GPU_DECODE_BUCKETS if on_gpu
                                                 else CPU_DECODE_BUCKETS),
        min_prefill_chunk=engine.min_prefill_chunk or (GPU_MIN_CHUNK if on_gpu else CPU_MIN_CHUNK),
        max_num_seqs=engine.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens=engine.max_num_batched_tokens or (
            GPU_BATCHED_TOKENS if on_gpu else CPU_BATCHED_TOKENS))


def cpu_float32_weights(params):
    """params with every bf16/f16 matmul weight as float32 (the embedding table stays as it
    is: its dtype is the activation dtype; a tied LM head gets its own float32 [V, D] copy).
    XLA's CPU backend has no low-precision dot: it would convert those weights on every
    call, which costs more than the matmuls; activations keep the compute dtype, and the
    products are exact in float32 either way."""
    def up(x):
        return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x

    out = dict(params)
    out["layers"] = [jax.tree.map(up, lp) for lp in params["layers"]]
    out["final_norm"] = up(params["final_norm"])
    if params.get("lm_head") is not None:
        out["lm_head"] = up(params["lm_head"])
    elif params["embed"].dtype in (jnp.bfloat16, jnp.float16):
        out["lm_head"] = up(params["embed"]).T
    return out
