"""Offline throughput of ``jfp8kv.LLM`` against an ideal time (vLLM's throughput benchmark,
plus a model of what the hardware could do).

    python -m bench.offline --model random:qwen3-0.6b --num-prompts 32 --input-len 512 \\
        --output-len 128 --kv-cache-dtype bfloat16,fp8 [--kv-cache-memory 16e9] [--plot]
    python -m bench.offline --model random:qwen3-tiny --num-prompts 4 --input-len 32 \\
        --output-len 8 --out /tmp/offline.json          # CPU smoke test
    python -m bench.offline --model random:qwen3-8b --num-prompts 200 --input-len 64 \\
        --output-len 256 --eos-after 8:24 --admission greedy,reserve   # early stops, A/B
    python -m bench.offline --plot-only bench/results/offline-h200.json

Workload: ``--num-prompts`` prompts of random token ids (or the lines of ``--dataset``, a
text file, tokenized and cut to ``--input-len``), greedy, ``ignore_eos``, so every request
makes exactly its output length. Lengths follow SGLang's random dataset: with
``--range-ratio r`` each length is drawn uniformly from [max(1, int(L * r)), L] (r = 1,
the default, gives exactly L). ``--prefill-only`` sets every output length to 1: the run is
all prefill (each request's only token is sampled by its last prefill chunk), a TTFT-like
measurement. ``--kv-cache-memory`` (bytes) caps the KV pool, making a run capacity-bound.
One invocation runs every ``--kv-cache-dtype`` of a comma list on the same prompts and the
same loaded weights, and for each every ``--admission`` policy of a comma list (an A/B of
``EngineConfig.admission``: reserve, greedy; default: the engine's) and every
``--feature-executables`` policy of a comma list (an A/B of ``EngineConfig.
feature_executables``: switched, per-mix). ``--logprobs N`` has every request ask for N
log-probs, so its decode runs the features' executables (with ``switched`` the one switched
per shape, with ``per-mix`` the log-prob structure): the two side by side time the switched
decode; without it, plain requests time the two policies' prefill (switched or not; plain
decode is the same executable under both).

``--eos-after LO:HI`` makes requests stop early, as chat does: each still asks for its output
length as max_tokens (what admission and the scheduler see), but ends with EOS as its N-th
token, N drawn per request uniformly from [LO, HI] (``--seed``). Random weights never sample
EOS, so ``bench.internals.eos_after`` puts the EOS id in place of the N-th sampled token and
the engine's own stop rule ends the request (finish reason "stop"). The record gives the
drawn and the realized output lengths, the finish reasons and the admission state when the
timed run starts (``--warmup full`` runs other draws of the same distribution first, so
``reserve`` has learned how far outputs run, as a server has after its first requests).

Warm-up (``--warmup``): ``full`` (default) runs the whole workload once first with other
random tokens of the same lengths (so a prefix cache cannot help the timed run), which
compiles every bucket the timed run uses; ``buckets`` calls ``LLM.warmup()``; ``off``
times a cold engine. The timed run is one pass over ``LLM.generate_stream``.

Each run's record: output and total (prompt + output) tokens per second, TTFT of each
request from the start of the run (mean, median, max), the engine's per-step anatomy
(``jfp8kv.engine.stats.StepStats`` summed over the timed run: host scheduling ms, device ms,
post-processing ms, decode rows, prefill tokens, compiles inside steps) and the compiles the
whole timed run saw, and the ideal time, from the engine's recorded steps and two rates
measured in the same invocation (a bf16 matmul, a device copy):

    ideal = prefill FLOPs / matmul rate + decode bytes / copy bandwidth
    prefill FLOPs = (2 * A + G) * prefill tokens + 2 * D * V * prefill rows
                    + F * causal (query, key) pairs
    decode bytes  = per decode dispatch: iterations * W(B) + K/V tokens read * bytes_per_token
                    + decode tokens * S_rw
    W(B) = (S + D * V + M * X(B) * 3 * D * I_e) * itemsize,   X(B) = E * (1 - (1 - k / E)^B)

Each term is one function below. Per layer, the attention's matmul parameters
(``attention_params``: q/k/v/o; MLA: q or q_a + q_b, kv_a, kv_b, o) and the MLP's
(``mlp_params``: a dense SwiGLU 3 * D * I; a routed layer: the router D * E, the shared
experts 3 * D * n_shared * I_e, and 3 * D * I_e per routed expert). A = active matmul
parameters per token = every layer's attention + dense MLP or (router + shared + k routed
experts); S = the same without the routed experts (what every decode iteration reads
whatever the routing). D, V: hidden size and vocabulary (the logits matmul); M routed
layers, E experts, k experts per token, I_e ``moe_intermediate_size``. F
(``attn_flops_per_pair``) = per layer 4 * H * Dh (scores and values over H query heads of
size Dh), for MLA 2 * H * (r + d_r) + 2 * H * r: the absorbed form the engine runs (scores
over the latent row of r = kv_lora_rank plus d_r RoPE dims, values over the r latent dims;
W_UK / W_UV are applied per token and counted in A through kv_b). An expanded MLA prefill
would need fewer FLOPs per pair; this ideal is that of the absorbed computation.
G (``deltanet_flops``, Qwen3.5/3.6 hybrids; 0 elsewhere) = the gated delta rule's FLOPs per
token over the linear layers, ``bench.deltanet``'s count: L_lin * Hv * 2 * (4 * Dk * Dv +
2 * C * (Dk + Dv)) in the engine's chunks of C = 64 tokens (the state read for u and o, its
update, the in-chunk products); a decode token is charged its recurrent step (C = 0) among
the decode FLOPs of the roofline, and its state slot read and written once among the decode
bytes (``state_rw_bytes``, S_rw per decode token).
bytes_per_token is the cache's bytes per token including scales (for MLA one latent row of
r + d_r per layer). X(B) (``distinct_experts``) is the expected number of distinct experts a
batch of B tokens touches per routed layer **assuming uniform, independent routing** (each
token picks k of E, so an expert is missed by all B with probability (1 - k/E)^B; random
weights route roughly uniformly, trained routers less so); X(1) = k, X(B) -> E. B is a
decode iteration's rows (for a recorded dispatch its decode tokens / iterations). A dense
model has M = 0, A = S = P, the transformer's matmul parameters.

DeepSeek-V4 (``v4_sparse_terms``, ``v4_sparse_cost``): its attention is sparse, so F = 0
and K/V bytes_per_token are not used; instead, for Q queries whose contexts (tokens up to
and including each) sum to C (decode: Q decode tokens, C their K/V tokens; prefill: Q
prefill tokens, C their causal pairs), per layer the window rows min(W * Q, C), per CSA
layer of ratio m the indexer's scores over every closed entry, C / m, and the top-k
entries attended, min(k * Q, C / m), per HCA layer every closed entry, C / m. FLOPs:
4 * H * hd per attended row (scores and values), 2 * nI * dI per indexer score; bytes
(decode only: a prefill chunk's queries share rows): row_bytes (hd values + fp8's hd / 32
fp16 scales) per attended row, 2 * dI (bf16 keys) per indexer score; and every decode token
reads and writes its slot's float32 compressor state once (state_rw_bytes). The min()
terms are exact when every context is at least W (the window) and m * k (the top-k: 2,048
tokens for Flash), an upper bound below; C / m counts an entry's fraction (at most one
entry per query and layer too many).
``actual_over_ideal`` is the wall time over that. ``ideal_roofline_s`` also charges every
dispatch the larger of its FLOPs and bytes terms (prefill reads the weights too, W(prefill
tokens); a large decode batch computes, 2 * (A + D * V) per token + F per pair); it is never
below ``ideal_s`` (up to float rounding).

Writes ``bench/results/offline-<machine>.json`` (``--out``; with ``--append`` the runs are
added to an existing file): machine, versions, exact command, the two rates, the ideal model
(this text's formulas) and one record per run; ``--plot`` writes the PNG beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import statistics
import sys
import time

import numpy as np

from bench import internals
from bench.common import (RESULTS, command_line, copy_bandwidth_tbps, machine_info,
                          matmul_tflops, override_decode_tuning, override_split_loop,
                          reserve_check, write_result)
from jfp8kv.config import ADMISSION_POLICIES, FEATURE_EXECUTABLES, GEMM_AUTOTUNE

DELTANET_CHUNK = 64  # the engine's DeltaNet prefill chunk (``kernels.deltanet.PREFILL_CHUNK``)

IDEAL_MODEL = (
    "ideal_s = prefill_flops / matmul_rate + decode_bytes / copy_bandwidth; prefill_flops = "
    "(2 * A + G) * prefill_tokens + 2 * D * V * prefill_rows + F * causal_pairs; decode_bytes "
    "= sum over decode dispatches of (iterations * W(B) + kv_tokens_read * bytes_per_token + "
    "decode_tokens * S_rw); G = hybrid models' gated delta rule FLOPs per token, linear layers "
    "x Hv x 2 * (4 * Dk * Dv + 2 * 64 * (Dk + Dv)), S_rw = their state slot read and written "
    "once (decode FLOPs of the roofline: the same count with chunk 0); "
    "A = active matmul parameters per token (attention, dense MLPs, routers, shared experts, "
    "k routed experts per routed layer); W(B) = (S + D * V + M * X(B) * 3 * D * I_e) * "
    "itemsize, S = A without the routed experts, M routed layers, X(B) = E * (1 - (1 - k/E)^B)"
    " the expected distinct experts of B rows under uniform routing, B = rows per decode "
    "iteration; F = per layer 4 * H * Dh, MLA (absorbed) 2 * H * (kv_lora_rank + "
    "qk_rope_head_dim) + 2 * H * kv_lora_rank; ideal_roofline_s charges each dispatch "
    "max(flops / matmul_rate, bytes / copy_bandwidth); DeepSeek-V4: A counts its attention's "
    "q-LoRA, shared KV, grouped output, compressors, indexer and mHC maps; its sparse "
    "attention replaces F and bytes_per_token (v4_sparse_cost): for Q queries with contexts "
    "summing to C, per layer min(W * Q, C) window rows, per CSA layer C / m indexer scores "
    "(2 * nI * dI FLOPs, 2 * dI bytes each) and min(k * Q, C / m) attended entries, per HCA "
    "layer C / m attended entries (4 * H * hd FLOPs, row_bytes each); decode bytes also the "
    "float32 compressor state read and written per token")


def machine_slug(info: dict) -> str:
    """'NVIDIA H200' -> 'h200'; a CPU -> 'cpu'."""
    if info["platform"] != "gpu":
        return info["platform"]
    return str(info["device"]).split()[-1].lower().replace("/", "-")


def parse_bytes(text: str | None) -> int | None:
    return None if text is None else int(float(text))


def make_prompts(args, vocab: int, tokenizer, seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, output lengths) for the workload; ``seed`` picks the tokens."""
    rng = np.random.default_rng([args.seed, seed])
    n = args.num_prompts

    def lengths(top: int) -> np.ndarray:
        return rng.integers(max(1, int(top * args.range_ratio)), top + 1, n)

    in_lens = lengths(args.input_len)
    out_lens = np.ones(n, int) if args.prefill_only else lengths(args.output_len)
    if args.dataset:
        with open(args.dataset) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        if not lines:
            raise SystemExit(f"--dataset {args.dataset}: no non-empty lines")
        prompts = [tokenizer.encode(lines[i % len(lines)])[:args.input_len] for i in range(n)]
        prompts = [p or [0] for p in prompts]
    else:
        prompts = [rng.integers(0, vocab, int(t)).tolist() for t in in_lens]
    return prompts, [int(x) for x in out_lens]


