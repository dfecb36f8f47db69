"""Qwen3.5/3.6 hybrid MoE (transformers' ``qwen3_5_moe``): Gated DeltaNet layers beside
gated full attention, and a sparse MoE with a shared expert in every layer.

Layer ``i`` is linear attention or full attention (``cfg.hybrid.layer_types``; three of every
four are linear in the released models). Full-attention layers go through the paged K/V
cache exactly as the other families do (``transformer.store_and_attend``: every cache dtype
and scale mode), with three differences made outside the kernels:

* q_proj yields, per head, the query and an output gate; the attention output is multiplied
  by sigmoid(gate) before o_proj.
* Partial RoPE (the first ``partial_rotary_factor`` of each head's dims, rotate-half among
  themselves). The kernels rotate pairs (j, j + D/2) over the whole head, so q and k are
  permuted along the head dim such that the rotary pairs land there, and the unrotated dims
  get frequency 0 (cos 1, sin 0: untouched exactly). Scores q.k do not change under one
  permutation of both; V is not permuted. Cached K is in the permuted order.
* RMSNorm weights are zero-centred: x * (1 + w) (decoder norms, q/k norms, final norm).

Linear-attention layers: x -> in_proj_qkv -> causal depthwise conv + SiLU -> q, k, v;
beta = sigmoid(in_proj_b x); g = -exp(A_log) * softplus(in_proj_a x + dt_bias); the gated
delta rule (chunked for prefill, recurrent for a one-token decode); RMSNorm(out) * w *
silu(in_proj_z x); out_proj. Their state lives in a ``DeltaState`` slot per sequence
(``kvcache.state_pool``); a chunk starting at position 0 starts from zeros. The conv and the
delta rule go through ``kernels.deltanet``, which reads and writes each row's slot and picks
the implementation for the backend (the Pallas backends' decode step updates the pools in
place).

Params (weights [in, out]; HF names in ``tensor_specs``)::

    every layer: attn_norm, mlp_norm [D]; router [D, E], experts_gate/up [E, D, I],
        experts_down [E, I, D], shared_gate/up [D, Is], shared_down [Is, D], shared_router [D, 1]
    full attention: wq [D, H*2*hd] (per head: query then gate), wk/wv [D, Hkv*hd],
        wo [H*hd, D], q_norm/k_norm [hd]
    linear attention: w_qkv [D, 2*Hk*dk + Hv*dv], w_z [D, Hv*dv], w_b/w_a [D, Hv],
        conv_w [C, 1, K], dt_bias/A_log [Hv], lin_norm [dv], w_out [Hv*dv, D]
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jfp8kv.config import ModelConfig
from jfp8kv.kernels import deltanet
from jfp8kv.kernels.prologue import QKPrologue, acc_dtype, rms_norm, rope_tables
from jfp8kv.kvcache.cache import KVCache, accumulate_stats, reduce_stat_rows
from jfp8kv.kvcache.state_pool import DeltaState
from jfp8kv.models import moe
from jfp8kv.models.layers import ONE_DEVICE, linear


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.head_dim * cfg.hybrid.partial_rotary_factor)


def rope_layout(cfg: ModelConfig, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(perm int32[hd], inv_freq [hd/2]): the head-dim permutation that puts the rotary pair
    (i, i + R/2) of the first R = rotary_dim dims at (i, i + hd/2), and the full-head
    frequencies (transformers' R-dim frequencies, then zeros for the unrotated dims)."""
    hd, r = cfg.head_dim, rotary_dim(cfg)
    h2, r2 = hd // 2, r // 2
    perm = np.concatenate([np.arange(r2), np.arange(r, r + h2 - r2), np.arange(r2, r),
                           np.arange(r + h2 - r2, hd)]).astype(np.int32)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, r, 2, dtype=np.float64) / r))
    return perm, np.concatenate([inv, np.zeros(h2 - r2)]).astype(dtype)


