"""Decoder-only transformer shared by the Llama, Qwen2 and Qwen3 families.

Family differences are flags on ``ModelConfig`` (``attention_bias`` for Qwen2,
``qk_norm`` for Qwen3, ``rope_scaling`` for Llama 3.x); nothing else differs.

Params pytree (weights stored [in, out], HF linear weights transposed by the loaders)::

    embed [V, D], final_norm [D], lm_head [D, V] (absent when tied),
    layers: list of {attn_norm [D], wq [D, H*hd], wk [D, Hkv*hd], wv [D, Hkv*hd],
                     wo [H*hd, D], mlp_norm [D], w_gate [D, I], w_up [D, I], w_down [I, D],
                     bq/bk/bv [..] (qwen2), q_norm/k_norm [hd] (qwen3)}
    (a routed-expert layer has router/experts_* instead of w_gate/w_up/w_down: models/moe.py)

The model knows nothing about how K/V are stored: it hands the q/k/v projections, with
this layer's q/k norm weights and the chunk's RoPE tables (``kernels.QKPrologue``), to
``kernels.prologue_store_kv`` (which may fuse norm and RoPE into the store) and reads
through ``kernels.paged_attention``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jfp8kv.config import ModelConfig
from jfp8kv.kernels.prologue import QKPrologue, acc_dtype, rms_norm, rope_tables
from jfp8kv.kvcache.cache import KVCache, accumulate_stats, reduce_stat_rows
from jfp8kv.models import moe
from jfp8kv.models.layers import ONE_DEVICE, linear


def rope_inv_freq(cfg: ModelConfig, dtype=np.float32) -> np.ndarray:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is not None:  # Llama 3.x frequency-dependent scaling
        low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = np.where(wl > low_wl, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        inv = np.where(is_mid, mid, scaled)
    return inv.astype(dtype)


def _dense_mlp(h, lp):
    gate = linear(h, lp["w_gate"])
    up = linear(h, lp["w_up"])
    mid = jax.nn.silu(gate.astype(acc_dtype(h.dtype))) * up
    return linear(mid.astype(h.dtype), lp["w_down"])


def forward(params: dict, cache: KVCache, tokens: Int[Array, "b t"],
            positions: Int[Array, "b t"], slots: Int[Array, "b t"],
            page_tables: Int[Array, "b max_pages"], seq_lens: Int[Array, "b"], *,
            cfg: ModelConfig, backend: str = "reference", par=None,
            ) -> tuple[Float[Array, "b t hidden"], KVCache]:
    """Run the model over a (possibly padded) chunk of new tokens.

    tokens, positions, slots: int32[B, T] (padding lanes: slot in page 0);
    page_tables: int32[B, max_pages]; seq_lens: int32[B] cached length after this chunk.
    Returns (hidden [B, T, D] after the final norm, updated cache). Static: cfg, backend.
    ``par``: the per-device hooks (``layers.OneDevice``, the default): each layer's cache
    step goes through ``par.attend`` (``store_and_attend``'s signature) and a routed MLP
    through ``par.mlp`` (tensor parallelism runs them per device: ``models/sharding.py``).
    """
    par = par or ONE_DEVICE
    x = params["embed"][tokens]
    ctx = layer_context(cfg, positions, slots, page_tables, seq_lens, x.dtype)
    new_k, new_v, k_scale, v_scale, stats = [], [], [], [], []
    for i, lp in enumerate(params["layers"]):
        x, layer, st = layer_step(x, lp, cache.layer(i), ctx, cfg=cfg,
                                  cache_cfg=cache.config, backend=backend, par=par)
        new_k.append(layer.k)
        new_v.append(layer.v)
        k_scale.append(layer.k_scale)
        v_scale.append(layer.v_scale)
        stats.append(st)
    # every layer's partial rows reduced at once (two small kernels per layer otherwise)
    merged = accumulate_stats(cache.stats, reduce_stat_rows(jnp.stack(stats)))
    cache = KVCache(new_k, new_v, k_scale, v_scale, merged, cache.config, cache.k_shift)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache


def layer_context(cfg: ModelConfig, positions, slots, page_tables, seq_lens, dtype) -> dict:
    """What every layer of one forward shares: the RoPE tables (computed once), the flat
    slots, the page tables and lengths, the model's dtype (the embedding's)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg, acc_dtype(dtype)))
    cos, sin = rope_tables(positions.reshape(-1), inv_freq)
    return dict(cos=cos, sin=sin, positions=positions, flat_slots=slots.reshape(-1),
                page_tables=page_tables, seq_lens=seq_lens, dtype=dtype)


def layer_step(x, lp: dict, layer, ctx: dict, *, cfg: ModelConfig, cache_cfg, backend: str,
               par=None):
    """One decoder layer: attention through the cache step ``par.attend`` (storing the new
    K/V in ``layer``, a ``LayerKV``) and the MLP (routed through ``par.mlp``) -> (x, the
    layer's new pages and scales, its statistics rows). ``ctx``: ``layer_context``."""
    par = par or ONE_DEVICE
    b, t = x.shape[:2]
    n, hd = b * t, cfg.head_dim
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = linear(h, lp["wq"], lp.get("bq")).reshape(n, cfg.num_heads, hd)
    k = linear(h, lp["wk"], lp.get("bk")).reshape(n, cfg.num_kv_heads, hd)
    v = linear(h, lp["wv"], lp.get("bv")).reshape(n, cfg.num_kv_heads, hd)
    pro = QKPrologue(ctx["cos"], ctx["sin"], lp.get("q_norm") if cfg.qk_norm else None,
                     lp.get("k_norm") if cfg.qk_norm else None, cfg.rms_norm_eps)
    attn, layer, st = par.attend(q, k, v, pro, layer, ctx["flat_slots"], ctx["page_tables"],
                                 ctx["seq_lens"], ctx["positions"], cache_cfg,
                                 1.0 / math.sqrt(hd), backend)
    x = x + linear(attn.reshape(b, t, -1).astype(ctx["dtype"]), lp["wo"])
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    x = x + (par.mlp(functools.partial(moe.qwen3_moe_mlp, cfg=cfg, backend=backend), h, lp)
             if "router" in lp else _dense_mlp(h, lp))
    return x, layer, st


def logits(params, hidden):
    """hidden [..., D] -> float32 logits [..., V] (float64 for float64 compute)."""
    w = params.get("lm_head")
    acc = acc_dtype(hidden.dtype)
    if w is None:
        return jnp.einsum("...d,vd->...v", hidden, params["embed"], preferred_element_type=acc)
    return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=acc)


def layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Param shapes of layer ``layer`` (random-weight presets): attention and the dense MLP,
    or in a routed layer (qwen3_moe) the router and expert stacks instead of the MLP. The
    order is the random keys' order."""
    d, hd, i_sz = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = dict(attn_norm=(d,), wq=(d, cfg.num_heads * hd), wk=(d, cfg.num_kv_heads * hd),
                  wv=(d, cfg.num_kv_heads * hd), wo=(cfg.num_heads * hd, d), mlp_norm=(d,),
                  w_gate=(d, i_sz), w_up=(d, i_sz), w_down=(i_sz, d))
    if cfg.attention_bias:
        shapes.update(bq=(cfg.num_heads * hd,), bk=(cfg.num_kv_heads * hd,),
                      bv=(cfg.num_kv_heads * hd,))
    if cfg.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    if not cfg.is_moe_layer(layer):
        return shapes
    return {**{k: v for k, v in shapes.items() if k not in ("w_gate", "w_up", "w_down")},
            **moe.moe_layer_shapes(cfg)}