def eos_counts(args, n: int, seed: int) -> list[int] | None:
    """``--eos-after LO:HI``: the generated token each of n requests ends with EOS at, drawn
    uniformly from [LO, HI] (``seed`` as make_prompts'); None without the option."""
    if args.eos_after is None:
        return None
    lo, hi = args.eos_after
    return np.random.default_rng([args.seed, seed, 1]).integers(lo, hi + 1, n).tolist()


def length_counts(lengths) -> dict:
    """min, median, mean, max and {length: requests} of a list of output lengths."""
    xs = sorted(int(x) for x in lengths)
    return dict(min=xs[0], median=statistics.median(xs), mean=statistics.fmean(xs), max=xs[-1],
                counts={str(k): xs.count(k) for k in sorted(set(xs))})


def attention_params(cfg) -> int:
    """Matmul parameters of one layer's attention: q, k, v, o; MLA: q (or q_a and q_b),
    kv_a (latent + RoPE key), kv_b (W_UK and W_UV, applied per token when absorbed), o."""
    d, h = cfg.hidden_size, cfg.num_heads
    if cfg.is_mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = d * h * qk if cfg.q_lora_rank is None else cfg.q_lora_rank * (d + h * qk)
        kv_b = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return q + d * cfg.latent_dim + kv_b + h * cfg.v_head_dim * d
    hd = cfg.head_dim
    gate = d * h * hd if cfg.hybrid is not None else 0  # Qwen3.5's output gate in q_proj
    return 2 * d * h * hd + 2 * d * cfg.num_kv_heads * hd + gate


