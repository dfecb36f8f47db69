"""The one home of the fp8 policy: formats, ranges, scale computation, saturating casts.

Kernels and the pure-jnp reference both import from here, so the numbers they produce are
the same by construction.

Numerics contract
-----------------
* quantize(x, s) = cast(clip(x * fl(1/s), -fmax, fmax)) with round-to-nearest-even,
  bit-identical to ``ml_dtypes`` applied to the same float32 value. A raw ``astype`` turns
  e4m3 values above 464 (and +-inf) into NaN and e5m2 values from 61440 into inf: we clip
  first. For a power-of-two ``s`` the value cast is exactly ``x / s``.
* Why a reciprocal and not ``x / s``: XLA (seen on CPU, jax 0.10.2) rewrites a divide by a
  broadcast scale into a multiply by its reciprocal, but not a divide by a full array or
  an eager scalar, and Triton's ``/`` is ``div.full.f32`` (not correctly rounded); so
  ``x / s`` gives different bits in different places. One correctly rounded reciprocal per
  scale, then one multiply per element, is reproducible everywhere; kernels must do
  exactly that (a correctly rounded ``1 / s``, e.g. ``div_rn``, never ``div.full``).
* NaN stays NaN (``clip`` propagates it) and is counted by the store.
* Dynamic scales are ``amax * fl(1/fmax)`` floored at a tiny positive value (an all-zero
  row quantizes to zeros instead of 0/0), rounded up to the scale dtype and nudged one
  step up where ``amax * fl(1/s)`` would still exceed fmax: dynamic modes never saturate
  a finite row (fp16 block scales cap at 65504: rows beyond 65504 x fmax do saturate).
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
# fl(1 / fmax) in float32: dynamic scales multiply by it (see dynamic_scale).
INV_FMAX = {k: float(np.float32(1.0) / np.float32(v)) for k, v in FMAX.items()}
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


def scaled(x, scale):
    """The float32 value that is cast: ``x * fl(1 / scale)``; ``scale`` broadcasts.

    The reciprocal is taken on ``scale`` as given (before broadcasting), so pass scales in
    their compact shape ([..., 1], not broadcast to x).
    """
    inv = 1.0 / jnp.asarray(scale, jnp.float32)
    return jnp.asarray(x).astype(jnp.float32) * inv


def quantize(x, scale, dtype):
    """``cast(clip(x * fl(1/scale), -fmax, fmax))``; ``scale`` broadcasts against ``x``."""
    return saturating_cast(scaled(x, scale), dtype)


def dequantize(q, scale, out_dtype=jnp.float32):
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(out_dtype)


def amax_ignoring_nan(x, axis=-1):
    """max |x| along ``axis`` with NaN ignored (+-inf kept); 0 for an all-NaN row.

    Explicit because XLA's CPU reduce-max drops NaN in its vectorised path and propagates
    it elsewhere: the dynamic scale of a row with a NaN would otherwise depend on shapes.
    """
    ax = jnp.abs(jnp.asarray(x).astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isnan(ax), 0.0, ax), axis=axis)


def dynamic_scale(amax, dtype, scale_dtype=jnp.float32):
    """Scale mapping ``amax`` onto ``fmax``, floored, rounded *up* to ``scale_dtype``.

    Rounding the scale up (never down) guarantees |x * fl(1/s)| <= fmax for the row's own
    values, so dynamic modes never saturate finite inputs -- except fp16 scales, which cap
    at 65504 instead of overflowing to inf (rows with amax > 65504 x fmax saturate, counted).
    ``amax`` comes from ``amax_ignoring_nan``: a NaN element stays NaN in the data and the
    rest of its row keeps a proper scale. A NaN/inf amax gives scale 1.0 (inf saturates).
    """
    m = fmax(dtype)
    sdt = jnp.dtype(scale_dtype)
    amax = amax.astype(jnp.float32)
    # An explicit multiply: XLA on CPU rewrites ``amax / fmax`` into it anyway; others may not.
    s = jnp.maximum(amax * jnp.float32(INV_FMAX[jnp.dtype(dtype).name]), SCALE_FLOOR)
    s = jnp.where(jnp.isfinite(s), s, 1.0)
    if sdt != jnp.float32:
        floor = SCALE_FLOOR_F16 if sdt == jnp.float16 else SCALE_FLOOR
        s = jnp.maximum(s, floor)
        r = s.astype(sdt)
        s = jnp.where(r.astype(jnp.float32) < s, jnp.nextafter(r, jnp.array(jnp.inf, sdt)), r)
    # fl(amax * fl(1/s)) can still land one float32 ulp above fmax (~0.3% of rows with f32
    # scales): one step up in the scale dtype fixes it. Same arithmetic as ``scaled``.
    over = jnp.isfinite(amax) & (amax * (1.0 / s.astype(jnp.float32)) > m)
    s = jnp.where(over, jnp.nextafter(s, jnp.array(jnp.inf, sdt)), s)
    if sdt != jnp.float32:  # fp16 overflow: cap, so the row saturates instead of 0 * inf = NaN
        s = jnp.minimum(s, jnp.array(jnp.finfo(sdt).max, sdt))
    return s


def saturation_count(x, scale, dtype):
    """Number of finite elements whose scaled magnitude exceeds fmax (would be clipped)."""
    y = scaled(x, scale)
    return jnp.sum((jnp.abs(y) > fmax(dtype)) & jnp.isfinite(x)).astype(jnp.float32)


def warn_unit_scale(k_or_v: str = "K/V") -> None:
    log.warning(
        "fp8 KV cache with a static %s scale of 1.0 (no calibration): values beyond +-fmax "
        "saturate and small values lose precision. Pass kv_scales=None to calibrate, a "
        "scales JSON from `python -m jfp8kv.calibrate`, or use --kv-scale-mode token/block.",
        k_or_v,
    )


def np_reference_quantize(x: np.ndarray, scale: float, dtype) -> np.ndarray:
    """ml_dtypes oracle used by tests: clip(x * fl(1/scale)) in float32, cast by ml_dtypes."""
    import ml_dtypes

    target = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}[
        jnp.dtype(dtype).name
    ]
    m = fmax(dtype)
    y = np.clip(x.astype(np.float32) * (np.float32(1) / np.asarray(scale, np.float32)), -m, m)
    return y.astype(np.float32).astype(target)
