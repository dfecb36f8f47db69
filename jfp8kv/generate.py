"""``python -m jfp8kv.generate "prompt" ...``: generate from the command line.

Prompts are wrapped in the model's chat template unless ``--raw`` is given.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jfp8kv.cli import add_engine_args, llm_kwargs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jfp8kv.generate", description=__doc__)
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--raw", action="store_true", help="no chat template")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from jfp8kv import LLM, SamplingParams

    if args.max_model_len is None:
        args.max_model_len = 2048
    llm = LLM(**llm_kwargs(args))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.raw:
        outs = llm.generate(args.prompts, sp)
    else:
        outs = llm.chat([[{"role": "user", "content": q}] for q in args.prompts], sp)
    for q, o in zip(args.prompts, outs):
        print(f"### {q}\n{o.text}\n[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