def v4_mixer_params(cfg, layer: int) -> int:
    """Matmul parameters of a DeepSeek-V4 layer's attention and mHC maps: wq_a, wq_b, wkv,
    wo_a (grouped), wo_b, both hc maps; CSA / HCA the compressor (kv + gate); CSA the
    indexer's compressor, query and head weights."""
    v4, d, hd, h = cfg.v4, cfg.hidden_size, cfg.head_dim, cfg.num_heads
    n = v4.hc_mult
    out = (d * cfg.q_lora_rank + cfg.q_lora_rank * h * hd + d * hd + h * hd * v4.o_lora_rank
           + v4.o_groups * v4.o_lora_rank * d + 2 * n * d * (2 + n) * n)
    kind = v4.layer_kind(layer)
    if kind != "window":
        out += 2 * d * (2 * hd if kind == "csa" else hd)
    if kind == "csa":
        di, ni = v4.index_head_dim, v4.index_n_heads
        out += 2 * d * 2 * di + cfg.q_lora_rank * ni * di + d * ni
    return out


def mixer_params(cfg, layer: int) -> int:
    """Matmul parameters of ``layer``'s token mixer: its attention, or for a Qwen3.5/3.6
    Gated DeltaNet layer in_proj_qkv, in_proj_z, in_proj_a/b and out_proj."""
    if cfg.v4 is not None:
        return v4_mixer_params(cfg, layer)
    hy = cfg.hybrid
    if hy is None or hy.layer_types[layer] == "full_attention":
        return attention_params(cfg)
    d = cfg.hidden_size
    return d * (hy.conv_dim + hy.value_dim + 2 * hy.linear_num_value_heads) + hy.value_dim * d


def state_rw_bytes(cfg) -> int:
    """Bytes a Qwen3.5/3.6 decode token moves through its DeltaNet state slot (every linear
    layer's conv and recurrent state read and written once; 0 for other models)."""
    if cfg.hybrid is None:
        return 0
    from jfp8kv.kvcache.state_pool import bytes_per_slot, state_config

    return 2 * bytes_per_slot(state_config(cfg.hybrid, 2))


def deltanet_flops(cfg, chunk: int) -> int:
    """FLOPs per token of a Qwen3.5/3.6 hybrid's gated delta rule over all its linear layers,
    in chunks of ``chunk`` tokens (0: the recurrent decode step): ``bench.deltanet``'s count
    per token and value head times the value heads and the layers; 0 for other models."""
    hy = cfg.hybrid
    if hy is None:
        return 0
    from bench.deltanet import flops_per_token_head

    per_head = flops_per_token_head(hy.linear_key_head_dim, hy.linear_value_head_dim, chunk)
    return len(hy.linear_layers) * hy.linear_num_value_heads * per_head


