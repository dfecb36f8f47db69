"""The fp8 scale modes: each mode's whole policy in one small frozen object.

A mode (``TENSOR``, ``CHANNEL``, ``TOKEN``, ``BLOCK``; ``UNSCALED`` for 16/32-bit pages)
says, for the K or V pages of one layer:

* where the scales live: ``scale_shape`` in the pool, ``scale_dtype``, the bytes they add
  per cached token and head (``scale_bytes_per_token_head``) or once per layer
  (``static_bytes``), and the flat layout every kernel indexes (``kernel_scales``);
* whether they are static (``is_static``: calibrated [heads, head_dim] float32, fixed at
  init) or dynamic (computed by the store for each row it writes);
* ``groups``: dynamic scales per (token, head) row: 1 for ``TOKEN``, head_dim / scale_block
  for ``BLOCK``; 0 for static and unscaled modes;
* ``quantize`` (the store, reference and kernel alike) and ``dequantize`` (the reference
  read path, and the kernels' grouped tiles).

Rows are quantized in the *group view* [..., G, W] (G = max(groups, 1), W = head_dim / G):
a dynamic scale covers one group, a static scale [..., 1, head_dim] one channel. Kernels
branch on these properties (static, one scale per token, one per group), never on mode
names, so a new mode with one of these layouts touches this file only (and ``KV_SCALE_MODES``
in ``jfp8kv.config`` for its user-facing name). The numbers are ``jfp8kv.kvcache.fp8``'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache import fp8


@dataclasses.dataclass(frozen=True)
class ScaleMode:
    """One scale mode. Hashable: kernels take it as a static argument."""

    name: str | None  # the ``kv_scale_mode`` string; None for unscaled (16/32-bit) pages
    is_static: bool = False  # calibrated [heads, head_dim] float32 scales, fixed at init
    per_channel: bool = True  # static: one scale per channel (False: one per layer tensor)
    per_block: bool = False  # dynamic: one scale per ``scale_block`` channels, else per row
    scale_dtype: str = "float32"

    @property
    def is_dynamic(self) -> bool:
        """Scales computed by the store for each row it writes (``TOKEN``, ``BLOCK``)."""
        return self.name is not None and not self.is_static

    def groups(self, head_dim: int, scale_block: int) -> int:
        """Dynamic scales per (token, head) row: 0 (static/unscaled), 1 (token), D/blk."""
        if not self.is_dynamic:
            return 0
        return head_dim // scale_block if self.per_block else 1

    def group_view(self, head_dim: int, scale_block: int) -> tuple[int, int]:
        """(G, W): rows are quantized as [..., G, W], one dynamic scale per group."""
        g = max(1, self.groups(head_dim, scale_block))
        return g, head_dim // g

    def validate(self, head_dim: int, scale_block: int = 32) -> None:
        """Raise a ValueError naming what works when ``head_dim`` does not fit this mode."""
        if self.per_block and head_dim % scale_block:
            raise ValueError(f"kv_scale_mode={self.name!r} needs head_dim divisible by "
                             f"{scale_block} (this model has {head_dim}); use 'token', "
                             "'channel' or 'tensor'")

    # -- the pool ---------------------------------------------------------------------
    def scale_shape(self, cfg: CacheConfig) -> tuple[int, ...]:
        h, p, s, d = cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim
        if self.name is None:
            return (0,)
        if self.is_static:
            return (h, d)
        g = self.groups(d, cfg.scale_block)
        return (h, p, s, g) if self.per_block else (h, p, s)

    def scale_bytes_per_token_head(self, head_dim: int, scale_block: int = 32) -> int:
        """Scale bytes stored per token per KV head, for K or V alone (0 for static modes)."""
        return self.groups(head_dim, scale_block) * jnp.dtype(self.scale_dtype).itemsize

    def static_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of the per-layer static K and V scale arrays (independent of pages)."""
        return 2 * num_layers * num_kv_heads * head_dim * 4 if self.is_static else 0

    def init_scales(self, cfg: CacheConfig, static=None) -> list:
        """Per-layer scale arrays of a fresh pool; static modes need ``static``
        broadcastable to [layers, heads, head_dim] (one value per head when the mode has no
        per-channel scales: kernels read channel 0)."""
        shape = self.scale_shape(cfg)
        if not self.is_static:
            return [jnp.ones(shape, self.scale_dtype) for _ in range(cfg.num_layers)]
        if static is None:
            raise ValueError(f"kv_scale_mode={self.name!r} needs static scales")
        try:
            a = np.asarray(static, np.float32)
        except jax.errors.TracerArrayConversionError:  # under jit (a sharded pool's init)
            a = None
        if not self.per_channel and a is not None and a.ndim and np.any(a != a[..., :1]):
            raise ValueError(f"kv_scale_mode={self.name!r} takes one scale per layer and head "
                             "(shape [..., 1]); per-channel scales need 'channel'")
        static = jnp.broadcast_to(jnp.asarray(static, jnp.float32), (cfg.num_layers, *shape))
        return [static[i] for i in range(cfg.num_layers)]

    def static_from_amax(self, amax, headroom: float, storage_dtype: str):
        """Static scales from calibrated amax [..., heads, head_dim]: ``amax * headroom /
        fmax``, reduced over heads and channels when one scale covers the tensor."""
        a = np.asarray(amax, np.float32)
        if not self.per_channel:
            a = np.broadcast_to(a.max(axis=(-2, -1), keepdims=True), a.shape)
        m = fp8.fmax(storage_dtype)
        return np.maximum(a * headroom / m, fp8.SCALE_FLOOR).astype(np.float32)

    def kernel_scales(self, scale, num_kv_heads: int):
        """The layout kernels index: static [Hkv, D]; dynamic [Hkv, P*S*G] (row r, group g
        at r * G + g); None when unscaled."""
        if self.name is None:
            return None
        return scale if self.is_static else scale.reshape(num_kv_heads, -1)

    # -- numerics ---------------------------------------------------------------------
    def quantize(self, xg, static_scale, dtype, *, reciprocal=fp8.reciprocal,
                 cast=fp8.saturating_cast):
        """Rows in the group view ``xg`` [..., G, W] -> (stored values [..., G, W], new
        scales [..., G] in ``scale_dtype`` or None, saturated count float32).

        ``static_scale`` broadcasts against ``xg`` (static modes only). Kernels pass their
        own ``reciprocal`` and ``cast`` primitives (see ``fp8.quantize_counted``).
        """
        if self.name is None:
            return xg.astype(dtype), None, jnp.float32(0)
        x = xg.astype(jnp.float32)
        stored = None
        if self.is_static:
            s = static_scale
        else:
            amax = fp8.amax_ignoring_nan(x)  # [..., G]; inf -> scale 1.0
            stored = fp8.dynamic_scale(amax, dtype, self.scale_dtype, reciprocal=reciprocal)
            s = stored.astype(jnp.float32)[..., None]
        q, sat = fp8.quantize_counted(x, s, dtype, reciprocal=reciprocal, cast=cast)
        return q, stored, sat

    def dequantize(self, q, scale):
        """Stored values [..., D] -> float32. ``scale``: static, broadcastable to [..., D];
        dynamic, the row's scales [..., G] (token: [...] or [..., 1])."""
        x = q.astype(jnp.float32)
        if self.name is None:
            return x
        if self.is_static:
            return x * scale
        s = scale.astype(jnp.float32)
        if not self.per_block:
            return x * s.reshape(*x.shape[:-1], 1)
        g = s.shape[-1]
        w = x.shape[-1] // g
        sb = jnp.broadcast_to(s[..., None], (*s.shape, w)).reshape(x.shape)
        return x * sb


UNSCALED = ScaleMode(None)
TENSOR = ScaleMode("tensor", is_static=True, per_channel=False)
CHANNEL = ScaleMode("channel", is_static=True)
TOKEN = ScaleMode("token")
BLOCK = ScaleMode("block", per_block=True, scale_dtype="float16")
MODES = {m.name: m for m in (TENSOR, CHANNEL, TOKEN, BLOCK)}


def get(name: str | None, storage_dtype: str = "float8_e4m3fn") -> ScaleMode:
    """The mode for a ``kv_scale_mode`` name; ``UNSCALED`` for non-fp8 storage or None."""
    if name is None or not fp8.is_fp8(storage_dtype):
        return UNSCALED
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown kv_scale_mode {name!r}; choose one of {list(MODES)}") from None


def of(cfg: CacheConfig) -> ScaleMode:
    """The scale mode of a cache configuration."""
    return get(cfg.scale_mode, cfg.storage_dtype)
