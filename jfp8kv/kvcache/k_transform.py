"""What is done to K before it is stored (``CacheConfig.kv_rotation``), and to the queries.

fp8 error in the cache is dominated by K. Two transforms shrink it, each exact for attention:

* ``"smooth"``: subtract a calibrated constant ``shift`` [kv_heads, head_dim] per layer (the
  mean of post-RoPE K over calibration text) from every K row before it is quantized, and
  never add it back. A query's scores all move by the same q.shift, so softmax, and the
  attention output, are unchanged; K's large constant (bias-driven) channels leave the range
  the fp8 scale has to cover. Queries are untouched.
* ``"hadamard"``: rotate every K row by the fixed orthonormal R of ``kvcache.rotation`` and
  the queries by the same R, so q R . k R = q . k. It spreads outlier channels over all
  channels (helps when the outliers vary from token to token; hurts where they are constant,
  which is what smoothing removes first).
* ``"smooth+hadamard"``: subtract, then rotate.

Stored K is ``rotate(k - shift)`` (the butterfly, bit-exact with the numpy twin and the fake
quantization) in ``promote_types(k.dtype, float32)`` (float64 stays float64); the queries are
``rotate_dense(q)`` (the same R as one matmul) cast back to q's dtype. K is then quantized
by the scale mode as usual; static scales must be measured in that basis
(``engine.calibrate``). V is never transformed. ``kernels.store_kv`` calls ``store_rows``;
``kernels.paged_attention`` calls ``query_rows`` before the reference, and the Pallas
attention kernels apply the same R to the query tile they load (``tiles.QueryRotation``:
no extra pass over the queries), so every backend and scale mode gets the same numbers.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jfp8kv.config import KV_ROTATIONS, CacheConfig
from jfp8kv.kvcache import rotation


def smooths(name: str) -> bool:
    """Whether ``kv_rotation`` subtracts a calibrated K shift."""
    return name in ("smooth", "smooth+hadamard")


def rotates(name: str) -> bool:
    """Whether ``kv_rotation`` rotates K and the queries."""
    return name in ("hadamard", "smooth+hadamard")


def validate(name: str, head_dim: int) -> str:
    """``name`` if it is a known transform usable at ``head_dim``; ValueError otherwise."""
    if name not in KV_ROTATIONS:
        raise ValueError(f"unknown kv_rotation {name!r}; choose one of {list(KV_ROTATIONS)}")
    if rotates(name):
        rotation.block_size(head_dim)  # raises, naming the head sizes that work
    return name


def check_shift(cfg: CacheConfig, k_shift) -> None:
    """A smoothing cache needs ``k_shift`` [layers, kv_heads, head_dim]; others take none."""
    want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    if not smooths(cfg.kv_rotation):
        if k_shift is not None:
            raise ValueError(f"k_shift given but kv_rotation={cfg.kv_rotation!r} does not "
                             "smooth K; use 'smooth' or 'smooth+hadamard'")
        return
    if k_shift is None or tuple(np.shape(k_shift)) != want:
        raise ValueError(f"kv_rotation={cfg.kv_rotation!r} needs k_shift of shape {want} "
                         f"(calibrated K means), got "
                         f"{None if k_shift is None else tuple(np.shape(k_shift))}")


def store_rows(k_new, k_shift, cfg: CacheConfig):
    """K rows [N, kv_heads, head_dim] as they are stored: ``rotate(k - shift)`` (see the
    module docstring); the rows themselves when ``cfg.kv_rotation == "none"``.
    ``k_shift``: this layer's [kv_heads, head_dim] float32 shift, or None."""
    name = cfg.kv_rotation
    if name == "none":
        return k_new
    ct = jnp.promote_types(k_new.dtype, jnp.float32)
    x = k_new.astype(ct)
    if smooths(name):
        x = x - jnp.asarray(k_shift).astype(ct)[None]
    if rotates(name):
        x = rotation.rotate(x)
    return x


def query_rows(q, cfg: CacheConfig):
    """Queries [..., head_dim] in the basis K is stored in: rotated (back in q's dtype) when
    the transform rotates, unchanged otherwise (smoothing leaves queries alone). The same R
    as ``store_rows`` but as one matmul (``rotation.rotate_dense``: a single tensor-core pass
    where the butterfly is log2(head_dim) passes); queries are not quantized, so its rounding
    differs from the butterfly's only in the last bits."""
    if not rotates(cfg.kv_rotation):
        return q
    return rotation.rotate_dense(q).astype(q.dtype)