def mlp_params(cfg, layer: int) -> tuple[int, int]:
    """(matmul parameters every token of ``layer`` uses, parameters of one routed expert):
    a dense SwiGLU (3 * D * I, 0); a routed layer (router D * E + shared experts
    3 * D * n_shared * I_e, 3 * D * I_e)."""
    d = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 3 * d * cfg.intermediate_size, 0
    i_e = cfg.moe_intermediate_size
    shared = 3 * d * cfg.n_shared_experts * i_e
    if cfg.hybrid is not None:  # one shared expert of its own width, and its sigmoid gate
        shared = 3 * d * cfg.hybrid.shared_expert_intermediate_size + d
    return d * cfg.num_experts + shared, 3 * d * i_e


def attn_flops_per_pair(cfg) -> int:
    """Attention FLOPs per causal (query, key) pair over all layers: 4 * H * Dh per layer;
    MLA, absorbed: 2 * H * (r + d_r) for scores over latent rows + 2 * H * r for values."""
    h = cfg.num_heads
    if cfg.v4 is not None:
        return 0  # sparse: v4_sparse_cost counts it instead
    if cfg.is_mla:
        return cfg.num_layers * (2 * h * cfg.latent_dim + 2 * h * cfg.kv_lora_rank)
    layers = cfg.num_layers if cfg.hybrid is None else len(cfg.hybrid.attention_layers)
    return layers * 4 * h * cfg.head_dim


def v4_sparse_terms(cfg, kv_cache_dtype: str) -> dict:
    """DeepSeek-V4's sparse-attention terms (module docstring) for pools of
    ``kv_cache_dtype`` ("bfloat16", "float8_e4m3fn", "fp8_e4m3", ...): window W, layers,
    each CSA / HCA layer's ratio, the top-k, FLOPs per attended row and per indexer score,
    bytes per row and per indexer key, and the compressor state a decode token reads and
    writes."""
    from jfp8kv.kvcache import v4_pools

    v4 = cfg.v4
    spec = v4_pools.V4PoolSpec.from_model(cfg, kv_cache_dtype, max(v4.compress_ratios))
    kinds = [v4.layer_kind(i) for i in range(cfg.num_layers)]
    return dict(window=v4.sliding_window, layers=cfg.num_layers, topk=v4.index_topk,
                csa_ratios=[v4.compress_ratios[i] for i, k in enumerate(kinds) if k == "csa"],
                hca_ratios=[v4.compress_ratios[i] for i, k in enumerate(kinds) if k == "hca"],
                row_flops=4 * cfg.num_heads * cfg.head_dim,
                index_flops=2 * v4.index_n_heads * v4.index_head_dim,
                row_bytes=spec.row_bytes(), index_bytes=2 * v4.index_head_dim,
                state_rw_bytes=2 * spec.state_bytes_per_slot())


def v4_sparse_cost(sp: dict, queries: float, context: float) -> tuple[float, float]:
    """(FLOPs, bytes) of V4's sparse attention for ``queries`` queries whose contexts sum
    to ``context`` tokens (``v4_sparse_terms``' ``sp``; module docstring)."""
    rows = min(sp["window"] * queries, context) * sp["layers"]
    scores = 0.0
    for m in sp["csa_ratios"]:
        scores += context / m
        rows += min(sp["topk"] * queries, context / m)
    rows += sum(context / m for m in sp["hca_ratios"])
    return (rows * sp["row_flops"] + scores * sp["index_flops"],
            rows * sp["row_bytes"] + scores * sp["index_bytes"])


def distinct_experts(num_experts: int, top_k: int, rows: float) -> float:
    """Expected distinct experts that ``rows`` tokens touch in one routed layer when each
    token picks ``top_k`` of ``num_experts`` uniformly and independently (the ideal
    model's assumption): E * (1 - (1 - k/E)^B). Equals k at B = 1, tends to E."""
    if num_experts == 0 or rows <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def model_terms(cfg, dtype: str, kv_cache_dtype: str | None = None) -> dict:
    """The architecture's numbers the ideal model needs (see the module docstring):
    ``matmul_params`` A (active per token), ``static_params`` S, ``total_params`` (every
    expert), ``expert_params`` (one routed expert), ``logits_params`` D * V; DeepSeek-V4
    also ``v4_sparse`` (``v4_sparse_terms`` of its pools' ``kv_cache_dtype``, default
    bf16) and its compressor state as ``state_rw_bytes``."""
    import jax.numpy as jnp

    mlps = [mlp_params(cfg, i) for i in range(cfg.num_layers)]
    moe_layers = sum(1 for _, e in mlps if e)
    expert = max((e for _, e in mlps), default=0)
    static = sum(mixer_params(cfg, i) for i in range(cfg.num_layers)) + sum(s for s, _ in mlps)
    k = cfg.num_experts_per_tok if moe_layers else 0
    terms = dict(matmul_params=static + moe_layers * k * expert, static_params=static,
                 total_params=static + moe_layers * cfg.num_experts * expert,
                 expert_params=expert, moe_layers=moe_layers, num_experts=cfg.num_experts,
                 experts_per_tok=k, logits_params=cfg.hidden_size * cfg.vocab_size,
                 itemsize=jnp.dtype(dtype).itemsize,
                 attn_flops_per_pair=attn_flops_per_pair(cfg), state_rw_bytes=state_rw_bytes(cfg),
                 deltanet_prefill_flops=deltanet_flops(cfg, DELTANET_CHUNK),
                 deltanet_decode_flops=deltanet_flops(cfg, 0))
    if cfg.v4 is not None:
        sp = v4_sparse_terms(cfg, kv_cache_dtype or "bfloat16")
        terms.update(v4_sparse=sp, state_rw_bytes=sp["state_rw_bytes"])
    return terms


