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

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jfp8kv import kernels
from jfp8kv.config import ModelConfig
from jfp8kv.kernels.prologue import QKPrologue, acc_dtype, rms_norm, rope_tables
from jfp8kv.kvcache.cache import KVCache, accumulate_stats, reduce_stat_rows
from jfp8kv.models import moe


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


def _linear(x, w, b=None):
    acc = acc_dtype(x.dtype)
    y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=acc)
    if b is not None:
        y = y + b.astype(acc)
    return y.astype(x.dtype)


def _dense_mlp(h, lp):
    gate = _linear(h, lp["w_gate"])
    up = _linear(h, lp["w_up"])
    mid = jax.nn.silu(gate.astype(acc_dtype(h.dtype))) * up
    return _linear(mid.astype(h.dtype), lp["w_down"])


def store_and_attend(q, k_new, v_new, pro: QKPrologue, layer, slots, page_tables, seq_lens,
                     positions, ccfg, sm_scale: float, backend: str):
    """One layer's cache step for the chunk's projections q [N, H, hd], k/v [N, Hkv, hd]
    (N = B * T): q/k norm and RoPE (``pro``) and the K/V store at ``slots``, then attention
    of the queries [B, T, H, hd] over the paged context. Returns (out [B, T, H, hd],
    updated layer, partial stats rows [R, 6]: ``kernels.prologue_store_kv``)."""
    q, layer, st = kernels.prologue_store_kv(q, k_new, v_new, pro, layer, slots, ccfg, backend)
    q = q.reshape(*positions.shape, *q.shape[1:])
    out = kernels.paged_attention(q, layer, page_tables, seq_lens, positions, ccfg, sm_scale,
                                  backend)
    return out, layer, st


def forward(params: dict, cache: KVCache, tokens: Int[Array, "b t"],
            positions: Int[Array, "b t"], slots: Int[Array, "b t"],
            page_tables: Int[Array, "b max_pages"], seq_lens: Int[Array, "b"], *,
            cfg: ModelConfig, backend: str = "reference", attend: Callable | None = None,
            ) -> tuple[Float[Array, "b t hidden"], KVCache]:
    """Run the model over a (possibly padded) chunk of new tokens.

    tokens, positions, slots: int32[B, T] (padding lanes: slot in page 0);
    page_tables: int32[B, max_pages]; seq_lens: int32[B] cached length after this chunk.
    Returns (hidden [B, T, D] after the final norm, updated cache). Static: cfg, backend.
    ``attend``: ``store_and_attend`` (the default) or a caller's wrapper of it with the same
    signature (tensor parallelism runs it per device: ``models/sharding.py``).
    """
    if cfg.is_mla:  # DeepSeek-V2/V3: latent cache and absorbed attention
        from jfp8kv.models import mla

        return mla.forward(params, cache, tokens, positions, slots, page_tables, seq_lens,
                           cfg=cfg, backend=backend)
    attend = attend or store_and_attend
    b, t = tokens.shape
    dtype = params["embed"].dtype
    x = params["embed"][tokens]
    inv_freq = jnp.asarray(rope_inv_freq(cfg, acc_dtype(dtype)))
    cos, sin = rope_tables(positions.reshape(-1), inv_freq)  # once for every layer
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    flat_slots = slots.reshape(-1)
    n, hd = b * t, cfg.head_dim
    new_k, new_v, k_scale, v_scale, stats = [], [], [], [], []
    for i, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q = _linear(h, lp["wq"], lp.get("bq")).reshape(n, cfg.num_heads, hd)
        k = _linear(h, lp["wk"], lp.get("bk")).reshape(n, cfg.num_kv_heads, hd)
        v = _linear(h, lp["wv"], lp.get("bv")).reshape(n, cfg.num_kv_heads, hd)
        pro = QKPrologue(cos, sin, lp.get("q_norm") if cfg.qk_norm else None,
                         lp.get("k_norm") if cfg.qk_norm else None, cfg.rms_norm_eps)
        attn, layer, st = attend(q, k, v, pro, cache.layer(i), flat_slots, page_tables,
                                 seq_lens, positions, cache.config, sm_scale, backend)
        x = x + _linear(attn.reshape(b, t, -1).astype(dtype), lp["wo"])
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        x = x + (moe.qwen3_moe_mlp(h, lp, cfg, backend) if "router" in lp else _dense_mlp(h, lp))
        new_k.append(layer.k)
        new_v.append(layer.v)
        k_scale.append(layer.k_scale)
        v_scale.append(layer.v_scale)
        stats.append(st)
    # every layer's partial rows reduced at once (two small kernels per layer otherwise)
    merged = accumulate_stats(cache.stats, reduce_stat_rows(jnp.stack(stats)))
    cache = KVCache(new_k, new_v, k_scale, v_scale, merged, cache.config, cache.k_shift)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache


