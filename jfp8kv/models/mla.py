"""DeepSeek-V2/V3 multi-head latent attention (MLA) over the latent cache, and its model.

Per layer (r = kv_lora_rank, d_n / d_r = qk_nope / qk_rope head dims, d_v = v_head_dim)::

    q      = q_proj(h)  or  q_b_proj(rmsnorm(q_a_proj(h)))      -> per head [q_nope | q_rope]
    kv     = kv_a_proj_with_mqa(h)                               -> [c_raw (r) | k_rope (d_r)]
    row    = [rmsnorm(c_raw) | RoPE(k_rope)]                     cached: one row per token
    W_UK_h, W_UV_h = split(kv_b_proj) per head                   [d_n, r], [d_v, r]
    scores = (W_UK_h^T q_nope_h) . c + RoPE(q_rope_h) . k_rope   (absorbed: no per-head K)
    out_h  = W_UV_h (softmax(scores * scale) . c)                then o_proj

Prefill, extend and decode all take this absorbed path over the latent pages (the jnp twin
``kernels.mla_reference`` or the Pallas kernel ``kernels.pallas_mla``, by backend; a faster
prefill that expands per-head K/V is open, see docs/lab/mla-moe.md). RoPE: YaRN as
transformers computes it (``YarnScaling``: blended inverse frequencies, cos/sin times the
attention factor, softmax scale times mscale(factor, mscale_all_dim)^2); pairwise (even,
odd) rotation when ``rope_interleave`` (DeepSeek-V2 always), rotate-half otherwise. The
pairwise form is computed as rotate-half of the de-interleaved vector: q and k get the same
permutation, so scores are unchanged.

Params of an MLA layer (weights [in, out])::

    attn_norm, mlp_norm [D]; wq [D, H*(d_n+d_r)] or wq_a [D, q_lora], q_a_norm [q_lora],
    wq_b [q_lora, H*(d_n+d_r)]; wkv_a [D, r+d_r], kv_a_norm [r], wkv_b [r, H*(d_n+d_v)],
    wo [H*d_v, D]; MLP: dense w_gate/w_up/w_down, or DeepSeek MoE (models/moe.py)
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from jfp8kv import kernels
from jfp8kv.config import ModelConfig, YarnScaling
from jfp8kv.kernels.prologue import acc_dtype, rms_norm
from jfp8kv.kvcache.cache import KVCache, accumulate_stats
from jfp8kv.models import moe
from jfp8kv.models.layers import ONE_DEVICE, linear


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig, dtype=np.float32) -> np.ndarray:
    """Inverse frequencies of the qk_rope_head_dim rotation (YaRN-blended when scaled)."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    inv = 1.0 / pos_freqs
    rs = cfg.rope_scaling
    if isinstance(rs, YarnScaling):
        def corr(rot):  # the dimension that turns ``rot`` times over the original context
            return d * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi)) / (
                2 * math.log(base))
        low, high = corr(rs.beta_fast), corr(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = inv / rs.factor * (1 - extrapolation) + inv * extrapolation
    elif rs is not None:
        raise ValueError(f"MLA models support yarn rope scaling only, not {rs!r}")
    return inv.astype(dtype)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 without scaling)."""
    rs = cfg.rope_scaling
    if not isinstance(rs, YarnScaling):
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.mscale and rs.mscale_all_dim:
        return _yarn_mscale(rs.factor, rs.mscale) / _yarn_mscale(rs.factor, rs.mscale_all_dim)
    return _yarn_mscale(rs.factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """(d_n + d_r)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if isinstance(rs, YarnScaling) and rs.mscale_all_dim:
        m = _yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale = scale * m * m
    return scale


