"""Fused quantize-and-store of new K/V rows into the paged cache (Pallas Triton backend).

One ``pallas_call`` per layer writes K and V of all N new tokens. Program (i, h) takes
tokens [i*BN, (i+1)*BN) of KV head h: it computes the scales the mode needs, quantizes
with the saturating cast of ``jfp8kv.kvcache.fp8`` and scatters rows (and dynamic scales)
in place (``input_output_aliases``: the page arrays are updated, not copied, when the
caller donates the cache). It also writes per-program partial statistics, which plain jnp
reduces to the ``stats_row`` of the contract (sums of exact small integers and a max).

Bit-exactness with ``reference.store_kv``: the kernel calls the same policy code
(``ScaleMode.quantize``: ``fp8.dynamic_scale``, ``fp8.quantize_counted``) with two
primitives of its own:
* a correctly rounded reciprocal (``rcp.rn.f32`` inline PTX on the GPU, because Triton
  lowers ``/`` on f32 to the approximate ``div.full.f32``);
* the fp32 -> fp8 cast the policy picks for the device (``fp8.kernel_cast_name``): from
  sm_90 the hardware conversion (``fp8.hardware_saturating_cast``: a NaN-keeping clip, then
  one ``cvt.rn.satfinite`` per pair), elsewhere (sm_89, interpret mode) integer arithmetic
  (``fp8.encode_saturating``, exact RNE with the NaN encodings of ``ml_dtypes``), as
  Triton's cast double-rounds through f16 below sm_90;
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
from jfp8kv.kvcache import fp8, scale_modes
from jfp8kv.kvcache.cache import LayerKV

STAT_PAD = 8  # stats partial rows are padded to a power of two


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


def device_capability(interpret: bool):
    """The GPU's compute capability ("9.0"), or None in interpret mode / without a GPU."""
    if interpret:
        return None
    try:
        return jax.devices("gpu")[0].compute_capability
    except RuntimeError:
        return None


def _store_one(x_ref, pages_ref, scale_in_ref, scale_out_ref, h, tok, ok, slots, valid, cfg,
               interpret, cast):
    """Quantize one tensor (K or V) for tokens ``tok`` of head h and scatter it.

    x_ref [N, Hkv, D]; pages_ref [Hkv, P*S, D]. Rows are loaded in the scale mode's group
    view [BN, G, W] (channel c = group * W + j) and quantized by the policy, with this
    backend's primitives (``recip_rn`` and ``cast``, one of ``fp8.KERNEL_CASTS``).
    Returns (saturated, nan count, amax) f32 scalars over the valid lanes.
    """
    mode = scale_modes.of(cfg)
    g, w = mode.group_view(cfg.head_dim, cfg.scale_block)
    bn = tok.shape[0]
    c = (jnp.arange(g, dtype=jnp.int32)[None, :, None] * w
         + jnp.arange(w, dtype=jnp.int32)[None, None, :])  # [1, G, W]
    vmask = valid[:, None, None]
    ld_mask = jnp.broadcast_to(ok[:, None, None], (bn, g, w))
    x = plgpu.load(x_ref.at[tok[:, None, None], h, c], mask=ld_mask,
                   other=0.0).astype(jnp.float32)
    x = jnp.where(vmask, x, 0.0)  # padding lanes are stored as zeros
    nan = jnp.isnan(x)
    n_nan = jnp.sum(nan.astype(jnp.float32))
    if mode.is_dynamic:  # the mode's own amax expression (NaN ignored): computed once
        amax_all = jnp.max(fp8.amax_ignoring_nan(x))
    else:
        amax_all = jnp.max(jnp.where(nan, 0.0, jnp.abs(x)))
    static = plgpu.load(scale_in_ref.at[h, c]) if mode.is_static else None  # [1, 1, D]
    q, s, sat = mode.quantize(x, static, pages_ref.dtype, cast=cast,
                              reciprocal=functools.partial(recip_rn, interpret=interpret))
    if s is not None:  # dynamic scales [BN, G] at flat index slot * G + group
        idx = slots[:, None] * g + jnp.arange(g, dtype=jnp.int32)[None, :]
        plgpu.store(scale_out_ref.at[h, idx], s, mask=jnp.broadcast_to(ok[:, None], (bn, g)))
    plgpu.store(pages_ref.at[h, slots[:, None, None], c], q, mask=ld_mask)
    return sat, n_nan, amax_all


def _store_kernel(slots_ref, k_ref, v_ref, _k_pages_in, _v_pages_in, ks_in, vs_in, *refs,
                  cfg, block_n, dynamic, interpret, cast):
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
    args = (h, tok, ok, slots, valid, cfg, interpret, cast)
    k_stats = _store_one(k_ref, k_pages, ks_in, ks_out, *args)
    v_stats = _store_one(v_ref, v_pages, vs_in, vs_out, *args)
    vals = (k_stats[0], v_stats[0], k_stats[1], v_stats[1], k_stats[2], v_stats[2])
    col = jnp.arange(STAT_PAD, dtype=jnp.int32)
    row = jnp.zeros((STAT_PAD,), jnp.float32)
    for j, val in enumerate(vals):
        row = jnp.where(col == j, val, row)
    plgpu.store(stats_ref.at[i, h, col], row)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "block_n", "num_warps",
                                             "fp8_cast"))
def store_kv(layer: LayerKV, k_new, v_new, slots, cfg: CacheConfig, interpret: bool = False,
             block_n: int = 32, num_warps: int = 4, fp8_cast: str = "auto"):
    """Same contract as ``reference.store_kv``; returns (layer, stats_row float32[6]).

    Static: cfg, interpret, block_n, num_warps, fp8_cast ("auto": the policy's choice for
    this device, ``fp8.kernel_cast_name``; or "hardware" / "software" to force one, for
    tests, benchmarks and static PTX statistics). Donate ``layer`` in the caller's jit for
    an in-place update.
    """
    if fp8_cast == "auto":
        fp8_cast = fp8.kernel_cast_name(device_capability(interpret))
    cast = fp8.kernel_cast(fp8_cast)
    n = k_new.shape[0]
    hkv, p, s, d = cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim
    if d & (d - 1) or d % cfg.scale_block:
        raise ValueError(f"head_dim must be a power of two for the Pallas store, got {d}")
    mode = scale_modes.of(cfg)
    dynamic = mode.is_dynamic
    grid_n = max(1, -(-n // block_n))
    k_pages = layer.k.reshape(hkv, p * s, d)
    v_pages = layer.v.reshape(hkv, p * s, d)
    ks, vs = mode.kernel_scales(layer.k_scale, hkv), mode.kernel_scales(layer.v_scale, hkv)
    pages_shape = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    out_shape = [pages_shape, pages_shape]
    aliases = {3: 0, 4: 1}
    if dynamic:
        out_shape += [jax.ShapeDtypeStruct(ks.shape, ks.dtype)] * 2
        aliases.update({5: 2, 6: 3})
    out_shape.append(jax.ShapeDtypeStruct((grid_n, hkv, STAT_PAD), jnp.float32))
    kernel = functools.partial(_store_kernel, cfg=cfg, block_n=block_n, dynamic=dynamic,
                               interpret=interpret, cast=cast)
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
