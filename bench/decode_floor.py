"""Decode step time against its memory floor, bf16 vs fp8 KV, on a real architecture's shape.

A decode step must read every weight once and every live token's K/V once, so its floor is
(weight bytes + KV bytes) / copy bandwidth, with the copy bandwidth measured in the same run.
The step is the engine's own jitted multi-step decode (``decode_steps`` tokens per dispatch),
timed over full batches whose pages hold random data (never zeros).

    python -m bench.decode_floor --model random:qwen3-8b --batch 64 --context 8192 \
        --out bench/results/decode-floor-h200.json

``--decode-one-wave off`` times it with the decode kernel's splits chosen as before the
one-wave rule (``pallas_decode.one_wave``), for an A/B in one call.
A config ``fp8_e4m3:block+smooth`` times a K transform (``kv_rotation``) beside the others
(issue 36 point 4: the cost of a default candidate against ``token``).
``--decode-variant pagepf+asm+vmask`` times the step with another decode kernel variant for
fp8 pages (``jfp8kv.kernels.tiles.Variant``) in place of the default.

``--context`` and ``--max-model-len`` take comma lists: one engine per (config,
max_model_len, sampler) holds every context's rows (each row owns the pages its context
needs), and each context is timed on it; ``--max-model-len`` (default: the longest context
+ steps + a page) sets the page tables' width. DeepSeek-V4 (issue 57) runs too: its rows
get state slots, its page size is raised as the engine raises it, every pool (window ring,
compressed and indexer entries, compressor state) holds random data, and its floor counts
its sparse attention's bytes and compressor state (``bench.offline.v4_sparse_cost``)
instead of K/V per token. For MoE models the floor reads every weight; ``ideal_ms`` reads
the weights ``bench.offline``'s ideal model expects (the experts a batch touches, W(B)):

    python -m bench.decode_floor --model random:deepseek-v4-flash-4l --batch 32 \
        --context 4096,16384,65536,131072 --configs bfloat16:,fp8_e4m3:block
    python -m bench.decode_floor --model random:deepseek-v4-flash-4l --batch 32 \
        --context 4096 --max-model-len 8192,1048576 --configs fp8_e4m3:block

Each record also gives ``tokens_per_s`` (batch / step); ``summary`` the ratios between
contexts and max_model_lens and fp8 / bf16 of each config group.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import sys
import time

import jax
import numpy as np

from bench import internals, offline, profile_trace
from bench.common import (command_line, copy_bandwidth_tbps, machine_info,
                          override_decode_tuning, override_split_loop,
                          write_result)
from jfp8kv import LLM
from jfp8kv.config import GEMM_AUTOTUNE


# --samplers: what each row of the timed dispatch asks the sampler for, and which executable
# structure serves it (EngineConfig.feature_executables; plain rows never run the switched one)
SAMPLERS = {"plain": (False, None), "logprobs:switched": (True, "switched"),
            "logprobs:per-mix": (True, "per-mix")}


def profile_dispatch(dispatch, steps) -> dict:
    """One more decode dispatch under the profiler: its kernels per decode step."""
    return profile_trace.profile(lambda: jax.block_until_ready(dispatch()), per=steps)


def _pool_memory(cfg, kv, mode, dtype, page_size, batch, tokens, max_len):
    """(page size, kv_cache_memory) for ``batch`` rows of ``tokens`` tokens each and one
    sequence of ``max_len`` (the planner's check), state slots included."""
    ps, per_page, per_slot = internals.pool_sizes(cfg, kv, mode, page_size, dtype)
    pages = max(batch * math.ceil(tokens / ps), math.ceil(max_len / ps)) + 2
    slots = (batch + 2) * per_slot  # the engine's slots: one per sequence, sink, scratch
    return ps, pages * per_page + slots + (1 << 24)


def _kv_bytes(cfg, kv, dtype, batch, context, steps, bpt) -> float:
    """Bytes of attention state a step reads beside the weights, at the steps' mean
    context: K/V per token, or DeepSeek-V4's sparse attention and compressor state."""
    if cfg.v4 is None:
        return batch * (context + steps / 2) * bpt
    terms = offline.model_terms(cfg, dtype, kv)
    _, nbytes = offline.v4_sparse_cost(terms["v4_sparse"], batch,
                                       batch * (context + steps / 2 + 1))
    return nbytes + batch * terms["state_rw_bytes"]


def measure(model, kv, mode, batch, contexts, steps, reps, dtype, profile=False, page_size=16,
            gemm_autotune=None, rotation="none", sampler="plain", max_model_len=None,
            loaded=None, batched_tokens=None) -> list[dict]:
    """One engine for ``kv`` / ``mode`` whose pool holds ``batch`` rows of the longest of
    ``contexts`` (an int or a list); one record per context: its decode step timed."""
    from jfp8kv.models.loader import load_model

    contexts = [contexts] if isinstance(contexts, int) else list(contexts)
    loaded = loaded or load_model(model, dtype)
    cfg = loaded.config
    max_len = max_model_len or max(contexts) + steps + page_size
    ps, mem = _pool_memory(cfg, kv, mode, dtype, page_size, batch, max(contexts) + steps,
                           max_len)
    logprobs, features = SAMPLERS[sampler]
    probe = dict(dtype=dtype, kv_cache_dtype=kv, kv_scale_mode=mode,
                 kv_scales=0.05 if mode in ("tensor", "channel") else None, kv_rotation=rotation,
                 max_model_len=max_len, max_num_seqs=batch, decode_steps=steps,
                 page_size=page_size,
                 **({"max_num_batched_tokens": batched_tokens} if batched_tokens else {}),
                 **({"decode_gemm_autotune": gemm_autotune} if gemm_autotune else {}),
                 **({"feature_executables": features} if features else {}))
    llm = LLM(loaded=loaded, **probe, kv_cache_memory=mem, warmup=False)
    internals.fill_cache_random(llm, jax.random.PRNGKey(1))
    slotted = llm.engine.runner.slotted
    out = []
    for context in contexts:
        need = math.ceil((context + steps) / ps)
        rows = [(7 + i, context, list(range(1 + i * need, 1 + (i + 1) * need)),
                 context + steps) + ((i + 1,) if slotted else ()) for i in range(batch)]
        out.append(_time_rows(llm, rows, steps, reps, profile, logprobs))
        bpt = internals.kv_bytes_per_token(cfg, kv, mode, dtype) if cfg.v4 is None else 0
        out[-1].update(
            kv_cache_dtype=kv, kv_scale_mode=mode, kv_rotation=rotation, batch=batch,
            context=context, sampler=sampler, max_model_len=max_len,
            weight_bytes=int(internals.weight_bytes(llm)),
            ideal_weight_bytes=int(offline.weight_bytes(offline.model_terms(cfg, dtype), batch)),
            kv_bytes=int(_kv_bytes(cfg, kv, dtype, batch, context, steps, bpt)),
            bytes_per_token=bpt, decode_steps=steps, reps=reps, page_size=ps,
            decode_gemm_autotune=llm.engine_config.decode_gemm_autotune,
            tokens_per_s=batch / out[-1]["step_ms"] * 1e3)
    del llm
    gc.collect()
    return out


def _time_rows(llm, rows, steps, reps, profile, logprobs) -> dict:
    def dispatch():
        return internals.decode_dispatch(llm, rows, steps, logprobs=logprobs)

    jax.block_until_ready(dispatch())  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(dispatch())
        times.append(time.perf_counter() - t0)
    kernels = profile_dispatch(dispatch, steps) if profile else None
    return dict(step_ms=float(np.median(times)) / steps * 1e3,
                step_ms_all=[t / steps * 1e3 for t in times],
                **({"kernels_per_step": kernels} if kernels else {}))


def summary(records) -> dict:
    """Ratios of step times: each context over the first (same config and max_model_len),
    each max_model_len over the first (same config and context), and fp8 over bf16 (same
    context and max_model_len)."""
    def key(r, *drop):
        mode = r["kv_scale_mode"]
        k = dict(config=r["kv_cache_dtype"] + (f":{mode}" if mode else ""),
                 max_model_len=r["max_model_len"], context=r["context"], sampler=r["sampler"])
        return tuple((n, v) for n, v in k.items() if n not in drop)

    out, first = {}, {}
    for r in records:
        for drop in ("context", "max_model_len"):
            base = first.setdefault((drop,) + key(r, drop), r)
            if base is not r:
                name = dict(key(r))
                out[f"{name['config']}/{drop}/{base[drop]}->{r[drop]}"] = \
                    r["step_ms"] / base["step_ms"]
    bf16 = {key(r, "config"): r for r in records if r["kv_cache_dtype"] == "bfloat16"}
    for r in records:
        b = bf16.get(key(r, "config"))
        if b is not None and r["kv_cache_dtype"].startswith("fp8"):
            out[f"fp8/bf16/{r['context']}/{r['max_model_len']}"] = r["step_ms"] / b["step_ms"]
    return out


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def _print(model, r) -> None:
    print(f"{model} {r['kv_cache_dtype']:9s} {r['kv_scale_mode'] or '-':7s} "
          f"{r['kv_rotation'] or '-':15s} {r['sampler']} S={r['page_size']} B={r['batch']} "
          f"ctx={r['context']} max_len={r['max_model_len']}: step {r['step_ms']:.3f} ms "
          f"({r['tokens_per_s']:,.0f} tok/s), floor {r['floor_ms']:.3f} ms "
          f"({r['step_over_floor']:.2f}x), ideal {r['ideal_ms']:.3f} ms", flush=True)
    k = r.get("kernels_per_step")
    if k and k.get("kernels"):
        print(f"  per step: {k['kernels']:.0f} kernels, busy {k['busy_us']:.0f} us of "
              f"{k['span_us']:.0f} us span; " + ", ".join(
                  f"{n} {v['kernels']:.0f}/{v['us']:.0f} us" for n, v in k["by_kind"].items()),
              flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="random:qwen3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=_ints, default=[8192],
                   help="comma list of contexts (tokens cached per row), timed on one engine")
    p.add_argument("--max-model-len", type=_ints, default=None,
                   help="comma list: one engine each (default: longest context + steps + a "
                        "page)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--configs", default="bfloat16:,fp8_e4m3:token,fp8_e4m3:tensor",
                   help="comma-separated kv_cache_dtype:scale_mode[+kv_rotation][:page_size] "
                        "(page size default 16), e.g. fp8_e4m3:token:32, fp8_e4m3:block+smooth "
                        "(smooth calibrates its K means at start-up)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's prefill budget (its largest prefill is compiled to size "
                        "the pool; nothing here prefills)")
    p.add_argument("--profile", action="store_true",
                   help="also trace one dispatch and summarize its kernels per decode step "
                        "(count, busy vs span, by kind, costliest: bench.profile_trace)")
    p.add_argument("--decode-variant", default=None, metavar="VARIANT",
                   help="fp8 pages: this decode kernel variant instead of the default, e.g. "
                        "pagepf+asm+vmask")
    p.add_argument("--decode-one-wave", choices=("on", "off"), default="on",
                   help="off: the decode kernel splits as before the one-wave rule (A/B)")
    p.add_argument("--split-loop", choices=("on", "off"), default=None,
                   help="the attention kernels' unmasked loop over full tiles "
                        "(Variant.split_loop; default: the kernels' default), for an A/B")
    p.add_argument("--decode-gemm-autotune", choices=GEMM_AUTOTUNE, default=None,
                   help="XLA's GEMM tiling search for the decode step (default: the engine's)")
    p.add_argument("--samplers", default="plain",
                   help="comma list of what every row asks the sampler for, each timed: "
                        + ", ".join(SAMPLERS) + " (log-probs through the switched or the "
                        "per-mix executable: their cost side by side)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds: no engine is built after this (the JSON keeps what ran)")
    p.add_argument("--out", default="bench/results/decode-floor-h200.json")
    args = p.parse_args(argv)
    if bad := sorted(set(args.samplers.split(",")) - set(SAMPLERS)):
        p.error(f"--samplers: unknown {bad}; choose from {', '.join(SAMPLERS)}")
    return args


def main(argv=None) -> int:
    from jfp8kv.models.loader import load_model

    args = parse_args(argv)
    t0 = time.perf_counter()
    override_decode_tuning(args.decode_variant, args.decode_one_wave == "on")
    override_split_loop(None if args.split_loop is None else args.split_loop == "on")
    copy = copy_bandwidth_tbps()
    loaded = load_model(args.model, args.dtype)
    doc = dict(machine=machine_info(), command=command_line(), copy_tbps=copy, floor=[],
               skipped=[])
    for item, max_len, sampler in itertools.product(
            args.configs.split(","), args.max_model_len or [None], args.samplers.split(",")):
        if args.time_limit is not None and time.perf_counter() - t0 > args.time_limit:
            doc["skipped"].append(dict(config=item, max_model_len=max_len, sampler=sampler))
            continue
        kv, mode, *page = item.split(":")
        mode, _, rotation = mode.partition("+")
        for r in measure(args.model, kv, mode or None, args.batch, args.context, args.steps,
                         args.reps, args.dtype, args.profile, int(page[0]) if page else 16,
                         args.decode_gemm_autotune, rotation or "none", sampler, max_len,
                         loaded, args.max_num_batched_tokens):
            r.update(model_shape=args.model, decode_one_wave=args.decode_one_wave,
                     decode_variant=args.decode_variant if kv.startswith("fp8") else None,
                     split_loop=args.split_loop or "default")
            r["floor_ms"] = (r["weight_bytes"] + r["kv_bytes"]) / (copy * 1e12) * 1e3
            r["ideal_ms"] = (r["ideal_weight_bytes"] + r["kv_bytes"]) / (copy * 1e12) * 1e3
            r["step_over_floor"] = r["step_ms"] / r["floor_ms"]
            r["step_over_ideal"] = r["step_ms"] / r["ideal_ms"]
            doc["floor"].append(r)
            _print(args.model, r)
        doc["summary"] = summary(doc["floor"])
        write_result(args.out, doc)  # after every engine: a cut run keeps what it measured
    doc["summary"] = summary(doc["floor"])
    for k, v in doc["summary"].items():
        print(f"  {k}: {v:.3f}")
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
