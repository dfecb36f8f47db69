"""KV capacity: tokens and concurrent sequences that fit in the same memory, per dtype/mode.

Uses the engine's own accounting (``bytes_per_token`` and ``plan_num_pages``, the functions
``jfp8kv.LLM`` sizes its pool with), for real architectures' shapes.

    python -m bench.capacity --memory-gib 40 --context 8192 --out bench/results/capacity.json
"""

from __future__ import annotations

import argparse
import sys


from bench.common import command_line, write_result
from jfp8kv.kvcache.cache import bytes_per_token, plan_num_pages
from jfp8kv.models.presets import PRESETS

CONFIGS = [("bfloat16", None)] + [(d, m) for d in ("float8_e4m3fn", "float8_e5m2")
                                  for m in ("tensor", "channel", "token", "block")]
USER = {"bfloat16": "bfloat16", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--memory-gib", type=float, default=40.0)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--models", default="smollm2-135m,qwen3-0.6b,llama-3-8b,qwen3-8b")
    p.add_argument("--out", default="bench/results/capacity.json")
    args = p.parse_args(argv)
    mem = int(args.memory_gib * (1 << 30))
    records = []
    for name in args.models.split(","):
        c = PRESETS[name]
        base = None
        for storage, mode in CONFIGS:
            shape = dict(num_layers=c["num_layers"], num_kv_heads=c["num_kv_heads"],
                         head_dim=c["head_dim"])
            bpt = bytes_per_token(**shape, storage_dtype=storage, scale_mode=mode)
            pages = plan_num_pages(mem, **shape, page_size=args.page_size,
                                   storage_dtype=storage, scale_mode=mode)
            tokens = pages * args.page_size
            seqs = pages // -(-args.context // args.page_size)
            rec = dict(model_shape=name, kv_cache_dtype=USER[storage], kv_scale_mode=mode,
                       bytes_per_token=bpt, memory_bytes=mem, pages=pages, tokens=tokens,
                       context=args.context, concurrent_sequences=seqs)
            base = base or rec
            rec["token_ratio_vs_bf16"] = round(tokens / base["tokens"], 4)
            rec["sequence_ratio_vs_bf16"] = round(seqs / max(base["concurrent_sequences"], 1), 4)
            records.append(rec)
            print(f"{name:13s} {USER[storage]:9s} {mode or '-':8s} {bpt:8d} B/token "
                  f"{tokens:>10,d} tokens {seqs:5d} seqs@{args.context} "
                  f"x{rec['token_ratio_vs_bf16']:.3f}")
    doc = dict(command=command_line(), memory_gib=args.memory_gib,
               page_size=args.page_size, records=records)
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
