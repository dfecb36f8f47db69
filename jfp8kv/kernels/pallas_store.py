"""Fused quantize-and-store of new K/V rows into the paged cache (Pallas Triton backend).

One ``pallas_call`` per layer writes K and V of all N new tokens. Program (i, h) takes
tokens [i*BN, (i+1)*BN) of KV head h: it computes the scales the mode needs, quantizes
with the saturating cast of ``jfp8kv.kvcache.fp8`` and scatters rows (and dynamic scales)
in place (``input_output_aliases``: the page arrays are updated, not copied, when the
caller donates the cache). It also writes per-program partial statistics, which plain jnp
reduces to the ``stats_row`` of the contract (sums of exact small integers and a max).

Bit-exactness with ``reference.store_kv``:
* quantize is ``x * fl(1/s)`` as ``fp8.py`` says, with a correctly rounded reciprocal
  (``rcp.rn.f32`` inline PTX on the GPU, because Triton lowers ``/`` on f32 to the
  approximate ``div.full.f32``); dynamic scales follow ``fp8.dynamic_scale`` step by step;
* the fp32 -> fp8 cast is done with integer arithmetic (``f32_to_fp8_bits``), exact RNE
  with the NaN encodings of ``ml_dtypes``, so no Triton cast path (some double-round)
  is involved;
* NaN is handled explicitly (Triton's max/min ignore NaN, XLA's may or may not): amax
  ignores NaN (``fp8.amax_ignoring_nan``), the clip keeps NaN.

Padding lanes (slot < page_size, i.e. page 0) are written like the reference does (with
zeroed inputs) and excluded from the statistics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache import fp8
from jfp8kv.kvcache.cache import STATIC_MODES, LayerKV

# (mantissa bits, exponent bias, NaN magnitude code) of each fp8 format.
_FP8_FORMAT = {"float8_e4m3fn": (3, 7, 0x7F), "float8_e5m2": (2, 15, 0x7E)}
STAT_PAD = 8  # stats partial rows are padded to a power of two


def f32_to_fp8_bits(y, dtype_name: str):
    """Round-to-nearest-even fp8 bit pattern (int32 in [0, 255]) of float32 ``y``.

    ``y`` must already be clipped to +-fmax (or be NaN). Works in jnp and inside kernels.
    """
    mbits, bias, nan_code = _FP8_FORMAT[dtype_name]
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


def recip_rn(s, interpret: bool):
    """Correctly rounded f32 reciprocal ``fl(1 / s)``: ``rcp.rn.f32`` on the GPU (Triton's
    ``/`` is the approximate ``div.full.f32``), plain division in interpret mode."""
    s = s.astype(jnp.float32)
    if interpret:
        return 1.0 / s
    (out,) = plgpu.elementwise_inline_asm(
        "rcp.rn.f32 $0, $1;", args=[s], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.float32)])
    return out


def _next_up(s):
    """nextafter(s, +inf) for positive f32/f16 ``s`` (inf stays inf)."""
    it = jnp.int32 if s.dtype == jnp.float32 else jnp.int16
    up = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(s, it) + jnp.array(1, it), s.dtype)
    return jnp.where(jnp.isinf(s), s, up)


def _quantize(x, s, dtype_name: str, interpret: bool):
    """``fp8.quantize`` and ``fp8.saturation_count``: x f32, s f32 in its compact shape
    (broadcastable to x). Returns (fp8 values, saturated count f32)."""
    m = fp8.FMAX[dtype_name]
    y = x * recip_rn(s, interpret)
    sat = jnp.sum(((jnp.abs(y) > m) & jnp.isfinite(x)).astype(jnp.float32))
    yc = jnp.where(jnp.isnan(y), y, jnp.minimum(jnp.maximum(y, -m), m))
    bits = f32_to_fp8_bits(yc, dtype_name).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(bits, jnp.dtype(dtype_name)), sat


def _dynamic_scale(amax, dtype_name: str, f16: bool, interpret: bool):
    """``fp8.dynamic_scale`` step by step (amax: NaN-free f32). Returns (stored, f32)."""
    m = fp8.FMAX[dtype_name]
    s = jnp.maximum(amax * jnp.float32(fp8.INV_FMAX[dtype_name]), fp8.SCALE_FLOOR)
    s = jnp.where(jnp.isfinite(s), s, 1.0)
    if f16:
        s = jnp.maximum(s, fp8.SCALE_FLOOR_F16)
        r = s.astype(jnp.float16)
        s = jnp.where(r.astype(jnp.float32) < s, _next_up(r), r)
    over = jnp.isfinite(amax) & (amax * recip_rn(s.astype(jnp.float32), interpret) > m)
    s = jnp.where(over, _next_up(s), s)
    if f16:
        s = jnp.minimum(s, jnp.array(jnp.finfo(jnp.float16).max, jnp.float16))
    return s, s.astype(jnp.float32)


def _store_one(x_ref, pages_ref, scale_in_ref, scale_out_ref, h, tok, ok, slots, valid, cfg,
               interpret):
    """Quantize one tensor (K or V) for tokens ``tok`` of head h and scatter it.

    x_ref [N, Hkv, D]; pages_ref [Hkv, P*S, D]. Block mode works on [BN, nb, blk] tiles
    (channel index c = block * blk + j), the other modes on [BN, D].
    Returns (saturated, nan count, amax) f32 scalars over the valid lanes.
    """
    d = cfg.head_dim
    kind = None if not cfg.is_fp8 else ("static" if cfg.scale_mode in STATIC_MODES
                                          else cfg.scale_mode)
    bn = tok.shape[0]
    if kind == "block":
        nb, blk = d // cfg.scale_block, cfg.scale_block
        cb = jnp.arange(nb, dtype=jnp.int32)[None, :, None]
        c = cb * blk + jnp.arange(blk, dtype=jnp.int32)[None, None, :]  # [1, nb, blk]
        shape, tok_i, slot_i, vmask = (bn, nb, blk), tok[:, None, None], slots[:, None, None], \
            valid[:, None, None]
    else:
        c = jnp.arange(d, dtype=jnp.int32)[None, :]  # [1, D]
        shape, tok_i, slot_i, vmask = (bn, d), tok[:, None], slots[:, None], valid[:, None]
    ld_mask = jnp.broadcast_to(ok.reshape((bn,) + (1,) * (len(shape) - 1)), shape)
    x = plgpu.load(x_ref.at[tok_i, h, c], mask=ld_mask, other=0.0).astype(jnp.float32)
    x = jnp.where(vmask, x, 0.0)  # padding lanes are stored as zeros
    nan = jnp.isnan(x)
    n_nan = jnp.sum(nan.astype(jnp.float32))
    amax_all = jnp.max(jnp.where(nan, 0.0, jnp.abs(x)))
    sat = jnp.float32(0)
    name = cfg.storage_dtype
    if kind is None:
        q = x.astype(pages_ref.dtype)
    elif kind == "static":
        s = plgpu.load(scale_in_ref.at[h, c])  # [1, D]
        q, sat = _quantize(x, s, name, interpret)
    else:
        # fp8.amax_ignoring_nan over the row (token) or the block (last axis)
        amax = jnp.max(jnp.where(nan, 0.0, jnp.abs(x)), axis=len(shape) - 1)
        s, s32 = _dynamic_scale(amax, name, kind == "block", interpret)
        q, sat = _quantize(x, s32[..., None], name, interpret)
        if kind == "token":
            plgpu.store(scale_out_ref.at[h, slots], s, mask=ok)
        else:
            nb = shape[1]
            cbs = jnp.arange(nb, dtype=jnp.int32)[None, :]
            plgpu.store(scale_out_ref.at[h, slots[:, None] * nb + cbs], s,
                        mask=jnp.broadcast_to(ok[:, None], (bn, nb)))
    plgpu.store(pages_ref.at[h, slot_i, c], q, mask=ld_mask)
    return sat, n_nan, amax_all


def _store_kernel(slots_ref, k_ref, v_ref, _k_pages_in, _v_pages_in, ks_in, vs_in, *refs,
                  cfg, block_n, dynamic, interpret):
    # slots_ref [N] i32; k_ref/v_ref [N, Hkv, D] compute dtype; pages [Hkv, P*S, D]
    # scales: static [Hkv, D] f32 (read only) | token [Hkv, P*S] f32 | block [Hkv, P*S*nb] f16
    # refs (outputs): k_pages, v_pages (aliased), [k_scale, v_scale (aliased)], stats
    # [grid_n, Hkv, 8] f32.
    if dynamic:
        k_pages, v_pages, ks_out, vs_out, stats_ref = refs
    else:
        k_pages, v_pages, stats_ref = refs
        ks_out = vs_out = None
    i, h = pl.program_id(0), pl.program_id(1)
    n = k_ref.shape[0]
    tok = i * block_n + jnp.arange(block_n, dtype=jnp.int32)
    ok = tok < n
    # Lanes past N get an out-of-range slot: their (masked) writes can never alias a real one.
    slots = plgpu.load(slots_ref.at[tok], mask=ok, other=k_pages.shape[1])
    valid = ok & (slots >= cfg.page_size)
    k_stats = _store_one(k_ref, k_pages, ks_in, ks_out, h, tok, ok, slots, valid, cfg, interpret)
    v_stats = _store_one(v_ref, v_pages, vs_in, vs_out, h, tok, ok, slots, valid, cfg, interpret)
    vals = (k_stats[0], v_stats[0], k_stats[1], v_stats[1], k_stats[2], v_stats[2])
    col = jnp.arange(STAT_PAD, dtype=jnp.int32)
    row = jnp.zeros((STAT_PAD,), jnp.float32)
    for j, val in enumerate(vals):
        row = jnp.where(col == j, val, row)
    plgpu.store(stats_ref.at[i, h, col], row)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "block_n", "num_warps"))
def store_kv(layer: LayerKV, k_new, v_new, slots, cfg: CacheConfig, interpret: bool = False,
             block_n: int = 32, num_warps: int = 4):
    """Same contract as ``reference.store_kv``; returns (layer, stats_row float32[6]).

    Static: cfg, interpret, block_n, num_warps. Donate ``layer`` in the caller's jit for an
    in-place update.
    """
    n = k_new.shape[0]
    hkv, p, s, d = cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim
    if d & (d - 1) or d % cfg.scale_block:
        raise ValueError(f"head_dim must be a power of two for the Pallas store, got {d}")
    dynamic = cfg.is_fp8 and cfg.scale_mode not in STATIC_MODES
    static = cfg.is_fp8 and cfg.scale_mode in STATIC_MODES
    grid_n = max(1, -(-n // block_n))
    k_pages = layer.k.reshape(hkv, p * s, d)
    v_pages = layer.v.reshape(hkv, p * s, d)
    if dynamic:
        ks, vs = layer.k_scale.reshape(hkv, -1), layer.v_scale.reshape(hkv, -1)
    elif static:
        ks, vs = layer.k_scale, layer.v_scale
    else:
        ks = vs = None
    pages_shape = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    out_shape = [pages_shape, pages_shape]
    aliases = {3: 0, 4: 1}
    if dynamic:
        out_shape += [jax.ShapeDtypeStruct(ks.shape, ks.dtype)] * 2
        aliases.update({5: 2, 6: 3})
    out_shape.append(jax.ShapeDtypeStruct((grid_n, hkv, STAT_PAD), jnp.float32))
    kernel = functools.partial(_store_kernel, cfg=cfg, block_n=block_n, dynamic=dynamic,
                               interpret=interpret)
    outs = pl.pallas_call(
        kernel, grid=(grid_n, hkv), out_shape=tuple(out_shape),
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="jfp8kv_store_kv",
    )(slots.astype(jnp.int32), k_new, v_new, k_pages, v_pages, ks, vs)
    if dynamic:
        k_pages, v_pages, ks, vs, part = outs
        k_scale, v_scale = ks.reshape(layer.k_scale.shape), vs.reshape(layer.v_scale.shape)
    else:
        k_pages, v_pages, part = outs
        k_scale, v_scale = layer.k_scale, layer.v_scale
    counts = jnp.sum(part[..., :4].astype(jnp.int32), axis=(0, 1)).astype(jnp.float32)
    amax = jnp.max(part[..., 4:6], axis=(0, 1))
    stats = jnp.concatenate([counts, amax])
    new_layer = LayerKV(k_pages.reshape(layer.k.shape), v_pages.reshape(layer.v.shape),
                        k_scale, v_scale)
    return new_layer, stats