def _norm(x, w, eps):
    """Zero-centred RMSNorm: normalized x times (1 + w), in the accumulation dtype."""
    return rms_norm(x, 1.0 + w.astype(acc_dtype(x.dtype)), eps)


def _attention(h, lp, layer, ccfg, tables, rows, cfg, backend, par):
    """Gated full attention of h [B, T, D] on the paged cache (its cache step through
    ``par.attend``). Returns (out [B, T, D], updated layer, stats rows)."""
    b, t, _ = h.shape
    n, hd, heads = b * t, cfg.head_dim, cfg.num_heads
    perm, cos, sin = tables
    qg = linear(h, lp["wq"]).reshape(n, heads, 2 * hd)
    q, gate = qg[..., :hd][..., perm], qg[..., hd:]
    k = linear(h, lp["wk"]).reshape(n, cfg.num_kv_heads, hd)[..., perm]
    v = linear(h, lp["wv"]).reshape(n, cfg.num_kv_heads, hd)
    acc = acc_dtype(h.dtype)
    pro = QKPrologue(cos, sin, (1.0 + lp["q_norm"].astype(acc))[perm],
                     (1.0 + lp["k_norm"].astype(acc))[perm], cfg.rms_norm_eps)
    flat_slots, page_tables, seq_lens, positions = rows
    out, layer, st = par.attend(q, k, v, pro, layer, flat_slots, page_tables, seq_lens,
                                positions, ccfg, 1.0 / math.sqrt(hd), backend)
    out = out.reshape(n, heads, hd).astype(h.dtype)
    out = (out.astype(acc) * jax.nn.sigmoid(gate.astype(acc))).astype(h.dtype)
    return linear(out.reshape(b, t, -1), lp["wo"]), layer, st


