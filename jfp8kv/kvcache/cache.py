"""The paged KV cache pytree, its scale layouts, and capacity accounting.

Layout (per layer ``l``)::

    k[l], v[l]              [num_kv_heads, num_pages, page_size, head_dim]  storage dtype
    k_scale[l], v_scale[l]  depends on the scale mode:
        None (not fp8)      [0]                                             float32 (unused)
        "tensor"/"channel"  [num_kv_heads, head_dim]                        float32, static
        "token"             [num_kv_heads, num_pages, page_size]            float32, dynamic
        "block"             [num_kv_heads, num_pages, page_size, head_dim/32] float16, dynamic
    stats                   [num_layers, 6] float32:
                            k_saturated, v_saturated, k_nan, v_nan, k_amax, v_amax

Head-major pages keep one (head, page) block contiguous, which is what the decode kernel
reads. "tensor" scales are stored broadcast to [heads, head_dim] so tensor and channel modes
share one code path (the K scale is folded into the query, the V scale into the output).

Page 0 is reserved: padding lanes write there and no sequence ever owns it.

``bytes_per_token`` is the single source of truth for capacity: the planner
(``plan_num_pages``) and the allocator (the pool it sizes) both go through it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jfp8kv.config import CacheConfig

STAT_FIELDS = ("k_saturated", "v_saturated", "k_nan", "v_nan", "k_amax", "v_amax")
STATIC_MODES = ("tensor", "channel")
DYNAMIC_MODES = ("token", "block")


def scale_dtype(scale_mode: str | None):
    return jnp.float16 if scale_mode == "block" else jnp.float32


def scale_shape(cfg: CacheConfig) -> tuple[int, ...]:
    h, p, s, d = cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim
    if not cfg.is_fp8 or cfg.scale_mode is None:
        return (0,)
    if cfg.scale_mode in STATIC_MODES:
        return (h, d)
    if cfg.scale_mode == "token":
        return (h, p, s)
    if cfg.scale_mode == "block":
        return (h, p, s, d // cfg.scale_block)
    raise ValueError(f"unknown kv_scale_mode {cfg.scale_mode!r}")


def scale_bytes_per_token_head(storage_dtype: str, scale_mode: str | None, head_dim: int,
                               scale_block: int = 32) -> int:
    """Scale bytes stored per token per KV head, for K or V alone (0 for static modes)."""
    if not storage_dtype.startswith("float8") or scale_mode in (None, *STATIC_MODES):
        return 0
    if scale_mode == "token":
        return 4
    if scale_mode == "block":
        return 2 * (head_dim // scale_block)
    raise ValueError(f"unknown kv_scale_mode {scale_mode!r}")


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, storage_dtype: str,
                    scale_mode: str | None, scale_block: int = 32) -> int:
    """KV bytes per cached token: 2 x layers x kv_heads x (head_dim x itemsize + scale bytes)."""
    item = jnp.dtype(storage_dtype).itemsize
    per_head = head_dim * item + scale_bytes_per_token_head(
        storage_dtype, scale_mode, head_dim, scale_block)
    return 2 * num_layers * num_kv_heads * per_head


def static_overhead_bytes(num_layers: int, num_kv_heads: int, head_dim: int,
                          storage_dtype: str, scale_mode: str | None) -> int:
    """Bytes of per-layer static scale arrays (K and V), independent of the page count."""
    if storage_dtype.startswith("float8") and scale_mode in STATIC_MODES:
        return 2 * num_layers * num_kv_heads * head_dim * 4
    return 0


def plan_num_pages(cache_memory: int, *, num_layers: int, num_kv_heads: int, head_dim: int,
                   page_size: int, storage_dtype: str, scale_mode: str | None,
                   scale_block: int = 32) -> int:
    """Usable pages (excluding the reserved sink page) that fit in ``cache_memory`` bytes."""
    per_page = page_size * bytes_per_token(num_layers, num_kv_heads, head_dim, storage_dtype,
                                           scale_mode, scale_block)
    budget = cache_memory - static_overhead_bytes(num_layers, num_kv_heads, head_dim,
                                                  storage_dtype, scale_mode)
    return max(0, budget // per_page)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Functional paged KV cache. Arrays are pytree leaves; ``config`` is static."""

    k: list[jax.Array]
    v: list[jax.Array]
    k_scale: list[jax.Array]
    v_scale: list[jax.Array]
    stats: jax.Array
    config: CacheConfig = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def init(cls, cfg: CacheConfig, static_k_scale=None, static_v_scale=None) -> "KVCache":
        """Allocate the pool. Static modes need ``static_{k,v}_scale``: [layers, heads, head_dim]."""
        shape = (cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim)
        dt = jnp.dtype(cfg.storage_dtype)
        sshape = scale_shape(cfg)
        sdt = scale_dtype(cfg.scale_mode)

        def scales(static):
            if cfg.is_fp8 and cfg.scale_mode in STATIC_MODES:
                if static is None:
                    raise ValueError(f"kv_scale_mode={cfg.scale_mode!r} needs static scales")
                static = jnp.broadcast_to(jnp.asarray(static, jnp.float32),
                                          (cfg.num_layers, *sshape))
                return [static[i] for i in range(cfg.num_layers)]
            return [jnp.ones(sshape, sdt) for _ in range(cfg.num_layers)]

        return cls(
            k=[jnp.zeros(shape, dt) for _ in range(cfg.num_layers)],
            v=[jnp.zeros(shape, dt) for _ in range(cfg.num_layers)],
            k_scale=scales(static_k_scale),
            v_scale=scales(static_v_scale),
            stats=jnp.zeros((cfg.num_layers, len(STAT_FIELDS)), jnp.float32),
            config=cfg,
        )

    def layer(self, i: int) -> "LayerKV":
        return LayerKV(self.k[i], self.v[i], self.k_scale[i], self.v_scale[i])

    def nbytes(self) -> int:
        leaves = jax.tree_util.tree_leaves((self.k, self.v, self.k_scale, self.v_scale))
        return sum(x.size * x.dtype.itemsize for x in leaves)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
    """One layer's pages and scales (see the module docstring for shapes)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