def weight_bytes(terms: dict, rows: float) -> float:
    """W(B): weight bytes one forward iteration over ``rows`` tokens reads: the static and
    logits weights plus the routed experts those tokens are expected to touch."""
    experts = terms["moe_layers"] * terms["expert_params"] * distinct_experts(
        terms["num_experts"], terms["experts_per_tok"], rows)
    return (terms["static_params"] + terms["logits_params"] + experts) * terms["itemsize"]


def prefill_flops(terms: dict, tokens: int, chunks: int, pairs: int) -> float:
    """FLOPs of prefilling ``tokens`` in ``chunks`` chunks (one sampled logits row each) over
    ``pairs`` causal (query, key) pairs, the DeltaNet layers' delta rule included."""
    per_token = 2 * terms["matmul_params"] + terms.get("deltanet_prefill_flops", 0)
    return (per_token * tokens + 2 * terms["logits_params"] * chunks
            + terms["attn_flops_per_pair"] * pairs)


def ideal_time(records, terms: dict, bytes_per_token: int, tflops: float, tbps: float) -> dict:
    """The ideal model over the engine's recorded steps (``StepRecord`` list)."""
    rate, bw = tflops * 1e12, tbps * 1e12
    pf = db = df = 0.0
    roof = 0.0
    for r in records:
        f = prefill_flops(terms, r.prefill_tokens, r.prefill_chunks, r.prefill_pairs)
        rows = r.decode_tokens / r.decode_iterations if r.decode_iterations else 0
        g = ((2 * (terms["matmul_params"] + terms["logits_params"])
              + terms.get("deltanet_decode_flops", 0)) * r.decode_tokens
             + terms["attn_flops_per_pair"] * r.decode_kv_tokens)
        attn = r.decode_kv_tokens * bytes_per_token
        if "v4_sparse" in terms:  # V4: sparse attention instead of F and K/V bytes
            f += v4_sparse_cost(terms["v4_sparse"], r.prefill_tokens, r.prefill_pairs)[0]
            sf, attn = v4_sparse_cost(terms["v4_sparse"], r.decode_tokens, r.decode_kv_tokens)
            g += sf
        b = (r.decode_iterations * weight_bytes(terms, rows) + attn
             + r.decode_tokens * terms.get("state_rw_bytes", 0))
        pf, db, df = pf + f, db + b, df + g
        if r.prefill_chunks:
            roof += max(f / rate, weight_bytes(terms, r.prefill_tokens) / bw)
        if r.decode_rows:
            roof += max(b / bw, g / rate)
    return dict(prefill_flops=pf, prefill_s=pf / rate, decode_bytes=db, decode_s=db / bw,
                decode_flops=df, ideal_s=pf / rate + db / bw, ideal_roofline_s=roof)


def ideal_schedule(in_lens, out_lens, batch: int, terms: dict, bytes_per_token: int,
                   tflops: float, tbps: float) -> dict:
    """The ideal model over the best schedule rather than the engine's recorded one: every
    prompt prefilled at the matmul rate, then decode in waves of ``batch`` requests (the most
    that run at once: max_num_seqs, and what the pool holds), each wave running its longest
    output's iterations, every iteration reading the weights its live rows need, W(rows),
    plus their live K/V."""
    rate, bw = tflops * 1e12, tbps * 1e12
    sp = terms.get("v4_sparse")
    pf = sum(prefill_flops(terms, p, 1, p * (p + 1) / 2)
             + (v4_sparse_cost(sp, p, p * (p + 1) / 2)[0] if sp else 0) for p in in_lens)
    db = 0.0
    for w in range(0, len(in_lens), batch):
        rows = list(zip(in_lens[w:w + batch], out_lens[w:w + batch]))
        for j in range(1, max(o for _, o in rows)):
            live = [p + j for p, o in rows if j < o]
            kv = (sum(v4_sparse_cost(sp, 1, c)[1] for c in live) if sp
                  else sum(live) * bytes_per_token)
            db += (weight_bytes(terms, len(live)) + kv
                   + len(live) * terms.get("state_rw_bytes", 0))
    return dict(batch=batch, prefill_s=pf / rate, decode_s=db / bw, ideal_s=pf / rate + db / bw)


def timed_generate(llm, prompts, out_lens, logprobs: int | None = None,
                   eos_at: list[int] | None = None) -> dict:
    """One pass of ``generate_stream`` (greedy; ``logprobs`` per token if given); wall time,
    per-request TTFT, tokens, preemptions. ``ignore_eos`` unless ``eos_at`` gives each
    request's EOS position (``--eos-after``): then EOS ends them there
    (``internals.eos_after``)."""
    from jfp8kv import SamplingParams
    from jfp8kv.engine.stats import compile_count

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=eos_at is None,
                             logprobs=logprobs)
              for n in out_lens]
    first, final = {}, {}
    c0, s0 = compile_count()
    t0 = time.perf_counter()
    with internals.eos_after(llm, eos_at) if eos_at else contextlib.nullcontext({}) as stop_at:
        for out in llm.generate_stream(prompts, params):
            now = time.perf_counter() - t0
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                final[out.request_id] = out
    elapsed = time.perf_counter() - t0
    c1, s1 = compile_count()
    ttft = sorted(first.values())
    outs = list(final.values())
    return dict(elapsed_s=elapsed, ttft=ttft, outputs=outs, compiles_in_run=c1 - c0,
                compile_s_in_run=s1 - s0, eos_at=[stop_at.get(o.request_id) for o in outs])


