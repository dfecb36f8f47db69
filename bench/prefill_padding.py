"""Prefill padding of the offline workloads, without a device: the engine's real scheduler
and the runner's prefill grouping, driven by a host loop that stands in for the model.

    python -m bench.prefill_padding --out bench/results/prefill-padding.json

A prefill dispatch computes a padded [bucket(rows), chunk_bucket(longest)] batch, so every
GEMM, norm and RoPE runs over its token *slots*, not its tokens. For each workload (the
shapes of ``bench/device/gpu_offline.sh``, distinct random prompts, the GPU's prefill
policy: ``max_num_batched_tokens`` 8192, chunk buckets from 128 doubling, ``decode_steps``
8) this records the real prefill tokens, the padded slots and the runner's prefill
dispatches; slots / tokens is the factor by which padding inflates prefill compute.
``--pool-tokens`` bounds the KV pool as a capacity-bound run's memory does (pages of 16).
"""

from __future__ import annotations

import argparse
import json
import sys
import types

from bench.common import command_line, write_result
from jfp8kv.engine.runner import ModelRunner
from jfp8kv.engine.scheduler import Scheduler, Sequence
from jfp8kv.engine.types import SamplingParams
from jfp8kv.kvcache.allocator import PageAllocator

# (name, prompts, input, output, KV pool tokens or None = all fit)
WORKLOADS = [
    ("qwen3-0.6b 32x512/128", 32, 512, 128, None),
    ("qwen3-8b 64x4096/256", 64, 4096, 256, None),
    ("qwen3-8b 16 GB pool 96x4096/256 bf16", 96, 4096, 256, int(16e9 // 147456)),
    ("qwen3-8b 16 GB pool 96x4096/256 fp8 (token scales)", 96, 4096, 256, int(16e9 // 76032)),
]


def gpu_shape_policy(budget: int):
    """The runner's prefill shape policy as built on a GPU (``engine.builder``), without a
    model: its ``chunk_bucket``, ``prefill_area``, ``prefill_groups`` and ``prefill_slots``
    methods."""
    r = types.SimpleNamespace(min_chunk=128, chunk_factor=2, max_chunk=budget,
                              prefill_one_row=False)
    for name in ("chunk_bucket", "prefill_area", "prefill_groups", "prefill_slots"):
        setattr(r, name, getattr(ModelRunner, name).__get__(r))
    return r


def simulate(prompts: int, input_len: int, output_len: int, pool_tokens: int | None,
             budget: int = 8192, page_size: int = 16, max_num_seqs: int = 64,
             decode_steps: int = 8, admission: str = "greedy") -> dict:
    """Run the scheduler to completion; every step's sampled tokens are applied as the
    engine applies them. Returns the prefill counts. ``admission``: the engine's default;
    the numbers in docs/lab/engine-notes.md section 1 were taken under greedy admission."""
    runner = gpu_shape_policy(budget)
    pages = (pool_tokens // page_size if pool_tokens
             else prompts * -(-(input_len + output_len) // page_size)) + 1
    sched = Scheduler(PageAllocator(pages), page_size, input_len + output_len, max_num_seqs,
                      budget, decode_steps, admission=admission)
    for i in range(prompts):  # distinct prompts: nothing shared through the prefix cache
        sched.add(Sequence(str(i), [i * 10**6 + j for j in range(input_len)],
                           SamplingParams(max_tokens=output_len), seed=0))
    out = dict(prefill_tokens=0, prefill_slots=0, prefill_calls=0, steps=0, preemptions=0)
    while sched.has_work():
        plan = sched.schedule()
        out["steps"] += 1
        out["preemptions"] += len(plan.preempted)
        lengths = [c.length for c in plan.prefill]
        if lengths:
            calls, slots = runner.prefill_slots(lengths)
            out["prefill_calls"] += calls
            out["prefill_tokens"] += sum(lengths)
            out["prefill_slots"] += slots
        _apply(sched, plan)
    out["slots_over_tokens"] = round(out["prefill_slots"] / out["prefill_tokens"], 4)
    return out


def _apply(sched: Scheduler, plan) -> None:
    """The engine's bookkeeping of a step's results (one token per finished prefill, the
    decode rows' steps), with a fixed sampled token."""
    for row in plan.decode:
        row.seq.num_cached += row.steps
        row.seq.output_ids.extend([7] * row.steps)
        if len(row.seq.output_ids) >= row.seq.params.max_tokens:
            sched.remove(row.seq)
    for c in plan.prefill:
        c.seq.num_cached += c.length
        if c.completes:
            c.seq.output_ids.append(7)
            if len(c.seq.output_ids) >= c.seq.params.max_tokens:
                sched.remove(c.seq)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--label", default="current", help="a name for this tree's policy")
    p.add_argument("--out", default="bench/results/prefill-padding.json")
    p.add_argument("--append", action="store_true", help="add to an existing --out")
    args = p.parse_args(argv)
    doc = {"what": __doc__.split("\n\n")[1], "runs": []}
    if args.append:
        with open(args.out) as f:
            doc = json.load(f)
    for name, n, inp, outp, pool in WORKLOADS:
        rec = dict(label=args.label, workload=name, command=command_line(),
                   **simulate(n, inp, outp, pool))
        doc["runs"].append(rec)
        print(f"{args.label:8s} {name:40s} tokens {rec['prefill_tokens']:>7,} slots "
              f"{rec['prefill_slots']:>7,} ({rec['slots_over_tokens']:.2f}x) in "
              f"{rec['prefill_calls']} prefill dispatches", flush=True)
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
