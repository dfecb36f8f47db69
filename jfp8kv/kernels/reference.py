"""Pure-jnp reference twins of the kernels: the oracle every Pallas kernel is tested against.

Contracts (shared with ``jfp8kv.kernels.pallas_*``)
--------------------------------------------------
``store_kv(layer, k_new, v_new, slots, cfg) -> (layer, stats_row)``
    k_new, v_new: [N, num_kv_heads, head_dim] in the compute dtype (post-RoPE).
    slots: int32[N], flat slot = page * page_size + offset. Padding lanes point into page 0
    (slot < page_size) and are excluded from the statistics.
    Quantizes as ``jfp8kv.kvcache.fp8`` says (dynamic scales computed here) and scatters
    (into an integer pool as the values' bits when ``cfg.bitcast_pool``: reference only).
    stats_row: float32[6] in ``STAT_FIELDS`` order; counts are for this call, amax too.

``paged_attention(q, layer, page_tables, seq_lens, q_positions, cfg, sm_scale) -> out``
    q: [B, T, num_heads, head_dim] (compute dtype); T == 1 is decode.
    page_tables: int32[B, max_pages]; seq_lens: int32[B], tokens cached for the sequence
    *including* this step's; q_positions: int32[B, T], absolute position of each query.
    Query (b, t) attends key j iff j < seq_lens[b] and j <= q_positions[b, t]. K/V are
    always read through the storage format (dequantized). A row with no visible key
    (an empty batch slot) returns zeros. out: [B, T, num_heads, head_dim] compute dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Float32, Int

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache import scale_modes
from jfp8kv.kvcache.cache import LayerKV, as_pool, as_storage

# The contract's arrays (checked at run time under pytest: tests/conftest.py).
NewRows = Float[Array, "n kv_heads head_dim"]
Slots = Int[Array, "n"]
StatsRow = Float32[Array, "6"]
StatRows = Float32[Array, "r 6"]  # partial rows (``cache.reduce_stat_rows``)
Queries = Float[Array, "b t heads head_dim"]
PageTables = Int[Array, "b max_pages"]
SeqLens = Int[Array, "b"]
Positions = Int[Array, "b t"]


def _quantize_rows(x, pool_scale, cfg: CacheConfig):
    """x: [N, H, D] -> (stored values [N, H, D], new scales [N, H, ...] or None, saturated).

    ``pool_scale`` is the layer's scale array: read by static modes, its per-row shape
    (``[H, P, S, ...]`` past P, S) is the layout of dynamic scales."""
    mode = scale_modes.of(cfg)
    n, h, d = x.shape
    g, w = mode.group_view(d, cfg.scale_block)
    static = pool_scale[None, :, None] if mode.is_static else None  # [1, H, 1, D]
    q, s, sat = mode.quantize(x.reshape(n, h, g, w), static, jnp.dtype(cfg.storage_dtype))
    if s is not None:
        s = s.reshape(n, h, *pool_scale.shape[3:])
    return q.reshape(n, h, d), s, sat


def store_kv(layer: LayerKV, k_new: NewRows, v_new: NewRows, slots: Slots,
             cfg: CacheConfig) -> tuple[LayerKV, StatsRow]:
    valid = slots >= cfg.page_size  # page 0 is the padding sink
    vmask = valid[:, None, None]
    h, p, s = cfg.num_kv_heads, cfg.num_pages, cfg.page_size
    # Statistics are over real tokens only: padding lanes are zeroed before counting.
    k_in = jnp.where(vmask, k_new, 0)
    v_in = jnp.where(vmask, v_new, 0)
    kq, ks, k_sat = _quantize_rows(k_in, layer.k_scale, cfg)
    vq, vs, v_sat = _quantize_rows(v_in, layer.v_scale, cfg)

    # One row is written twice (same slot, same value): XLA rewrites a one-row scatter into a
    # dynamic-update-slice that copies the whole pool on CPU; a scatter updates in place.
    reps = 2 if slots.shape[0] == 1 else 1
    idx = jnp.tile(slots, reps)

    def scatter(pages, rows):  # pages [H, P, S, ...], rows [N, H, ...]
        flat = pages.reshape(h, p * s, *pages.shape[3:])
        upd = jnp.moveaxis(jnp.tile(rows, (reps,) + (1,) * (rows.ndim - 1)), 0, 1)
        flat = flat.at[:, idx].set(upd.astype(pages.dtype))
        return flat.reshape(pages.shape)

    k_pages, v_pages = scatter(layer.k, as_pool(kq, cfg)), scatter(layer.v, as_pool(vq, cfg))
    k_scale, v_scale = layer.k_scale, layer.v_scale
    if ks is not None:
        k_scale, v_scale = scatter(k_scale, ks), scatter(v_scale, vs)
    stats = jnp.stack([
        k_sat, v_sat,
        jnp.sum(jnp.isnan(k_in)).astype(jnp.float32),
        jnp.sum(jnp.isnan(v_in)).astype(jnp.float32),
        jnp.max(jnp.where(jnp.isnan(k_in), 0, jnp.abs(k_in)), initial=0).astype(jnp.float32),
        jnp.max(jnp.where(jnp.isnan(v_in), 0, jnp.abs(v_in)), initial=0).astype(jnp.float32),
    ])
    return LayerKV(k_pages, v_pages, k_scale, v_scale), stats


def gather_dequantized(pages, scale, page_tables, cfg: CacheConfig):
    """[H, P, S, D] pages -> [B, H, max_pages * S, D] values as attention sees them.

    fp8 pages dequantize in float32 (the numerics contract); other pages come back as float32,
    or float64 when stored so (the float64 reference-check mode). An integer pool
    (``cfg.bitcast_pool``) is read through its storage dtype: only the gathered pages are
    bitcast."""
    g = as_storage(pages[:, page_tables], cfg)  # [H, B, MP, S, D]
    mode = scale_modes.of(cfg)
    if mode.name is None:  # float32, or float64 in the float64 check mode
        x = g.astype(jnp.promote_types(g.dtype, jnp.float32))
    elif mode.is_static:
        x = mode.dequantize(g, scale[:, None, None, None, :])
    else:
        x = mode.dequantize(g, scale[:, page_tables])  # [H, B, MP, S(, G)] scales
    h, b, mp, s, d = x.shape
    return jnp.moveaxis(x, 0, 1).reshape(b, h, mp * s, d)


def paged_attention(q: Queries, layer: LayerKV, page_tables: PageTables, seq_lens: SeqLens,
                    q_positions: Positions, cfg: CacheConfig, sm_scale: float) -> Queries:
    b, t, nh, d = q.shape
    hkv = cfg.num_kv_heads
    g = nh // hkv
    k = gather_dequantized(layer.k, layer.k_scale, page_tables, cfg)  # [B, Hkv, L, D]
    v = gather_dequantized(layer.v, layer.v_scale, page_tables, cfg)
    acc = jnp.promote_types(q.dtype, jnp.float32)  # float64 only in the float64 check mode
    kpos = jnp.arange(k.shape[2])
    # Rows past seq_len read as 0, as the kernels' masked loads: a reused page's stale tail
    # (NaN included) must not reach the output through 0 * NaN in P.V.
    stored = (kpos[None, :] < seq_lens[:, None])[:, None, :, None]  # [B, 1, L, 1]
    k, v = (jnp.where(stored, x.astype(acc), 0) for x in (k, v))
    qg = q.astype(acc).reshape(b, t, hkv, g, d)
    logits = jnp.einsum("btkgd,bkld->bkgtl", qg, k) * sm_scale
    mask = (kpos[None, None, :] < seq_lens[:, None, None]) & (
        kpos[None, None, :] <= q_positions[:, :, None])  # [B, T, L]
    mask = mask[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    mx = jnp.max(logits, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.where(mask, jnp.exp(logits - mx), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgtl,bkld->btkgd", p, v)
    return out.reshape(b, t, nh, d).astype(q.dtype)


def decode_attention(q, layer: LayerKV, page_tables, seq_lens, cfg: CacheConfig, sm_scale: float):
    """Decode specialisation: q [B, num_heads, head_dim], one query at position seq_len - 1."""
    out = paged_attention(q[:, None], layer, page_tables, seq_lens, (seq_lens - 1)[:, None],
                          cfg, sm_scale)
    return out[:, 0]

