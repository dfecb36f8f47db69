"""The golden capacity table: for every model family (dense, MLA, hybrid, DeepSeek-V4) x cache
dtype x scale mode, at fixed budgets and sequence counts, the pages, slots, bytes per token and
each pool's allocated bytes. Recorded once from the planner as it stood before the cache
layout moved into the families (``golden_capacity.json``); ``test_golden_capacity`` holds
today's planner against it.

    python -m tests.kvcache.golden_capacity --record   # rewrite the JSON (only on purpose)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GOLDEN = Path(__file__).with_name("golden_capacity.json")

MODELS = {  # preset -> family, as the table names it
    "smollm2-135m": "dense", "qwen3-8b": "dense", "qwen3-moe-tiny": "dense",
    "deepseek-v2-lite": "mla", "deepseek-v2-tiny": "mla",
    "qwen3.6-35b-a3b": "hybrid", "qwen3.6-tiny": "hybrid",
    "deepseek-v4-flash": "v4", "deepseek-v4-flash-4l": "v4", "deepseek-v4-tiny": "v4",
}
BUDGETS = (64 << 20, 1 << 30, 6 << 30)
SEQS = (8, 64)
MAX_MODEL_LEN = 2048
DENSE_DTYPES = (("auto", None), ("float16", None), ("float32", None),
                *((d, m) for d in ("fp8_e4m3", "fp8_e5m2")
                  for m in ("tensor", "channel", "token", "block")))
MLA_DTYPES = (("auto", None), ("fp8_e4m3", "token"), ("fp8_e4m3", "block"),
              ("fp8_e5m2", "block"))
V4_DTYPES = (("auto", None), ("fp8_e4m3", "block"))


def model_config(preset: str):
    from jfp8kv.config import ModelConfig
    from jfp8kv.models.presets import PRESETS
    from jfp8kv.models.v4_presets import v4_config

    if preset.startswith("deepseek-v4"):
        return v4_config(preset)
    return ModelConfig(**PRESETS[preset], name=preset)


def cases():
    """(preset, family, kv_cache_dtype, scale mode, budget, max_num_seqs) of the table."""
    for preset, family in MODELS.items():
        dtypes = {"mla": MLA_DTYPES, "v4": V4_DTYPES}.get(family, DENSE_DTYPES)
        for kv, mode in dtypes:
            for budget in BUDGETS:
                for seqs in SEQS:
                    yield preset, family, kv, mode, budget, seqs


def key(preset, kv, mode, budget, seqs) -> str:
    return f"{preset}|{kv}|{mode}|{budget}|{seqs}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="rewrite golden_capacity.json")
    args = ap.parse_args()
    from tests.kvcache.test_golden_capacity import capacity_row

    rows = {key(p, kv, m, b, s): capacity_row(p, kv, m, b, s)
            for p, _, kv, m, b, s in cases()}
    if args.record:
        GOLDEN.write_text(json.dumps(rows, indent=0, sort_keys=True) + "\n")
        print(f"wrote {len(rows)} rows to {GOLDEN}")
    else:
        print(json.dumps(rows, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