def run_one(args, loaded, kv: str, rates: dict, admission: str | None = None,
            features: str | None = None) -> dict:
    """Build an LLM for one KV dtype (and admission and feature-executables policies, None:
    the engine's), warm it up, time the workload, and make its record."""
    from jfp8kv import LLM

    kw = dict(loaded=loaded, dtype=args.dtype, kv_cache_dtype=kv,
              kv_scale_mode=args.kv_scale_mode if kv.startswith("fp8") else None,
              kv_cache_memory=parse_bytes(args.kv_cache_memory), seed=args.seed,
              attention_backend=args.attention_backend, decode_steps=args.decode_steps,
              tensor_parallel_size=args.tensor_parallel_size,
              warmup=False)  # --warmup decides (build_s stays the build alone)
    if args.overlap_scheduling is not None:
        kw["overlap_scheduling"] = args.overlap_scheduling == "on"
    if admission is not None:
        kw["admission"] = admission
    if features is not None:
        kw["feature_executables"] = features
    for name in ("max_num_seqs", "max_num_batched_tokens", "decode_gemm_autotune"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    cfg = loaded.config
    prompts, out_lens = make_prompts(args, cfg.vocab_size, loaded.tokenizer, 0)
    kw["max_model_len"] = args.max_model_len or max(map(len, prompts)) + max(out_lens)
    t = time.perf_counter()
    llm = LLM(**kw)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    if args.warmup == "full":
        timed_generate(llm, *make_prompts(args, cfg.vocab_size, loaded.tokenizer, 1),
                       args.logprobs, eos_counts(args, len(prompts), 1))
    elif args.warmup == "buckets":
        llm.warmup(progress=False)
    warmup_s = time.perf_counter() - t
    admission_at_start = internals.admission_state(llm)
    stats = internals.step_stats(llm)
    stats.reset()
    stats.enable()
    run = timed_generate(llm, prompts, out_lens, args.logprobs,
                         eos_counts(args, len(prompts), 0))
    stats.enable(False)
    ec = llm.engine_config
    info = dict(llm.cache_info(), max_num_seqs=ec.max_num_seqs,
                max_num_batched_tokens=ec.max_num_batched_tokens, decode_steps=ec.decode_steps)
    rec = make_record(args, kv, info, run, stats,
                      model_terms(cfg, args.dtype, info["kv_cache_dtype"]), rates)
    rec.update(build_s=round(build_s, 3), warmup=args.warmup, warmup_s=round(warmup_s, 3),
               decode_one_wave=args.decode_one_wave, split_loop=args.split_loop or "default",
               decode_gemm_autotune=ec.decode_gemm_autotune, admission=ec.admission,
               feature_executables=ec.feature_executables, logprobs=args.logprobs,
               admission_at_start=admission_at_start, **early_stops(args, run))
    # the allocator's peak is the process's: with several runs per process only the first
    # run's check is about that run alone
    rec["device_memory"] = llm.engine.runner.device_memory()
    rec["memory_check"] = reserve_check(info.get("memory_plan", {}), rec["device_memory"])
    del llm
    gc.collect()
    return rec


def early_stops(args, run) -> dict:
    """The record's ``--eos-after`` fields: the option, the drawn and realized output
    lengths, the requests whose output ended at its drawn length, the finish reasons."""
    outs = run["outputs"]
    reasons = [o.finish_reason for o in outs]
    out = dict(eos_after=None if args.eos_after is None else "%d:%d" % args.eos_after,
               generated_tokens=length_counts(len(o.token_ids) for o in outs),
               finish_reasons={r: reasons.count(r) for r in sorted(set(reasons))})
    if args.eos_after is not None:
        out.update(eos_drawn=length_counts(run["eos_at"]), ended_as_drawn=sum(
            len(o.token_ids) == n for o, n in zip(outs, run["eos_at"])))
    return out


def make_record(args, kv, info, run, stats, terms, rates) -> dict:
    outs = run["outputs"]
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    el = run["elapsed_s"]
    ideal = ideal_time(stats.records, terms, info["bytes_per_token"], rates["matmul_tflops"],
                       rates["copy_tbps"])
    in_lens = [len(o.prompt_token_ids) for o in outs]
    fits = info["max_tokens"] // max(p + len(o.token_ids) for p, o in zip(in_lens, outs))
    best = ideal_schedule(in_lens, [len(o.token_ids) for o in outs],
                          max(1, min(len(outs), info["max_num_seqs"], fits)), terms,
                          info["bytes_per_token"], rates["matmul_tflops"], rates["copy_tbps"])
    anatomy = stats.summary()
    anatomy["other_ms"] = round(el * 1e3 - anatomy["schedule_ms"] - anatomy["device_ms"]
                                - anatomy["post_ms"], 3)
    anatomy["max_decode_rows"] = max((r.decode_rows for r in stats.records), default=0)
    ttft = run["ttft"] or [float("nan")]
    return dict(
        model=args.model, dtype=args.dtype, kv_cache_dtype=info["kv_cache_dtype"],
        kv_cache_dtype_arg=kv, kv_scale_mode=info["kv_scale_mode"],
        num_prompts=len(outs), input_len=args.input_len,
        output_len=1 if args.prefill_only else args.output_len, range_ratio=args.range_ratio,
        prefill_only=args.prefill_only, dataset=args.dataset,
        max_model_len=info["max_model_len"], max_num_seqs=info["max_num_seqs"],
        max_num_batched_tokens=info["max_num_batched_tokens"],
        decode_steps=info["decode_steps"], kv_cache_memory=info["kv_cache_memory"],
        num_pages=info["num_pages"], max_tokens=info["max_tokens"],
        bytes_per_token=info["bytes_per_token"], attention_backend=info["attention_backend"],
        total_input_tokens=n_in, total_output_tokens=n_out, elapsed_s=el,
        output_throughput=n_out / el, total_throughput=(n_in + n_out) / el,
        request_throughput=len(outs) / el, mean_ttft_ms=statistics.fmean(ttft) * 1e3,
        median_ttft_ms=statistics.median(ttft) * 1e3, max_ttft_ms=max(ttft) * 1e3,
        preemptions=sum(o.num_preemptions for o in outs),
        compiles_in_run=run["compiles_in_run"],
        compile_s_in_run=round(run["compile_s_in_run"], 3),
        anatomy=anatomy, model_terms=terms, ideal=ideal,
        actual_over_ideal=el / ideal["ideal_s"] if ideal["ideal_s"] > 0 else float("nan"),
        ideal_schedule=best, actual_over_ideal_schedule=el / best["ideal_s"],
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def versions() -> dict:
    import importlib.metadata

    out = {}
    for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    import jfp8kv

    out["jfp8kv"] = jfp8kv.__version__
    return out


def summary_line(r: dict) -> str:
    a = r["anatomy"]
    padded = a.get("prefill_slots", 0) / max(1, a["prefill_tokens"])  # 0: not recorded
    features = r.get("feature_executables", "")
    lp = "" if r.get("logprobs") is None else f" logprobs {r['logprobs']}"
    return (f"{r['model']} {r['kv_cache_dtype']:9s} {r.get('admission', '')} {features}{lp} "
            f"{r['num_prompts']}x{r['input_len']}/"
            f"{r['output_len']}: {r['output_throughput']:,.0f} out tok/s, "
            f"{r['total_throughput']:,.0f} total tok/s, {r['elapsed_s']:.3f} s = "
            f"{r['actual_over_ideal']:.2f}x ideal {r['ideal']['ideal_s']:.3f} s, "
            f"{r['actual_over_ideal_schedule']:.2f}x best-schedule ideal "
            f"{r['ideal_schedule']['ideal_s']:.3f} s; steps "
            f"{a['steps']} (sched {a['schedule_ms']:.0f} ms, device {a['device_ms']:.0f} ms, "
            f"post {a['post_ms']:.0f} ms), max rows {a['max_decode_rows']}, prefill "
            f"{a.get('prefill_calls', 0)} dispatches ({padded:.2f}x padded), compiles "
            f"{r['compiles_in_run']}, preemptions {r['preemptions']}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="bfloat16,fp8",
                   help="comma list, run in order on the same prompts")
    p.add_argument("--kv-scale-mode", default=None, help="fp8 runs (default: the engine's)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=1.0)
    p.add_argument("--dataset", default=None, help="text file: one prompt per non-empty line")
    p.add_argument("--prefill-only", action="store_true", help="output length 1 (TTFT-like)")
    p.add_argument("--eos-after", default=None, metavar="LO:HI",
                   help="each request ends with EOS after a drawn N in [LO, HI] generated "
                        "tokens, max_tokens unchanged (default: ignore_eos, full length)")
    p.add_argument("--kv-cache-memory", default=None, help="KV pool bytes (e.g. 16e9)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: longest prompt + longest output")
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs the model runs over (the ideal times stay one device's)")
    p.add_argument("--overlap-scheduling", choices=("on", "off"), default=None,
                   help="the engine's overlap scheduling (default: the engine's default)")
    p.add_argument("--admission", default=None,
                   help="comma list of EngineConfig.admission policies (reserve, greedy), each "
                        "run per --kv-cache-dtype on the same weights (default: the engine's)")
    p.add_argument("--feature-executables", default=None,
                   help="comma list of EngineConfig.feature_executables policies (switched, "
                        "per-mix), each run per --kv-cache-dtype and --admission on the same "
                        "weights (default: the engine's)")
    p.add_argument("--logprobs", type=int, default=None,
                   help="every request asks for N log-probs per token (default: none)")
    p.add_argument("--warmup", choices=("full", "buckets", "off"), default="full")
    p.add_argument("--decode-gemm-autotune", choices=GEMM_AUTOTUNE, default=None,
                   help="XLA's GEMM tiling search for the decode step (default: the engine's)")
    p.add_argument("--decode-one-wave", choices=("on", "off"), default="on",
                   help="off: the decode kernel splits as before the one-wave rule (A/B)")
    p.add_argument("--split-loop", choices=("on", "off"), default=None,
                   help="the attention kernels' unmasked loop over full tiles "
                        "(Variant.split_loop; default: the kernels' default), for an A/B")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default: bench/results/offline-<machine>.json")
    p.add_argument("--append", action="store_true", help="add the runs to an existing --out")
    p.add_argument("--plot", action="store_true", help="also write the PNG beside the JSON")
    p.add_argument("--plot-only", default=None, metavar="JSON", help="plot a result file")
    args = p.parse_args(argv)
    if not 0 < args.range_ratio <= 1:
        p.error("--range-ratio must be in (0, 1]")
    if min(args.num_prompts, args.input_len, args.output_len) < 1:
        p.error("--num-prompts, --input-len and --output-len must be >= 1")
    if args.eos_after is not None:
        args.eos_after = parse_range(p, args.eos_after, args.prefill_only)
    bad = set((args.admission or "reserve").split(",")) - set(ADMISSION_POLICIES)
    if bad:
        p.error(f"--admission: unknown {sorted(bad)}; choose from {list(ADMISSION_POLICIES)}")
    bad = set((args.feature_executables or "switched").split(",")) - set(FEATURE_EXECUTABLES)
    if bad:
        p.error(f"--feature-executables: unknown {sorted(bad)}; choose from "
                f"{list(FEATURE_EXECUTABLES)}")
    return args


def parse_range(p, text: str, prefill_only: bool) -> tuple[int, int]:
    """--eos-after LO:HI -> (LO, HI), 1 <= LO <= HI."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        p.error(f"--eos-after {text!r}: give LO:HI, two integers (e.g. 8:24)")
    if not 1 <= lo <= hi:
        p.error(f"--eos-after {text!r}: need 1 <= LO <= HI")
    if prefill_only:
        p.error("--eos-after and --prefill-only: a prefill-only request makes one token")
    return lo, hi


def main(argv=None) -> int:
    args = parse_args(argv)
    command = command_line(__spec__.name if __spec__ else "bench.offline", argv)
    if args.plot_only:
        plot(args.plot_only)
        return 0
    from jfp8kv.models.loader import load_model

    override_decode_tuning(one_wave=args.decode_one_wave == "on")
    override_split_loop(None if args.split_loop is None else args.split_loop == "on")
    machine = machine_info()
    out = args.out or os.path.join(RESULTS, f"offline-{machine_slug(machine)}.json")
    rates = {"matmul_tflops": matmul_tflops(), "copy_tbps": copy_bandwidth_tbps()}
    print(f"measured: bf16 matmul {rates['matmul_tflops']:.3g} TFLOP/s, copy "
          f"{rates['copy_tbps']:.3g} TB/s", flush=True)
    doc = {"machine": machine, "versions": versions(), "commands": [], "rates": [],
           "ideal_model": IDEAL_MODEL, "runs": []}
    if args.append and os.path.exists(out):
        with open(out) as f:
            doc = json.load(f)
    doc["commands"].append(command)
    doc["rates"].append(rates)
    loaded = load_model(args.model, args.dtype, args.tensor_parallel_size)
    policies = [a.strip() for a in args.admission.split(",")] if args.admission else [None]
    features = ([f.strip() for f in args.feature_executables.split(",")]
                if args.feature_executables else [None])
    for kv in args.kv_cache_dtype.split(","):
        for admission, feature in itertools.product(policies, features):
            rec = run_one(args, loaded, kv.strip(), rates, admission, feature)
            rec.update(rates=rates, command=command,
                       tensor_parallel_size=args.tensor_parallel_size)
            doc["runs"].append(rec)
            print(summary_line(rec), flush=True)
            write_result(out, doc)  # after every run: a run cut short keeps what it measured
    print(f"wrote {out}")
    if args.plot:
        plot(out)
    return 0


def plot(path: str) -> None:
    """Per run: wall time split into the step anatomy beside the ideal time's two terms;
    and output throughput. Writes PATH with .png for .json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        runs = json.load(f)["runs"]
    labels = [f"{r['model'].split(':')[-1]}\n{r['num_prompts']}x{r['input_len']}/"
              f"{r['output_len']}\n{r['kv_cache_dtype']}" for r in runs]
    x = np.arange(len(runs))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(runs) + 4), 4.8))
    bottom = np.zeros(len(runs))
    for key, name in (("schedule_ms", "host scheduling"), ("device_ms", "device (+dispatch)"),
                      ("post_ms", "post-processing"), ("other_ms", "outside steps")):
        v = np.array([max(r["anatomy"][key], 0) / 1e3 for r in runs])
        ax.bar(x - 0.2, v, 0.4, bottom=bottom, label=name)
        bottom += v
    pre = np.array([r["ideal"]["prefill_s"] for r in runs])
    dec = np.array([r["ideal"]["decode_s"] for r in runs])
    ax.bar(x + 0.2, pre, 0.4, color="0.55", label="ideal: prefill FLOPs")
    ax.bar(x + 0.2, dec, 0.4, bottom=pre, color="0.8", label="ideal: decode bytes")
    for i, r in enumerate(runs):
        ax.text(i, bottom[i], f"{r['actual_over_ideal']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("whole run vs ideal (label: actual / ideal)")
    ax.legend(fontsize=7)
    ax2.bar(x, [r["output_throughput"] for r in runs])
    ax2.set_xticks(x, labels, fontsize=7)
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("output throughput")
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
