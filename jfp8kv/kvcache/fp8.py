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
  an eager scalar, and XLA on GPU and Triton divide with ``div.full.f32`` (not correctly
  rounded); so ``x / s`` gives different bits in different places. One correctly rounded
  reciprocal per scale (``reciprocal``: integer arithmetic, exact on every backend), then
  one float32 multiply per element, is reproducible everywhere; kernels must do exactly
  that (call ``reciprocal``, or ``div_rn``; never a plain ``/``).
* NaN stays NaN (``clip`` propagates it) and is counted by the store.
* The store counts an element saturated when the clip changes its value: |x * fl(1/s)|
  beyond ``SATURATES_ABOVE`` (464 for e4m3), not merely an ulp above fmax.
* Dynamic scales are ``amax * fl(1/fmax)`` floored at a tiny positive value (an all-zero
  row quantizes to zeros instead of 0/0), rounded up to the scale dtype and nudged one
  step up where ``amax * fl(1/s)`` would still exceed fmax: dynamic modes never saturate
  a finite row (fp16 block scales cap at 65504: rows beyond 65504 x fmax do saturate).
"""

from __future__ import annotations

import logging

import jax
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
# Saturation is counted past these magnitudes (see saturation_count): the midpoint between
# fmax and the next power of the format, above which round-to-nearest-even leaves the range
# (464 for e4m3, whose tie rounds down to 448; 61440 for e5m2, whose tie rounds up to 65536).
# A float32 value a few ulps above fmax rounds to fmax anyway: the clip changes nothing there.
SATURATES_ABOVE = {"float8_e4m3fn": 464.0,
                   "float8_e5m2": float(np.nextafter(np.float32(61440.0), np.float32(0)))}
# fl(1 / fmax) in float32: dynamic scales multiply by it (see dynamic_scale).
INV_FMAX = {k: float(np.float32(1.0) / np.float32(v)) for k, v in FMAX.items()}
# Floor of dynamic scales: keeps x / s finite for all-zero rows.
SCALE_FLOOR = 1e-12
# Floor of fp16 block scales: the smallest positive fp16 subnormal.
SCALE_FLOOR_F16 = 2.0**-24


def storage_dtype_name(kv_cache_dtype: str, compute_dtype: str) -> str:
    """Map a user-facing ``kv_cache_dtype`` ("auto", "fp8", "fp8_e4m3", ...) to a jnp dtype name."""
    if kv_cache_dtype == "auto":
        return compute_dtype  # float64 too, in the float64 check mode
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


def reciprocal(s):
    """Correctly rounded float32 ``1 / s`` on every backend, by integer long division.

    XLA on GPU and Triton lower float32 division to ``div.full.f32`` (up to 1-2 ulp off;
    measured on an H200 with jax 0.11.2: 1/s differs from IEEE for 14% of random s), so
    ``1.0 / s`` is not the same number everywhere. Here, for s = M * 2^(e - 150) with
    M in [2^23, 2^24): 1/s = round(2^47 / M) * 2^(103 - e), the quotient taken 8 bits at a
    time in uint32 (no tie is possible unless M = 2^23, an exact power of two). Zero,
    subnormal, huge (>= 2^126), inf and NaN inputs fall back to ``1.0 / s``; scales never
    take those values.
    """
    s = jnp.asarray(s, jnp.float32)
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    e = (bits >> 23) & 0xFF  # biased exponent
    m = (bits & 0x7FFFFF) | 0x800000  # 24-bit significand
    r = jnp.full_like(m, 1 << 23)  # remainder of 2^23 / m (< m)
    q = jnp.zeros_like(m)
    for _ in range(3):  # 3 x 8 quotient bits: q = floor(2^47 / m)
        t = r << 8  # < 2^32 as r < m < 2^24
        d = t // m
        r = t - d * m
        q = (q << 8) | d
    q = q + (2 * r > m).astype(jnp.uint32)  # round to nearest (never a tie)
    pow2 = m == 0x800000  # 1/s exact: 2^(127 - unbiased e)
    exp = jnp.where(pow2, 254 - e, 253 - e)
    mant = jnp.where(pow2, 0, q - 0x800000)
    out = (bits & jnp.uint32(0x80000000)) | (exp << 23) | mant
    normal = (e >= 1) & (e <= 252)
    return jnp.where(normal, jax.lax.bitcast_convert_type(out, jnp.float32), 1.0 / s)


def scaled(x, scale):
    """The float32 value that is cast: ``x * fl(1 / scale)``; ``scale`` broadcasts.

    The reciprocal is taken on ``scale`` as given (before broadcasting), so pass scales in
    their compact shape ([..., 1], not broadcast to x).
    """
    return jnp.asarray(x).astype(jnp.float32) * reciprocal(scale)


def quantize(x, scale, dtype):
    """``cast(clip(x * fl(1/scale), -fmax, fmax))``; ``scale`` broadcasts against ``x``."""
    return saturating_cast(scaled(x, scale), dtype)


def quantize_counted(x, scale, dtype, *, reciprocal=reciprocal, cast=saturating_cast):
    """``(quantize(x, scale, dtype), saturation_count(x, scale, dtype))`` from one product.

    Kernels pass their own primitives: ``reciprocal`` (any correctly rounded one, e.g.
    ``rcp.rn.f32``) and ``cast`` (``encode_saturating`` where the backend's cast double-rounds).
    """
    x = jnp.asarray(x).astype(jnp.float32)
    y = x * reciprocal(scale)
    return cast(y, dtype), _count_saturated(x, y, dtype)


def dequantize(q, scale, out_dtype=jnp.float32):
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(out_dtype)


def amax_ignoring_nan(x, axis=-1):
    """max |x| along ``axis`` with NaN ignored (+-inf kept); 0 for an all-NaN row.

    Explicit because XLA's CPU reduce-max drops NaN in its vectorised path and propagates
    it elsewhere: the dynamic scale of a row with a NaN would otherwise depend on shapes.
    """
    ax = jnp.abs(jnp.asarray(x).astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isnan(ax), 0.0, ax), axis=axis)


def _ceil_to_f16(s):
    """Smallest fp16 value >= s, as an exactly representable float32 (s >= 2^-24, finite).

    Bit arithmetic, no fp16 conversion: XLA on GPU (default ``xla_allow_excess_precision``)
    elides f32 -> f16 -> f32 round trips, so ``s.astype(f16) < s`` is never true there and
    a conversion-based round-up silently rounds to nearest instead.
    """
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    up = jax.lax.bitcast_convert_type((bits + 0x1FFF) & jnp.uint32(0xFFFFE000), jnp.float32)
    sub = jnp.ceil(s * 2.0**24) * 2.0**-24  # fp16 subnormals: a 2^-24 grid
    return jnp.where(s >= 2.0**-14, up, sub)  # normals: 11 significant bits


def dynamic_scale(amax, dtype, scale_dtype=jnp.float32, *, reciprocal=reciprocal):
    """Scale mapping ``amax`` onto ``fmax``, floored, rounded *up* to ``scale_dtype``.

    ``scale_dtype`` is float32 (token mode) or float16 (block mode). Rounding the scale up
    (never down) guarantees |x * fl(1/s)| <= fmax for the row's own values, so dynamic modes
    never saturate finite inputs -- except fp16 scales, which cap at 65504 instead of
    overflowing to inf (rows with amax > 65504 x fmax saturate, and are counted).
    ``amax`` comes from ``amax_ignoring_nan``: a NaN element stays NaN in the data and the
    rest of its row keeps a proper scale. A NaN/inf amax gives scale 1.0 (inf saturates).
    Kernels pass their own correctly rounded ``reciprocal``; the numbers are the same.
    """
    m = fmax(dtype)
    sdt = jnp.dtype(scale_dtype)
    if sdt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)):
        raise ValueError(f"dynamic scales are float32 or float16, not {sdt}")
    amax = amax.astype(jnp.float32)
    # An explicit multiply: XLA rewrites ``amax / fmax`` into it anyway; others may not.
    s = jnp.maximum(amax * jnp.float32(INV_FMAX[jnp.dtype(dtype).name]), SCALE_FLOOR)
    s = jnp.where(jnp.isfinite(s), s, 1.0)
    if sdt == jnp.float16:
        s = _ceil_to_f16(jnp.maximum(s, SCALE_FLOOR_F16))
    # fl(amax * fl(1/s)) can still land one float32 ulp above fmax (~0.3% of rows with f32
    # scales): one step up in the scale dtype fixes it. Same arithmetic as ``scaled``.
    over = jnp.isfinite(amax) & (amax * reciprocal(s) > m)
    step_up = jnp.nextafter(s, jnp.float32(jnp.inf))
    if sdt == jnp.float32:
        return jnp.where(over, step_up, s)
    s = jnp.where(over, _ceil_to_f16(step_up), s)
    # fp16 overflow: cap, so the row saturates instead of reading back 0 * inf = NaN. The
    # value is exactly representable, so this cast does not round.
    return jnp.minimum(s, 65504.0).astype(jnp.float16)


# (mantissa bits, exponent bias, NaN magnitude code) of each fp8 format.
_FP8_BITS = {"float8_e4m3fn": (3, 7, 0x7F), "float8_e5m2": (2, 15, 0x7E)}


def fp8_bits(y, dtype_name: str):
    """Round-to-nearest-even fp8 bit pattern (int32 in [0, 255]) of float32 ``y``, by integer
    arithmetic: the NaN codes of ``ml_dtypes``, no backend cast involved (some double-round).

    ``y`` must already be clipped to +-fmax (or be NaN). Works in jnp and inside kernels.
    """
    mbits, bias, nan_code = _FP8_BITS[dtype_name]
    bits = jax.lax.bitcast_convert_type(y.astype(jnp.float32), jnp.int32)
    sign = jax.lax.shift_right_logical(bits, 31)
    a = bits & 0x7FFFFFFF
    # Normal results: round the f32 bit pattern to `mbits` mantissa bits, then re-bias.
    shift = 23 - mbits
    lsb = jax.lax.shift_right_logical(a, shift) & 1
    rnd = a + ((1 << (shift - 1)) - 1) + lsb
    normal = jax.lax.shift_right_logical(rnd, shift) - ((127 - bias) << mbits)
    # Subnormal results: the integer multiple of 2^(1 - bias - mbits), rounded to even.
    e = jax.lax.shift_right_logical(a, 23)
    m = (a & 0x7FFFFF) | 0x800000
    sh = jnp.minimum((150 + 1 - bias - mbits) - e, 25)
    sh = jnp.maximum(sh, 1)
    q = jax.lax.shift_right_logical(m, sh)
    rem = m & (jax.lax.shift_left(jnp.ones_like(m), sh) - 1)
    half = jax.lax.shift_left(jnp.ones_like(m), sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.astype(jnp.int32)
    min_normal = (127 - bias + 1) << 23
    mag = jnp.where(a >= min_normal, normal, sub)
    mag = jnp.where(a > 0x7F800000, nan_code, mag)
    return (sign << 7) | mag


def encode_saturating(y, dtype):
    """``saturating_cast`` by integer arithmetic (``fp8_bits``), for kernels: the clip keeps
    NaN explicitly (Triton's max/min ignore it)."""
    name = jnp.dtype(dtype).name
    m = FMAX[name]
    y = y.astype(jnp.float32)
    yc = jnp.where(jnp.isnan(y), y, jnp.minimum(jnp.maximum(y, -m), m))
    return jax.lax.bitcast_convert_type(fp8_bits(yc, name).astype(jnp.uint8), jnp.dtype(name))


def hardware_saturating_cast(y, dtype):
    """``saturating_cast`` for kernels on devices whose f32 -> fp8 conversion is exact RNE
    (Triton on sm_90+: one ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` per pair). The clip is a
    compare-and-select, which keeps NaN (Triton's min/max would turn it into +-fmax)."""
    m = FMAX[jnp.dtype(dtype).name]  # a Python float: Pallas lowers it as a constant
    y = y.astype(jnp.float32)
    y = jnp.where(y > m, m, jnp.where(y < -m, -m, y))
    return y.astype(dtype)


def satfinite_cast(y, dtype):
    """``saturating_cast`` as one ``cvt.rn.satfinite`` per pair, no clip: the instruction
    saturates finite overflow and +-inf to +-fmax and keeps NaN (PTX ISA). sm_90+ GPU only:
    elsewhere (XLA on CPU, Triton below sm_90) a bare cast turns overflow into NaN/inf."""
    return y.astype(jnp.float32).astype(dtype)


# The casts a kernel may use for f32 -> fp8 (``kernel_cast``); each equals
# ``saturating_cast`` where it applies (bit for bit, NaN payloads aside).
KERNEL_CASTS = {"software": encode_saturating, "hardware": hardware_saturating_cast,
                "satfinite": satfinite_cast}
# From this compute capability the hardware conversion is exact: sm_90 converts f32 -> fp8
# with one RNE ``cvt.rn.satfinite``; Triton on sm_89 goes through f16 (double rounding).
HARDWARE_CAST_MIN_CAPABILITY = (9, 0)
# The cast used from that capability: "satfinite" (the cvt alone), proven bit-exact on an
# H200 by ``test_store_cast_exhaustive[...-satfinite-gpu]`` (bench/results/gpu-tests-h200.json).
HARDWARE_CAST = "satfinite"


def kernel_cast_name(compute_capability) -> str:
    """Which ``KERNEL_CASTS`` entry a kernel uses on a device: ``HARDWARE_CAST`` from sm_90
    (proven bit-exact through the store kernel by ``tests/kernels/test_store.py``'s gpu
    tests over every bf16 pattern and the f32 tie points), else "software"
    (``compute_capability`` None: interpret mode / no GPU; or a "9.0" string or (9, 0))."""
    if compute_capability is None:
        return "software"
    if isinstance(compute_capability, str):
        compute_capability = tuple(int(p) for p in compute_capability.split(".")[:2])
    exact = tuple(compute_capability) >= HARDWARE_CAST_MIN_CAPABILITY
    return HARDWARE_CAST if exact else "software"


def kernel_cast(name: str):
    """The cast function of a ``KERNEL_CASTS`` name; a ValueError names the choices."""
    try:
        return KERNEL_CASTS[name]
    except KeyError:
        raise ValueError(f"unknown fp8 kernel cast {name!r}; choose one of "
                         f"{['auto', *KERNEL_CASTS]}") from None


def saturation_count(x, scale, dtype):
    """Number of finite elements the clip changes: their scaled magnitude rounds past fmax
    (``SATURATES_ABOVE``). Values between fmax and that bound round to fmax with or without
    the clip, so the count does not depend on the last float32 bit of ``x * fl(1/s)``: XLA
    may compute a fused row twice (once for its amax, once for the multiply) with different
    float32 rounding, and a dynamic scale's own amax then lands an ulp above fmax."""
    return _count_saturated(x, scaled(x, scale), dtype)


def _count_saturated(x, y, dtype):
    limit = SATURATES_ABOVE[jnp.dtype(dtype).name]
    return jnp.sum(((jnp.abs(y) > limit) & jnp.isfinite(x)).astype(jnp.float32))


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
