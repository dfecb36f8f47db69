"""The one home of the fp8 policy: formats, ranges, scale computation, saturating casts.

Kernels and the pure-jnp reference both import from here, so the numbers they produce are
the same by construction.

Numerics contract
-----------------
* quantize(x, s) = cast(clip(x / s, -fmax, fmax)) with round-to-nearest-even, bit-identical
  to ``ml_dtypes`` (a raw ``astype`` turns |x| >= 480 into NaN for e4m3: we clip first).
* NaN stays NaN (``clip`` propagates it) and is counted by the store.
* Dynamic scales are ``amax / fmax`` floored at a tiny positive value, so an all-zero row
  quantizes to zeros instead of 0/0.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

# User-facing names -> storage dtype name (a jnp dtype name).
_KV_DTYPE_ALIASES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# Largest finite value of each format.
FMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# Floor of dynamic scales: keeps x / s finite for all-zero rows.
SCALE_FLOOR = 1e-12
# Floor of fp16 block scales: the smallest positive fp16 subnormal.
SCALE_FLOOR_F16 = 2.0**-24


def storage_dtype_name(kv_cache_dtype: str, compute_dtype: str) -> str:
    """Map a user-facing ``kv_cache_dtype`` ("auto", "fp8", "fp8_e4m3", ...) to a jnp dtype name."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    try:
        return _KV_DTYPE_ALIASES[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of "
            f"{['auto', *_KV_DTYPE_ALIASES]}"
        ) from None


def user_dtype_name(storage_dtype: str) -> str:
    """The inverse of ``storage_dtype_name`` for display ("float8_e4m3fn" -> "fp8_e4m3")."""
    return {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}.get(storage_dtype, storage_dtype)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).name in FP8_DTYPES


def fmax(dtype) -> float:
    return FMAX[jnp.dtype(dtype).name]


def saturating_cast(y, dtype):
    """Cast already-scaled values to ``dtype`` with saturation (clip, then RNE cast).

    ``y`` should be float32 (or bf16/fp16, which upcast exactly); NaN stays NaN and +-inf
    saturate to +-fmax.
    """
    m = fmax(dtype)
    y = y.astype(jnp.float32)
    return jnp.clip(y, -m, m).astype(dtype)


def quantize(x, scale, dtype):
    """``cast(clip(x / scale, -fmax, fmax))``; ``scale`` broadcasts against ``x``."""
    return saturating_cast(x.astype(jnp.float32) / scale.astype(jnp.float32), dtype)


def dequantize(q, scale, out_dtype=jnp.float32):
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(out_dtype)


def dynamic_scale(amax, dtype, scale_dtype=jnp.float32):
    """Scale mapping ``amax`` onto ``fmax``, floored, rounded *up* to ``scale_dtype``.

    Rounding the scale up (never down) guarantees |x / s| <= fmax for the row's own values,
    so dynamic modes never saturate finite inputs.
    """
    s = jnp.maximum(amax.astype(jnp.float32) / fmax(dtype), SCALE_FLOOR)
    s = jnp.where(jnp.isfinite(s), s, 1.0)  # NaN/inf rows: the NaN survives in x, not in s
    # amax / (amax / fmax) can round to just above fmax: nudge the scale up one ulp then.
    a32 = amax.astype(jnp.float32)
    s = jnp.where(a32 / s > fmax(dtype), jnp.nextafter(s, jnp.float32(jnp.inf)), s)
    if jnp.dtype(scale_dtype) == jnp.float32:
        return s
    floor = SCALE_FLOOR_F16 if jnp.dtype(scale_dtype) == jnp.float16 else SCALE_FLOOR
    s = jnp.maximum(s, floor)
    r = s.astype(scale_dtype)
    up = jnp.nextafter(r, jnp.array(jnp.inf, scale_dtype))
    return jnp.where(r.astype(jnp.float32) < s, up, r)


def saturation_count(x, scale, dtype):
    """Number of finite elements whose scaled magnitude exceeds fmax (would be clipped)."""
    y = x.astype(jnp.float32) / scale.astype(jnp.float32)
    return jnp.sum((jnp.abs(y) > fmax(dtype)) & jnp.isfinite(x)).astype(jnp.float32)


def warn_unit_scale(k_or_v: str = "K/V") -> None:
    log.warning(
        "fp8 KV cache with a static %s scale of 1.0 (no calibration): values beyond +-fmax "
        "saturate and small values lose precision. Pass kv_scales=None to calibrate, a "
        "scales JSON from `python -m jfp8kv.calibrate`, or use --kv-scale-mode token/block.",
        k_or_v,
    )


def np_reference_quantize(x: np.ndarray, scale: float, dtype) -> np.ndarray:
    """ml_dtypes oracle used by tests: clip in float64, cast through ml_dtypes (RNE)."""
    import ml_dtypes

    target = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}[
        jnp.dtype(dtype).name
    ]
    m = fmax(dtype)
    y = np.clip(x.astype(np.float32) / np.float32(scale), -m, m)
    return y.astype(np.float32).astype(target)