def apply_rope(x, positions, inv_freq, factor: float, pairwise: bool):
    """x [B, T, H, d_r], positions [B, T] -> rotated x (rotate-half layout), times ``factor``
    folded into cos/sin. ``pairwise``: rotate (x[2i], x[2i+1]) pairs (de-interleaved first)."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    x32 = x.astype(acc)
    if pairwise:
        x32 = jnp.concatenate([x32[..., 0::2], x32[..., 1::2]], -1)
    ang = positions[..., None].astype(inv_freq.dtype) * inv_freq  # [B, T, d_r/2]
    cos = (jnp.concatenate([jnp.cos(ang)] * 2, -1) * factor)[:, :, None]
    sin = (jnp.concatenate([jnp.sin(ang)] * 2, -1) * factor)[:, :, None]
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rot * sin).astype(x.dtype)


def _queries(h, lp, cfg: ModelConfig):
    """[B, T, H, d_n + d_r] queries of h [B, T, D]."""

    b, t, _ = h.shape
    if "wq" in lp:
        q = linear(h, lp["wq"])
    else:
        q = linear(rms_norm(linear(h, lp["wq_a"]), lp["q_a_norm"], cfg.rms_norm_eps),
                    lp["wq_b"])
    return q.reshape(b, t, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


def store_and_attend_latent(q_abs, rows, pages, scale, flat_slots, page_tables, seq_lens,
                            positions, *, ccfg, sm_scale: float, rank: int, backend: str):
    """One layer's latent cache step: the chunk's rows [N, R] stored at ``flat_slots``,
    then the absorbed queries q_abs [B, T, H, R] attend over the latent pages. Returns
    (latent output [B, T, H, kv_lora_rank], pages, scale, stats row). Per query head: under
    tensor parallelism each device runs it on its heads with every row (the pool is
    replicated, the store the same on every device)."""
    pages, scale, st = kernels.store_latent(pages, scale, rows, flat_slots, ccfg, backend)
    o_lat = kernels.latent_attention(q_abs, pages, scale, page_tables, seq_lens, positions,
                                     ccfg, sm_scale, rank, backend)
    return o_lat, pages, scale, st


def attention(h, lp, layer_pages, layer_scale, positions, flat_slots, page_tables, seq_lens,
              ccfg, cfg: ModelConfig, rope, backend: str = "reference", par=None):
    """One MLA layer's attention on h [B, T, D] (normalized). Stores the chunk's latent rows,
    attends over the latent pages (absorbed) through ``jfp8kv.kernels`` with ``backend``
    (``store_and_attend_latent``, through ``par.split``: split by query head).
    ``rope``: (inv_freq, factor). Returns
    (attention output [B, T, D] before the residual, pages, scale, stats row)."""
    par = par or ONE_DEVICE

    b, t, _ = h.shape
    r, dn, dv, hh = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.num_heads
    acc = acc_dtype(h.dtype)
    q = _queries(h, lp, cfg)
    kv = linear(h, lp["wkv_a"])
    c = rms_norm(kv[..., :r], lp["kv_a_norm"], cfg.rms_norm_eps)
    inv_freq, factor = rope
    q_rope = apply_rope(q[..., dn:], positions, inv_freq, factor, cfg.rope_interleave)
    k_rope = apply_rope(kv[..., None, r:], positions, inv_freq, factor, cfg.rope_interleave)
    rows = jnp.concatenate([c, k_rope[:, :, 0]], -1).reshape(b * t, r + cfg.qk_rope_head_dim)
    w_kv = lp["wkv_b"].reshape(r, hh, dn + dv)
    w_uk, w_uv = w_kv[..., :dn], w_kv[..., dn:]  # [r, H, d_n], [r, H, d_v]
    q_lat = jnp.einsum("bthn,rhn->bthr", q[..., :dn], w_uk, preferred_element_type=acc)
    q_abs = jnp.concatenate([q_lat, q_rope.astype(acc)], -1)
    step = par.split(functools.partial(store_and_attend_latent, ccfg=ccfg, rank=r,
                                       sm_scale=softmax_scale(cfg), backend=backend),
                     (2, None, None, None, None, None, None, None), (2, None, None, None))
    o_lat, pages, scale, st = step(q_abs, rows, layer_pages, layer_scale, flat_slots,
                                   page_tables, seq_lens, positions)
    o = jnp.einsum("bthr,rhv->bthv", o_lat, w_uv.astype(acc), preferred_element_type=acc)
    out = linear(o.reshape(b, t, hh * dv).astype(h.dtype), lp["wo"])
    return out, pages, scale, st


def mlp(h, lp, cfg: ModelConfig, backend: str = "reference", par=None):
    """Dense SwiGLU, or the DeepSeek MoE block (V2 softmax / V3 sigmoid routing) through
    ``par.mlp`` (per device on its slice of every expert); ``backend`` picks its grouped
    matmul (``moe.grouped_experts``)."""
    if "router" not in lp:
        return moe.swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"])
    block = functools.partial(
        moe.deepseek_moe_mlp, version=3 if cfg.family == "deepseek_v3" else 2,
        top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
        topk_method=cfg.topk_method, backend=backend)
    return (par or ONE_DEVICE).mlp(block, h, lp)


def forward(params: dict, cache, tokens, positions, slots, page_tables, seq_lens, *,
            cfg: ModelConfig, backend: str = "reference", par=None):
    """``transformer.forward`` for MLA models (same arguments and result; the cache has the
    latent layout). ``backend`` picks the latent attention kernel (``kernels.latent_attention``:
    ``pallas_mla`` on the Pallas backends); the latent store is the jnp one on every backend.
    ``par``: the per-device hooks (``layers.OneDevice``)."""
    if cache.config.layout != "latent":
        raise ValueError(f"{cfg.family} needs the latent cache layout (CacheConfig.layout="
                         f"'latent'), got {cache.config.layout!r}")
    dtype = params["embed"].dtype
    x = params["embed"][tokens]
    rope = (jnp.asarray(rope_inv_freq(cfg, acc_dtype(dtype))), rope_attention_factor(cfg))
    flat_slots = slots.reshape(-1)
    pages, scales, stats = [], [], []
    for i, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        a, p, s, st = attention(h, lp, cache.k[i], cache.k_scale[i], positions, flat_slots,
                                page_tables, seq_lens, cache.config, cfg, rope, backend, par)
        x = x + a
        x = x + mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp, cfg, backend, par)
        pages.append(p)
        scales.append(s)
        stats.append(st)
    cache = KVCache(pages, [], scales, [], accumulate_stats(cache.stats, jnp.stack(stats)),
                    cache.config)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache


def random_layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Param shapes of MLA layer ``layer`` (random-weight presets): attention, then the
    dense MLP or the DeepSeek MoE (router, experts, shared experts, V3's router bias)."""
    d = cfg.hidden_size
    shapes = attention_shapes(cfg)
    if not cfg.is_moe_layer(layer):
        i_sz = cfg.intermediate_size
        return {**shapes, "w_gate": (d, i_sz), "w_up": (d, i_sz), "w_down": (i_sz, d)}
    si = cfg.n_shared_experts * cfg.moe_intermediate_size
    shapes.update(moe.moe_layer_shapes(cfg), shared_gate=(d, si), shared_up=(d, si),
                  shared_down=(si, d))
    if cfg.family == "deepseek_v3":
        shapes["router_bias"] = (cfg.num_experts,)
    return shapes


def attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Attention param shapes of one MLA layer (and its two norms)."""
    d, hh = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    r = cfg.kv_lora_rank
    shapes = dict(attn_norm=(d,), mlp_norm=(d,), wkv_a=(d, r + cfg.qk_rope_head_dim),
                  kv_a_norm=(r,), wkv_b=(r, hh * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
                  wo=(hh * cfg.v_head_dim, d))
    if cfg.q_lora_rank is None:
        shapes["wq"] = (d, hh * qk)
    else:
        shapes.update(wq_a=(d, cfg.q_lora_rank), q_a_norm=(cfg.q_lora_rank,),
                      wq_b=(cfg.q_lora_rank, hh * qk))
    return shapes
