"""``python -m jfp8kv calibrate --model M --text FILE... --out scales.json``
(also ``python -m jfp8kv.calibrate``).

Measures per-layer, per-KV-head, per-channel absolute maxima of post-RoPE K and V over
real text (K after ``--kv-rotation``'s transform, with the K mean it subtracts) and writes
them (times ``--headroom``) to a scales JSON that
``LLM(kv_scales="scales.json")`` loads for the static scale modes (tensor, channel).
"""

from __future__ import annotations

import argparse
import sys

from jfp8kv.cli import ArgumentParser, add_config_args, setup_logging, user_errors
from jfp8kv.config import KV_ROTATIONS, LoadConfig

PROG = "python -m jfp8kv.calibrate"


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__)
    add_config_args(p, LoadConfig, defaults={"dtype": "float32"})
    p.add_argument("--text", nargs="+", required=True, help="text files to calibrate on")
    p.add_argument("--out", required=True)
    p.add_argument("--headroom", type=float, default=1.0,
                   help="multiply the measured amax by this (>= 1 leaves room for outliers)")
    p.add_argument("--max-tokens-per-file", type=int, default=4096)
    p.add_argument("--kv-rotation", default="none", choices=KV_ROTATIONS,
                   help="the K transform the engine will use (K amax measured in its basis; "
                        "smooth* also records the K mean it subtracts)")
    args = p.parse_args(argv)
    if args.headroom <= 0:
        p.error("--headroom must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging("INFO")
    from jfp8kv.engine.calibrate import measure_amax
    from jfp8kv.models.loader import load_model

    with user_errors(PROG):
        loaded = load_model(args.model, args.dtype)
        chunks = []
        for path in args.text:
            with open(path, encoding="utf-8") as f:
                ids = loaded.tokenizer.encode(f.read())
            chunks.append(ids[:args.max_tokens_per_file])
        amax = measure_amax(loaded.config, loaded.params, chunks, kv_rotation=args.kv_rotation)
    amax.to_json(args.out, headroom=args.headroom)
    n = sum(len(c) for c in chunks)
    print(f"wrote {args.out}: K/V amax over {n} tokens of {len(chunks)} file(s), "
          f"layers={loaded.config.num_layers}, headroom={args.headroom}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
