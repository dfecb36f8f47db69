"""Pure-jnp reference of the MLA latent cache kernels (the twin a Pallas kernel must match).

Contracts
---------
``store_latent(pages, scale, rows, slots, cfg) -> (pages, scale, stats_row)``
    pages: one layer's latent pool [1, num_pages, page_size, R] (``cfg.layout == "latent"``,
    R = kv_lora_rank + qk_rope_head_dim); scale: its scale array (``scale_modes`` layout for
    one head). rows: [N, R] in the compute dtype, ``[c | k_rope]`` (normalized latent, then
    the post-RoPE key tail). slots: int32[N], flat slot = page * page_size + offset; padding
    lanes point into page 0 and are excluded from the statistics. Quantized exactly as the
    dense store quantizes one head (``reference._quantize_rows``: the ``fp8`` policy).
    stats_row: float32[6] in ``STAT_FIELDS`` order; the K columns describe the rows, the V
    columns are 0.

``latent_attention(q, pages, scale, page_tables, seq_lens, q_positions, cfg, sm_scale,
value_dim) -> out``
    q: [B, T, H, R] absorbed queries ``[W_UK_h^T q_nope_h | q_rope_h]`` (any float dtype;
    scores accumulate in float32, float64 in the check mode). Every head attends the same
    latent rows (MQA with one KV head of width R): score = q . row * sm_scale, value = the
    first ``value_dim`` (= kv_lora_rank) columns of the row. Masking as ``paged_attention``:
    query (b, t) sees key j iff j < seq_lens[b] and j <= q_positions[b, t]; a row with no
    visible key returns zeros. out: [B, T, H, value_dim] (the latent output o_lat; the
    caller applies W_UV per head) in q's dtype. The rows are read through the storage format
    (dequantized) for scores and values alike.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from jfp8kv.config import CacheConfig
from jfp8kv.kernels import reference
from jfp8kv.kernels.reference import PageTables, Positions, SeqLens, Slots, StatsRow
from jfp8kv.kvcache.cache import LayerKV, as_pool

LatentPages = Shaped[Array, "one pages page_size latent"]
LatentRows = Float[Array, "n latent"]
LatentQueries = Float[Array, "b t heads latent"]


def store_latent(pages: LatentPages, scale, rows: LatentRows, slots: Slots,
                 cfg: CacheConfig) -> tuple[LatentPages, object, StatsRow]:
    valid = slots >= cfg.page_size  # page 0 is the padding sink
    x = jnp.where(valid[:, None], rows, 0)[:, None]  # [N, 1, R]: padding zeroed for stats
    q, s, sat = reference._quantize_rows(x, scale, cfg)
    # One row is written twice (same slot, same value), as the dense store: a one-row
    # scatter would become a whole-pool dynamic-update-slice on CPU.
    reps = 2 if slots.shape[0] == 1 else 1
    idx = jnp.tile(slots, reps)
    p, ps = cfg.num_pages, cfg.page_size

    def scatter(arr, upd):  # arr [1, P, S, ...], upd [N, 1, ...]
        flat = arr.reshape(1, p * ps, *arr.shape[3:])
        upd = jnp.moveaxis(jnp.tile(upd, (reps,) + (1,) * (upd.ndim - 1)), 0, 1)
        return flat.at[:, idx].set(upd.astype(arr.dtype)).reshape(arr.shape)

    pages = scatter(pages, as_pool(q, cfg))
    if s is not None:
        scale = scatter(scale, s)
    nan = jnp.isnan(x)
    zero = jnp.float32(0)
    stats = jnp.stack([sat, zero, jnp.sum(nan).astype(jnp.float32), zero,
                       jnp.max(jnp.where(nan, 0, jnp.abs(x)), initial=0).astype(jnp.float32),
                       zero])
    return pages, scale, stats


def latent_attention(q: LatentQueries, pages: LatentPages, scale, page_tables: PageTables,
                     seq_lens: SeqLens, q_positions: Positions, cfg: CacheConfig,
                     sm_scale: float, value_dim: int) -> Float[Array, "b t heads value_dim"]:
    # The dense reference with one KV head whose K and V pages are the same latent rows:
    # its P.V over the whole row carries o_lat in the first value_dim columns.
    layer = LayerKV(pages, pages, scale, scale)
    out = reference.paged_attention(q, layer, page_tables, seq_lens, q_positions, cfg, sm_scale)
    return out[..., :value_dim]
