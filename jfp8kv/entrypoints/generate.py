"""``python -m jfp8kv generate "prompt" ...``: generate from the command line.

Prompts are wrapped in the model's chat template unless ``--raw`` is given. The engine
flags are the server's and ``jfp8kv.LLM``'s, with one default of this command's own:
``--max-model-len 2048`` (they use the model's context length, 8192 for the default model).
Each shape compiles on its first use (no warm-up: one command, a few prompts).
"""

from __future__ import annotations

import argparse
import sys

from jfp8kv.cli import ArgumentParser, add_engine_args, build_llm, setup_logging

PROG = "python -m jfp8kv generate"


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    add_engine_args(p, defaults={"max_model_len": 2048}, notes={
        "max_model_len": "this command's own, a short pool for a few prompts; the server "
                         "and jfp8kv.LLM default to the model's context length"})
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--raw", action="store_true", help="no chat template")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging("INFO")
    llm = build_llm(args, PROG)
    from jfp8kv.engine.types import SamplingParams

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
