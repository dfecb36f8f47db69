"""The paged KV cache pytree, its scale layouts, and capacity accounting.

Layout (per layer ``l``)::

    k[l], v[l]              [num_kv_heads, num_pages, page_size, head_dim]  storage dtype
    k_scale[l], v_scale[l]  depends on the scale mode (``scale_modes``, which owns them):
        None (not fp8)      [0]                                             float32 (unused)
        "tensor"/"channel"  [num_kv_heads, head_dim]                        float32, static
        "token"             [num_kv_heads, num_pages, page_size]            float32, dynamic
        "block"             [num_kv_heads, num_pages, page_size, head_dim/32] float16, dynamic
    stats                   [num_layers, 6] float32:
                            k_saturated, v_saturated, k_nan, v_nan, k_amax, v_amax
    k_shift[l]              [num_kv_heads, head_dim] float32, only when ``kv_rotation``
                            smooths K (``k_transform``); ``None`` otherwise

With ``CacheConfig.bitcast_pool`` (the reference backend on CPU) the page arrays hold the
same bits as same-width unsigned integers (``pool_dtype``: uint8 for fp8, uint16 for
bf16/f16; 32/64-bit storage stays as it is): read them through ``as_storage`` and write
through ``as_pool``. Nothing else changes: the stored values are the storage dtype's.

Head-major pages keep one (head, page) block contiguous, which is what the decode kernel
reads. "tensor" scales are stored broadcast to [heads, head_dim] so tensor and channel modes
share one code path (the K scale is folded into the query, the V scale into the output).

MLA models (``CacheConfig.layout == "latent"``, ``jfp8kv.kvcache.latent``) keep one latent
row per token per layer in ``k[l]`` [1, num_pages, page_size, kv_lora_rank + rope_dim] with
its scales in ``k_scale[l]``; ``v`` and ``v_scale`` are empty lists, the v stats columns 0.

Page 0 is reserved: padding lanes write there and no sequence ever owns it.

``bytes_per_token`` is the single source of truth for capacity: ``KVPool`` (this pool as a
``layout.PagedPool``: its bytes per page and static bytes) and ``plan_num_pages`` both go
through it. ``dense_layout`` declares the dense families' cache (Llama, Qwen2/3, Qwen3-MoE):
one ``KVPool``; ``kv_pool`` builds that pool for the hybrid family's attention layers too.
Under tensor parallelism a ``KVPool`` of several heads splits on the head axis
(``KVPool.partition``) and counts one device's heads; the one-head latent pool is whole on
every device.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Float32, Shaped

from jfp8kv.config import KV_ROTATIONS, KV_SCALE_MODES, CacheConfig, ModelConfig
from jfp8kv.kvcache import k_transform, scale_modes
from jfp8kv.kvcache.layout import (CacheLayout, CacheRequest, PagedPool, Supports, array_bytes,
                                   resolve_scale_mode)

STAT_FIELDS = ("k_saturated", "v_saturated", "k_nan", "v_nan", "k_amax", "v_amax")

# Shapes of the pytree leaves (checked at run time under pytest: tests/conftest.py).
Pages = Shaped[Array, "kv_heads pages page_size head_dim"]
Scales = (Float[Array, "kv_heads head_dim"]  # static (tensor, channel)
          | Float[Array, "kv_heads pages page_size"]  # one per token
          | Float[Array, "kv_heads pages page_size groups"]  # one per group (block)
          | Float[Array, "0"])  # unscaled pages
Stats = Float32[Array, "layers 6"]
Shift = Float32[Array, "kv_heads head_dim"]  # K smoothing's per-layer shift


def reduce_stat_rows(rows: Float32[Array, "... r 6"]) -> Float32[Array, "... 6"]:
    """Partial stats rows (``STAT_FIELDS`` order, e.g. one per store program) -> one row:
    counts summed exactly (as int32), amax maximized."""
    counts = jnp.sum(rows[..., :4].astype(jnp.int32), axis=-2).astype(jnp.float32)
    return jnp.concatenate([counts, jnp.max(rows[..., 4:], axis=-2)], axis=-1)


def accumulate_stats(stats: Stats, new: Stats) -> Stats:
    """The running per-layer stats after a step's rows ``new`` [layers, 6]: counts add,
    amax keeps the running maximum."""
    return jnp.concatenate([stats[:, :4] + new[:, :4], jnp.maximum(stats[:, 4:], new[:, 4:])],
                           axis=1)


def _check_layer(k: Pages, v: Pages, k_scale: Scales, v_scale: Scales) -> None:
    """Nothing to do: the annotations are the check, when a type checker wraps this."""


def _check_cache(k: list[Pages], v: list[Pages], k_scale: list[Scales],
                 v_scale: list[Scales], stats: Stats) -> None:
    """As ``_check_layer``, for the whole pool."""


def _arrays(*xs) -> bool:
    """JAX also rebuilds pytrees with other leaves (shapes, sentinels): check arrays only."""
    return all(isinstance(x, jax.Array) for x in xs)


def pool_dtype(cfg: CacheConfig) -> jnp.dtype:
    """dtype of the page arrays: the storage dtype, or with ``cfg.bitcast_pool`` the unsigned
    integer of the same width for 8/16-bit storage (XLA on CPU scatters into those in place)."""
    dt = jnp.dtype(cfg.storage_dtype)
    if cfg.bitcast_pool and dt.itemsize < 4:
        return jnp.dtype(f"uint{8 * dt.itemsize}")
    return dt


def as_storage(pages, cfg: CacheConfig):
    """Page values (a pool array, or pages gathered from one) viewed as the storage dtype:
    a bitcast of an integer pool, the array itself otherwise. Host (numpy) arrays stay on
    the host."""
    dt = jnp.dtype(cfg.storage_dtype)
    if pages.dtype == dt:
        return pages
    if isinstance(pages, np.ndarray):
        return pages.view(dt)
    return jax.lax.bitcast_convert_type(pages, dt)


def as_pool(values, cfg: CacheConfig):
    """Values (any float dtype) -> the pool's representation: cast to the storage dtype, then
    bitcast to ``pool_dtype`` when the pool is integer."""
    dt, pd = jnp.dtype(cfg.storage_dtype), pool_dtype(cfg)
    values = values.astype(dt)
    if pd == dt:
        return values
    if isinstance(values, np.ndarray):
        return values.view(pd)
    return jax.lax.bitcast_convert_type(values, pd)


def scale_shape(cfg: CacheConfig) -> tuple[int, ...]:
    """Shape of one layer's K (or V) scale array (see ``scale_modes.ScaleMode``)."""
    return scale_modes.of(cfg).scale_shape(cfg)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, storage_dtype: str,
                    scale_mode: str | None, scale_block: int = 32, layout: str = "kv") -> int:
    """KV bytes per cached token: 2 x layers x kv_heads x (head_dim x itemsize + scale bytes);
    one array instead of two (K and V) for the MLA ``layout="latent"`` (one head of
    head_dim = kv_lora_rank + qk_rope_head_dim)."""
    item = jnp.dtype(storage_dtype).itemsize
    mode = scale_modes.get(scale_mode, storage_dtype)
    per_head = head_dim * item + mode.scale_bytes_per_token_head(head_dim, scale_block)
    return (1 if layout == "latent" else 2) * num_layers * num_kv_heads * per_head


