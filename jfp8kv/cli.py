"""Command-line flags shared by every jfp8kv command (names follow vLLM's)."""

from __future__ import annotations

import argparse

from jfp8kv.config import ATTENTION_BACKENDS, COMPUTE_DTYPES, KV_CACHE_DTYPES, KV_SCALE_MODES


def add_engine_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file, or 'smollm2-135m-instruct' (the default)")
    p.add_argument("--dtype", default="bfloat16", choices=COMPUTE_DTYPES,
                   help="compute dtype of weights and activations")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage dtype: auto (= --dtype) or fp8_e4m3/fp8_e5m2 (fp8 = e4m3)")
    p.add_argument("--kv-scale-mode", default=None, choices=KV_SCALE_MODES,
                   help="fp8 scale granularity (default: the engine's documented default)")
    p.add_argument("--kv-scales", default=None,
                   help="static fp8 scales: a float for every layer or a scales JSON from "
                        "`python -m jfp8kv.calibrate` (default: checkpoint scales, else calibrate)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes for the KV cache pool (default: sized from free device memory)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="do not use JAX's persistent compilation cache "
                        "($JFP8KV_CACHE/jax-cache, default ~/.cache/jfp8kv/jax-cache)")
    return p


def parse_kv_scales(value: str | None):
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return value


def llm_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                kv_scale_mode=args.kv_scale_mode, kv_scales=parse_kv_scales(args.kv_scales),
                max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                attention_backend=args.attention_backend, seed=args.seed,
                compile_cache=args.compile_cache)