def conv_and_rule(qkv, conv_w, beta, g, conv_pool, rec_pool, state_slots, n_valid, fresh, *,
                  dk: int, dv: int, backend: str):
    """One DeltaNet layer's state step on its projections: qkv [B, T, C] (q, k, v channels)
    through the causal conv from each row's slot (conv_w [C, K], conv pool [S, K-1, C]),
    split into q, k [B, T, Hk, dk] and v [B, T, Hv, dv] (Hv: beta's heads, Hk what the
    channels leave), then the gated delta rule (g, beta [B, T, Hv]) from the recurrent pool
    [S, Hv, dk, dv]. Returns (out [B, T, Hv, dv], conv pool, recurrent pool). Per value
    head: under tensor parallelism each device runs it on its heads' channels
    (``models/sharding.py`` orders them device by device)."""
    b, t, c = qkv.shape
    hv = beta.shape[-1]
    kd = (c - hv * dv) // 2
    mixed, conv_pool = deltanet.causal_conv(conv_pool, state_slots, qkv, conv_w, n_valid,
                                            fresh, backend)
    q = mixed[..., :kd].reshape(b, t, kd // dk, dk)
    k = mixed[..., kd:2 * kd].reshape(b, t, kd // dk, dk)
    v = mixed[..., 2 * kd:].reshape(b, t, hv, dv)
    out, rec_pool = deltanet.gated_delta_rule(rec_pool, state_slots, q, k, v, g, beta, fresh,
                                              backend)
    return out, conv_pool, rec_pool


def _delta_net(h, lp, conv_pool, rec_pool, state_slots, n_valid, fresh, cfg, backend, par):
    """Gated DeltaNet of h [B, T, D] from the rows' slots of one layer's pools (conv
    [S, K-1, C], recurrent [S, Hv, dk, dv]); ``state_slots`` int32[B], ``n_valid`` int32[B]
    real tokens per row, ``fresh`` bool[B]: the chunk starts the sequence (states read as
    zeros). The state step (``conv_and_rule``) goes through ``par.split`` by value head.
    Returns (out, conv pool, recurrent pool)."""
    hy = cfg.hybrid
    b, t, _ = h.shape
    acc = acc_dtype(h.dtype)
    valid = jnp.arange(t)[None, :, None] < n_valid[:, None, None]
    beta = jnp.where(valid, jax.nn.sigmoid(linear(h, lp["w_b"]).astype(acc)), 0.0)
    a = linear(h, lp["w_a"]).astype(acc) + lp["dt_bias"].astype(acc)
    g = jnp.where(valid, -jnp.exp(lp["A_log"].astype(acc)) * jax.nn.softplus(a), 0.0)
    step = par.split(functools.partial(conv_and_rule, dk=hy.linear_key_head_dim,
                                       dv=hy.linear_value_head_dim, backend=backend),
                     (2, 0, 2, 2, 2, 1, None, None, None), (2, 2, 1))
    out, conv_pool, rec_pool = step(linear(h, lp["w_qkv"]), lp["conv_w"][:, 0, :], beta, g,
                                    conv_pool, rec_pool, state_slots, n_valid, fresh)
    z = linear(h, lp["w_z"]).reshape(b, t, hy.linear_num_value_heads, -1)
    y = rms_norm(out, lp["lin_norm"], cfg.rms_norm_eps)  # weight times the rounded norm
    y = (y.astype(acc) * jax.nn.silu(z.astype(acc))).astype(h.dtype)
    return linear(y.reshape(b, t, hy.value_dim), lp["w_out"]), conv_pool, rec_pool


def _moe(h, lp, cfg, backend):
    """Routed experts (renormalized top-k) plus the sigmoid-gated shared expert (linear in
    the experts' intermediate axis: ``par.mlp`` splits it)."""
    shared = moe.swiglu(h, lp["shared_gate"], lp["shared_up"], lp["shared_down"])
    gate = jax.nn.sigmoid(moe.router_logits(h, lp["shared_router"]))
    shared = (shared.astype(gate.dtype) * gate).astype(h.dtype)
    return moe.qwen3_moe_mlp(h, lp, cfg, backend) + shared


def forward(params: dict, cache: KVCache, state: DeltaState, tokens, positions, slots,
            page_tables, seq_lens, state_slots, *, cfg: ModelConfig,
            backend: str = "reference", par=None):
    """Run the hybrid model over a (possibly padded) chunk of new tokens.

    tokens, positions, slots int32[B, T] as ``transformer.forward`` (slots: the attention
    layers' cache slots; padding lanes in page 0); page_tables int32[B, max_pages];
    seq_lens int32[B]: cached length after the chunk, so row b's real tokens are the first
    seq_lens[b] - positions[b, 0] (the rest is padding, which leaves every state alone);
    state_slots int32[B]: each row's DeltaNet slot (0 for padding rows). ``cache`` holds the
    full-attention layers only, in layer order. Returns (hidden [B, T, D] after the final
    norm, cache, state). Static: cfg, backend. ``par``: the per-device hooks
    (``layers.OneDevice``; ``models/sharding.py`` under tensor parallelism).
    """
    par = par or ONE_DEVICE
    b, t = tokens.shape
    dtype = params["embed"].dtype
    x = params["embed"][tokens]
    perm, inv_freq = rope_layout(cfg)
    cos, sin = rope_tables(positions.reshape(-1), jnp.asarray(inv_freq, acc_dtype(dtype)))
    start = positions[:, 0]
    n_valid = jnp.clip(seq_lens - start, 0, t).astype(jnp.int32)
    rows = (slots.reshape(-1), page_tables, seq_lens, positions)
    new_k, new_v, k_scale, v_scale, stats = [], [], [], [], []
    conv, rec = list(state.conv), list(state.recurrent)
    a_idx = l_idx = 0
    for lp, kind in zip(params["layers"], cfg.hybrid.layer_types):
        h = _norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        if kind == "full_attention":
            y, layer, st = _attention(h, lp, cache.layer(a_idx), cache.config,
                                      (perm, cos, sin), rows, cfg, backend, par)
            new_k.append(layer.k), new_v.append(layer.v), stats.append(st)
            k_scale.append(layer.k_scale), v_scale.append(layer.v_scale)
            a_idx += 1
        else:
            y, conv[l_idx], rec[l_idx] = _delta_net(h, lp, conv[l_idx], rec[l_idx],
                                                    state_slots, n_valid, start == 0, cfg,
                                                    backend, par)
            l_idx += 1
        x = x + y
        x = x + par.mlp(functools.partial(_moe, cfg=cfg, backend=backend),
                        _norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp)
    merged = accumulate_stats(cache.stats, reduce_stat_rows(jnp.stack(stats)))
    cache = KVCache(new_k, new_v, k_scale, v_scale, merged, cache.config, cache.k_shift)
    state = DeltaState(conv, rec, state.config)
    return _norm(x, params["final_norm"], cfg.rms_norm_eps), cache, state


def layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Param shapes of layer ``i`` (random-weight benchmarks; the HF loader checks them)."""
    hy, d, hd = cfg.hybrid, cfg.hidden_size, cfg.head_dim
    si, hv = hy.shared_expert_intermediate_size, hy.linear_num_value_heads
    shapes = dict(attn_norm=(d,), mlp_norm=(d,), **moe.moe_layer_shapes(cfg),
                  shared_gate=(d, si), shared_up=(d, si), shared_down=(si, d),
                  shared_router=(d, 1))
    if hy.layer_types[i] == "full_attention":
        return dict(shapes, wq=(d, cfg.num_heads * 2 * hd), wk=(d, cfg.num_kv_heads * hd),
                    wv=(d, cfg.num_kv_heads * hd), wo=(cfg.num_heads * hd, d), q_norm=(hd,),
                    k_norm=(hd,))
    return dict(shapes, w_qkv=(d, hy.conv_dim), w_z=(d, hy.value_dim), w_b=(d, hv),
                w_a=(d, hv), conv_w=(hy.conv_dim, 1, hy.linear_conv_kernel_dim),
                dt_bias=(hv,), A_log=(hv,), lin_norm=(hy.linear_value_head_dim,),
                w_out=(hy.value_dim, d))


# params key -> transformers' name inside a layer (the MoE's experts: hf_loader._moe_specs)
HF_NAMES = dict(
    attn_norm="input_layernorm.weight", mlp_norm="post_attention_layernorm.weight",
    shared_gate="mlp.shared_expert.gate_proj.weight", shared_up="mlp.shared_expert.up_proj.weight",
    shared_down="mlp.shared_expert.down_proj.weight",
    shared_router="mlp.shared_expert_gate.weight",
    wq="self_attn.q_proj.weight", wk="self_attn.k_proj.weight", wv="self_attn.v_proj.weight",
    wo="self_attn.o_proj.weight", q_norm="self_attn.q_norm.weight",
    k_norm="self_attn.k_norm.weight", w_qkv="linear_attn.in_proj_qkv.weight",
    w_z="linear_attn.in_proj_z.weight", w_b="linear_attn.in_proj_b.weight",
    w_a="linear_attn.in_proj_a.weight", conv_w="linear_attn.conv1d.weight",
    dt_bias="linear_attn.dt_bias", A_log="linear_attn.A_log", lin_norm="linear_attn.norm.weight",
    w_out="linear_attn.out_proj.weight")


def hf_layer_specs(cfg: ModelConfig, n: int, spec) -> list:
    """``spec(name, hf_shape, layer, key, transpose)`` rows for layer ``n`` but its routed
    experts: matrices [in, out] here are HF's [out, in] transposed, the rest as stored."""
    out = []
    for key, shape in layer_shapes(cfg, n).items():
        if key in HF_NAMES:
            mat = len(shape) == 2
            hf_shape = shape[::-1] if mat else shape
            out.append(spec(f"model.layers.{n}.{HF_NAMES[key]}", hf_shape, n, key, mat))
    return out