def static_overhead_bytes(num_layers: int, num_kv_heads: int, head_dim: int,
                          storage_dtype: str, scale_mode: str | None) -> int:
    """Bytes of per-layer static scale arrays (K and V), independent of the page count."""
    return scale_modes.get(scale_mode, storage_dtype).static_bytes(num_layers, num_kv_heads,
                                                                   head_dim)


def plan_num_pages(cache_memory: int, *, num_layers: int, num_kv_heads: int, head_dim: int,
                   page_size: int, storage_dtype: str, scale_mode: str | None,
                   scale_block: int = 32, layout: str = "kv") -> int:
    """Usable pages (excluding the reserved sink page) that fit in ``cache_memory`` bytes."""
    per_page = page_size * bytes_per_token(num_layers, num_kv_heads, head_dim, storage_dtype,
                                           scale_mode, scale_block, layout)
    budget = cache_memory - static_overhead_bytes(num_layers, num_kv_heads, head_dim,
                                                  storage_dtype, scale_mode)
    return max(0, budget // per_page)


@typing.no_type_check  # fields are checked in __post_init__, for array leaves only
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Functional paged KV cache. Arrays are pytree leaves; ``config`` is static."""

    k: list[Pages]
    v: list[Pages]
    k_scale: list[Scales]
    v_scale: list[Scales]
    stats: Stats
    config: CacheConfig = dataclasses.field(metadata=dict(static=True))
    k_shift: list[Shift] | None = None  # K smoothing only

    def __post_init__(self):
        if self.k and self.v and _arrays(self.k[0], self.v[0], self.k_scale[0],
                                         self.v_scale[0], self.stats):
            _check_cache(self.k, self.v, self.k_scale, self.v_scale, self.stats)

    @classmethod
    def init(cls, cfg: CacheConfig, static_k_scale=None, static_v_scale=None,
             k_shift=None) -> "KVCache":
        """Allocate the pool. Static modes need ``static_{k,v}_scale``: [layers, heads,
        head_dim]; a smoothing ``kv_rotation`` needs ``k_shift`` of the same shape."""
        k_transform.check_shift(cfg, k_shift)
        shape = (cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim)
        dt = pool_dtype(cfg)
        mode = scale_modes.of(cfg)
        if cfg.layout == "latent":  # MLA: the rows live in k / k_scale, v lists are empty
            return cls([jnp.zeros(shape, dt) for _ in range(cfg.num_layers)], [],
                       mode.init_scales(cfg), [],
                       jnp.zeros((cfg.num_layers, len(STAT_FIELDS)), jnp.float32), cfg)
        return cls(
            k=[jnp.zeros(shape, dt) for _ in range(cfg.num_layers)],
            v=[jnp.zeros(shape, dt) for _ in range(cfg.num_layers)],
            k_scale=mode.init_scales(cfg, static_k_scale),
            v_scale=mode.init_scales(cfg, static_v_scale),
            stats=jnp.zeros((cfg.num_layers, len(STAT_FIELDS)), jnp.float32),
            config=cfg,
            k_shift=None if k_shift is None else [jnp.asarray(x, jnp.float32) for x in k_shift],
        )

    def layer(self, i: int) -> "LayerKV":
        return LayerKV(self.k[i], self.v[i], self.k_scale[i], self.v_scale[i],
                       None if self.k_shift is None else self.k_shift[i])

    def nbytes(self, per_device: bool = False) -> int:
        """Bytes of the pages and scales (``per_device``: one device's share)."""
        leaves = jax.tree_util.tree_leaves((self.k, self.v, self.k_scale, self.v_scale))
        return sum(array_bytes(x, per_device) for x in leaves)


@typing.no_type_check  # as KVCache
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
    """One layer's pages and scales (see the module docstring for shapes)."""

    k: Pages
    v: Pages
    k_scale: Scales
    v_scale: Scales
    k_shift: Shift | None = None  # K smoothing only

    def __post_init__(self):
        if _arrays(self.k, self.v, self.k_scale, self.v_scale):
            _check_layer(self.k, self.v, self.k_scale, self.v_scale)


# The fp8 scale mode when none is named (bench/results/quality-cpu.json chose it).
DEFAULT_FP8_SCALE_MODE = "token"
DENSE_SUPPORTS = Supports(scale_modes=KV_SCALE_MODES, default_scale_mode=DEFAULT_FP8_SCALE_MODE,
                          rotations=KV_ROTATIONS, static_calibration=True, tensor_parallel=True,
                          prefix_caching=True)


@dataclasses.dataclass(frozen=True)
class KVPool(PagedPool):
    """Paged K/V pages and their scales (or MLA latent rows): one ``KVCache``. ``config``
    holds every KV head of the pool (its num_pages and page_size are set by ``init``);
    ``heads_per_device`` is the byte model's share of them (all of them on one device, a
    device's under tensor parallelism: budgets are per device)."""

    config: CacheConfig
    heads_per_device: int
    name: str = "kv"

    def _per_device(self) -> tuple:
        c = self.config
        return (c.num_layers, self.heads_per_device, c.head_dim, c.storage_dtype, c.scale_mode)

    def bytes_per_page(self, page_size: int) -> int:
        c = self.config
        return page_size * bytes_per_token(*self._per_device(), c.scale_block, c.layout)

    def fixed_bytes(self) -> int:
        return static_overhead_bytes(*self._per_device())

    def init(self, num_pages: int, page_size: int, k_scale=None, v_scale=None,
             k_shift=None) -> KVCache:
        """``KVCache.init`` of the sized config."""
        cfg = dataclasses.replace(self.config, num_pages=num_pages, page_size=page_size)
        return KVCache.init(cfg, k_scale, v_scale, k_shift)

    @property
    def split(self) -> bool:
        return self.heads_per_device < self.config.num_kv_heads

    def partition(self, axis: str):
        """Split: pages and (scaled pools) their scales on the head axis, the statistics
        rows replicated. Else (one head: the MLA latent) every device holds it all."""
        if not self.split:
            return P()
        c, heads = self.config, P(axis)
        scales = heads if scale_modes.of(c).name is not None else P()
        layers = range(c.num_layers)
        return KVCache([heads for _ in layers], [heads for _ in layers],
                       [scales for _ in layers], [scales for _ in layers], P(), c)

    def info(self) -> dict:
        c = self.config
        return dict(dtype=c.storage_dtype, scale_mode=c.scale_mode, layers=c.num_layers,
                    kv_heads=c.num_kv_heads, heads_per_device=self.heads_per_device,
                    head_dim=c.head_dim)

    def placeholder_args(self) -> dict:
        c = self.config
        out = {}
        if scale_modes.of(c).is_static:
            out.update(k_scale=1.0, v_scale=1.0)
        if k_transform.smooths(c.kv_rotation):
            out["k_shift"] = np.zeros((c.num_layers, c.num_kv_heads, c.head_dim), np.float32)
        return out


def kv_pool(num_layers: int, num_kv_heads: int, head_dim: int, req: CacheRequest,
            mode: str | None, devices_heads: int | None = None) -> KVPool:
    """The K/V pool of ``num_layers`` attention layers for ``req`` (``mode`` resolved):
    checks the scale mode and K transform against ``head_dim`` (ValueError naming what
    works). ``num_kv_heads``: the pool's heads (replicated ones included under tensor
    parallelism); ``devices_heads``: one device's share (default: all)."""
    rot = req.kv_rotation if req.is_fp8 else "none"
    scale_modes.get(mode, req.storage_dtype).validate(head_dim)
    k_transform.validate(rot, head_dim)
    if req.devices > 1 and k_transform.smooths(rot):
        raise ValueError(f"kv_rotation={rot!r} is not supported with tensor parallelism yet; "
                         "use 'none' or 'hadamard'")
    cfg = CacheConfig(num_layers, num_kv_heads, head_dim, 0, 0, req.storage_dtype, mode,
                      bitcast_pool=req.bitcast_pool, kv_rotation=rot,
                      attention_compute=req.attention_compute)
    return KVPool(cfg, devices_heads or num_kv_heads)


def dense_layout(cfg: ModelConfig, req: CacheRequest) -> CacheLayout:
    """A dense family's cache: K/V pages of every layer (under tensor parallelism
    ``req.kv_heads`` of them, each of the model's stored ``kv_heads / num_kv_heads`` times,
    ``kv_heads / req.devices`` per device)."""
    mode = resolve_scale_mode(cfg.family, DENSE_SUPPORTS, req)
    heads = req.kv_heads or cfg.num_kv_heads
    pool = kv_pool(cfg.num_layers, heads, cfg.head_dim, req, mode, heads // req.devices)
    return CacheLayout(cfg.family, "kv", (pool,), storage_dtype=req.storage_dtype,
                       scale_mode=mode, kv_rotation=pool.config.kv_rotation,
                       supports=DENSE_SUPPORTS)