def logits(params, hidden):
    """hidden [..., D] -> float32 logits [..., V] (float64 for float64 compute)."""
    w = params.get("lm_head")
    acc = acc_dtype(hidden.dtype)
    if w is None:
        return jnp.einsum("...d,vd->...v", hidden, params["embed"], preferred_element_type=acc)
    return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=acc)


def init_random_params(cfg: ModelConfig, key, dtype=jnp.bfloat16, scale: float = 0.02,
                       sharding_of: Callable | None = None):
    """Random weights with a real architecture's shapes (for speed benchmarks).

    ``sharding_of(name, ndim)``: a ``jax.sharding.Sharding`` per leaf name; each leaf is
    then generated in place by a jitted generator (the same random bits: JAX's partitionable
    threefry; the jitted transform may round a last bit differently). None: eager, on the
    default device."""
    d, hd, i_sz = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = dict(attn_norm=(d,), wq=(d, cfg.num_heads * hd), wk=(d, cfg.num_kv_heads * hd),
                  wv=(d, cfg.num_kv_heads * hd), wo=(cfg.num_heads * hd, d), mlp_norm=(d,),
                  w_gate=(d, i_sz), w_up=(d, i_sz), w_down=(i_sz, d))
    if cfg.attention_bias:
        shapes.update(bq=(cfg.num_heads * hd,), bk=(cfg.num_kv_heads * hd,),
                      bv=(cfg.num_kv_heads * hd,))
    if cfg.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    if cfg.is_mla:  # DeepSeek: MLA attention, dense or MoE MLP per layer
        from jfp8kv.models import mla

        per_layer = [mla.random_layer_shapes(cfg, i) for i in range(cfg.num_layers)]
    elif cfg.hybrid is not None:  # Qwen3.5/3.6: DeltaNet or gated attention, MoE everywhere
        from jfp8kv.models import qwen3_hybrid

        per_layer = [qwen3_hybrid.layer_shapes(cfg, i) for i in range(cfg.num_layers)]
    else:  # routed layers (qwen3_moe) swap the dense MLP for router + expert stacks
        routed = {**{k: v for k, v in shapes.items() if k not in ("w_gate", "w_up", "w_down")},
                  **moe.moe_layer_shapes(cfg)}
        per_layer = [routed if cfg.is_moe_layer(i) else shapes for i in range(cfg.num_layers)]
    keys = iter(jax.random.split(key, sum(map(len, per_layer)) + 2))
    generators = {}

    def generate(key, shape, ones: bool):
        if ones:
            return jnp.ones(shape, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)

    def make(name, shape):
        ones = name.endswith("norm")
        k = None if ones else next(keys)
        if sharding_of is None:
            return generate(k, shape, ones)
        where = sharding_of(name, len(shape))
        if (shape, ones, where) not in generators:
            generators[shape, ones, where] = jax.jit(
                lambda k, shape=shape, ones=ones: generate(k, shape, ones), out_shardings=where)
        return generators[shape, ones, where](k)

    layers = [{n: make(n, s) for n, s in sh.items()} for sh in per_layer]
    params = {"embed": make("embed", (cfg.vocab_size, d)), "final_norm": make("final_norm", (d,)),
              "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = make("lm_head", (d, cfg.vocab_size))
    return params
