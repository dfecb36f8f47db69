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

``prologue_store`` is the same kernel with the attention prologue in front
(``kernels.prologue``: q/k RMS norm and RoPE): it reads the raw q, k, v heads of one qkv
array, stores the rotated K and V and writes the rotated queries, so that a layer's slice,
norm and RoPE kernels disappear into the store (docs/lab/engine-notes.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.config import CacheConfig
from jfp8kv.kernels.prologue import QKPrologue
from jfp8kv.kernels.tiles import next_pow2
from jfp8kv.kvcache import fp8, scale_modes
from jfp8kv.kvcache.cache import LayerKV, reduce_stat_rows

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


def _group_channels(cfg):
    """The scale mode's group view [1, G, W] of the channels (c = group * W + j)."""
    g, w = scale_modes.of(cfg).group_view(cfg.head_dim, cfg.scale_block)
    return (jnp.arange(g, dtype=jnp.int32)[None, :, None] * w
            + jnp.arange(w, dtype=jnp.int32)[None, None, :])


def _load_rows(x_ref, tok, ok, head, c):
    """x_ref[tok, head, c] as f32 [BN, ...c's shape], 0 where ``ok`` ([BN], or [BN, R, 1])
    is false: ``head`` a scalar or an index array broadcasting against c."""
    shape = jnp.broadcast_shapes(tok[:, None, None].shape, jnp.shape(head), c.shape)
    mask = jnp.broadcast_to(ok[:, None, None] if ok.ndim == 1 else ok, shape)
    return plgpu.load(x_ref.at[tok[:, None, None], head, c], mask=mask,
                      other=0.0).astype(jnp.float32)


def _norm_rope(load, c, w_ref, cos_ref, sin_ref, tok, ok, eps, dtype):
    """``prologue.apply`` on rows loaded by ``load(channels)``: channels c [1, R, C] are a
    row's D channels as [1, 1, D] (queries: R heads per token) or K's group view [1, G, W].
    Norm (when ``w_ref``) and rotate-half RoPE with the reference's two roundings to
    ``dtype``; channel c's rotate-half partner is loaded directly, so no lanes move."""
    d = cos_ref.shape[-1]
    half = d // 2
    partner = jnp.where(c < half, c + half, c - half)
    x, xp = load(c), load(partner)
    if w_ref is not None:  # the sum of squares over flat rows [BN, R, D], as the reference
        rows = x if c.shape[-1] == d else load(jnp.arange(d, dtype=jnp.int32)[None, None, :])
        r = jax.lax.rsqrt(jnp.sum(rows * rows, axis=2, keepdims=True) / d + eps)
        x = ((x * r) * plgpu.load(w_ref.at[c]).astype(jnp.float32)).astype(dtype)
        xp = ((xp * r) * plgpu.load(w_ref.at[partner]).astype(jnp.float32)).astype(dtype)
        x, xp = x.astype(jnp.float32), xp.astype(jnp.float32)
    shape = jnp.broadcast_shapes(tok[:, None, None].shape, c.shape)
    tmask = jnp.broadcast_to(ok[:, None, None], shape)
    cos = plgpu.load(cos_ref.at[tok[:, None, None], c], mask=tmask, other=0.0)
    sin = plgpu.load(sin_ref.at[tok[:, None, None], c], mask=tmask, other=0.0)
    rot = jnp.where(c < half, -xp, xp)
    return (x * cos + rot * sin).astype(dtype)


def _store_one(x, pages_ref, scale_in_ref, scale_out_ref, h, ok, slots, valid, cfg,
               interpret, cast):
    """Quantize rows x [BN, G, W] f32 (the scale mode's group view of ``_group_channels``)
    of head h and scatter them. pages_ref [Hkv, P*S, D]. Quantized by the policy, with this
    backend's primitives (``recip_rn`` and ``cast``, one of ``fp8.KERNEL_CASTS``).
    Returns (saturated, nan count, amax) f32 scalars over the valid lanes.
    """
    mode = scale_modes.of(cfg)
    bn, g, w = x.shape
    c = _group_channels(cfg)
    vmask = valid[:, None, None]
    ld_mask = jnp.broadcast_to(ok[:, None, None], (bn, g, w))
    x = jnp.where(vmask, x, 0.0)  # padding lanes are stored as zeros
    nan = jnp.isnan(x)
    n_nan = jnp.sum(nan.astype(jnp.float32))
    if mode.is_dynamic:  # the mode's own amax expression (NaN ignored): computed once
        amax_all = jnp.max(fp8.amax_ignoring_nan(x))
    else:
        amax_all = jnp.max(jnp.where(nan, 0.0, jnp.abs(x)))
    static = None
    if mode.is_static:  # loaded in x's own shape (per channel) or as a scalar (one scale per
        # tensor: every entry equal); a [1, 1, D] f32 operand would make Triton re-lay x out
        # through shared memory and reduce across threads (sm_90 PTX: 2,893 -> 1,550 / 1,695
        # instructions per tensor / channel program, bench/results/store-ptx-stats.json)
        static = (plgpu.load(scale_in_ref.at[h, jnp.broadcast_to(c, (bn, g, w))])
                  if mode.per_channel else jnp.full((1, 1, 1), scale_in_ref[h, 0], jnp.float32))
    # static scales arrive as their reciprocals (``_launch``), so the product x * (1/s) takes
    # no per-element reciprocal here; dynamic scales are the kernel's own (one per row/group)
    recip = (lambda inv: inv) if mode.is_static else functools.partial(recip_rn,
                                                                      interpret=interpret)
    q, s, sat = mode.quantize(x, static, pages_ref.dtype, cast=cast, reciprocal=recip)
    if s is not None:  # dynamic scales [BN, G] at flat index slot * G + group
        idx = slots[:, None] * g + jnp.arange(g, dtype=jnp.int32)[None, :]
        plgpu.store(scale_out_ref.at[h, idx], s, mask=jnp.broadcast_to(ok[:, None], (bn, g)))
    plgpu.store(pages_ref.at[h, slots[:, None, None], c], q, mask=ld_mask)
    return sat, n_nan, amax_all


@dataclasses.dataclass(frozen=True)
class _Prologue:
    """Static facts of a fused prologue: query heads, norm or not, eps."""

    q_heads: int
    norm: bool
    eps: float


def _store_kernel(slots_ref, k_ref, v_ref, _k_pages_in, _v_pages_in, ks_in, vs_in, *refs,
                  cfg, block_n, dynamic, interpret, cast, pro):
    # slots_ref [N] i32; k_ref/v_ref [N, Hkv, D] compute dtype; pages [Hkv, P*S, D]
    # scales: static 1/s [Hkv, D] f32 (read only) | token [Hkv, P*S] f32 | block [Hkv, P*S*nb] f16
    # with a prologue (``pro``): k_ref and v_ref are both qkv [N, H + 2 Hkv, D] (q, k, v
    # heads), then inputs cos/sin [N, D] f32, [q_norm, k_norm [D]]
    # refs (outputs): k_pages, v_pages (aliased), [k_scale, v_scale (aliased)], stats
    # [grid_n, Hkv, 8] f32, [q_out [N, H, D]].
    k_head = v_head = pl.program_id(1)
    if pro is not None:
        q_ref = k_ref
        k_head, v_head = k_head + pro.q_heads, v_head + pro.q_heads + cfg.num_kv_heads
        cos_ref, sin_ref, *refs = refs
        qn_ref, kn_ref, *refs = refs if pro.norm else (None, None, *refs)
        *refs, qo_ref = refs
    ks_out = vs_out = None
    if dynamic:
        k_pages, v_pages, ks_out, vs_out, stats_ref = refs
    else:
        k_pages, v_pages, stats_ref = refs
    i, h = pl.program_id(0), pl.program_id(1)
    n = k_ref.shape[0]
    tok = i * block_n + jnp.arange(block_n, dtype=jnp.int32)
    ok = tok < n
    # Lanes past N get an out-of-range slot: their (masked) writes can never alias a real one.
    slots = plgpu.load(slots_ref.at[tok], mask=ok, other=k_pages.shape[1])
    valid = ok & (slots >= cfg.page_size)
    c = _group_channels(cfg)
    if pro is None:
        k = _load_rows(k_ref, tok, ok, k_head, c)
    else:
        rope = functools.partial(_norm_rope, cos_ref=cos_ref, sin_ref=sin_ref, tok=tok, ok=ok,
                                 eps=pro.eps, dtype=k_ref.dtype)
        # norm and RoPE over whole rows [BN, 1, D], then the mode's group view [BN, G, W]
        # (in the group view the norm's sum of squares needs a third load of each row)
        row = jnp.arange(cfg.head_dim, dtype=jnp.int32)[None, None, :]
        k = rope(lambda ch: _load_rows(k_ref, tok, ok, k_head, ch), row,
                 kn_ref).astype(jnp.float32).reshape(block_n, *c.shape[1:])
        _query_prologue(q_ref, qo_ref, qn_ref, rope, h, tok, ok,
                        pro.q_heads // cfg.num_kv_heads)
    args = (h, ok, slots, valid, cfg, interpret, cast)
    k_stats = _store_one(k, k_pages, ks_in, ks_out, *args)
    v_stats = _store_one(_load_rows(v_ref, tok, ok, v_head, c), v_pages, vs_in, vs_out,
                         *args)
    vals = (k_stats[0], v_stats[0], k_stats[1], v_stats[1], k_stats[2], v_stats[2])
    col = jnp.arange(STAT_PAD, dtype=jnp.int32)
    row = jnp.zeros((STAT_PAD,), jnp.float32)
    for j, val in enumerate(vals):
        row = jnp.where(col == j, val, row)
    plgpu.store(stats_ref.at[i, h, col], row)


def _query_prologue(q_ref, qo_ref, qn_ref, rope, h, tok, ok, groups):
    """The prologue of KV head h's query heads h*G .. h*G+G-1 (padded to a power of two)
    for tokens ``tok``: read from q_ref [N, >= H, D] (heads 0 .. H-1), written to qo_ref
    [N, H, D]."""
    d = q_ref.shape[-1]
    gi = jnp.arange(next_pow2(groups), dtype=jnp.int32)
    heads = (h * groups + gi)[None, :, None]  # [1, Gp, 1]
    c = jnp.arange(d, dtype=jnp.int32)[None, None, :]
    row_ok = ok[:, None, None] & (gi < groups)[None, :, None]  # [BN, Gp, 1]
    y = rope(lambda ch: _load_rows(q_ref, tok, row_ok, heads, ch), c, qn_ref)
    plgpu.store(qo_ref.at[tok[:, None, None], heads, c], y,
                mask=jnp.broadcast_to(row_ok, y.shape))


_STATIC = ("cfg", "interpret", "block_n", "num_warps", "fp8_cast", "stat_rows")


@functools.partial(jax.jit, static_argnames=_STATIC)
def store_kv(layer: LayerKV, k_new, v_new, slots, cfg: CacheConfig, interpret: bool = False,
             block_n: int = 32, num_warps: int = 4, fp8_cast: str = "auto",
             stat_rows: bool = False):
    """Same contract as ``reference.store_kv``; returns (layer, stats_row float32[6]), or
    with ``stat_rows`` the per-program partial rows [programs, 6] unreduced (a caller that
    stores many layers reduces them all at once: ``cache.reduce_stat_rows``, one kernel
    instead of two per layer).

    Static: cfg, interpret, block_n, num_warps, fp8_cast ("auto": the policy's choice for
    this device, ``fp8.kernel_cast_name``; or "hardware" / "software" to force one, for
    tests, benchmarks and static PTX statistics), stat_rows. Donate ``layer`` in the
    caller's jit for an in-place update.
    """
    layer, rows, _ = _launch(layer, k_new, v_new, slots, cfg, interpret, block_n, num_warps,
                             fp8_cast)
    return layer, rows if stat_rows else reduce_stat_rows(rows)


@functools.partial(jax.jit, static_argnames=_STATIC)
def prologue_store(qkv, pro: QKPrologue, layer: LayerKV, slots, cfg: CacheConfig,
                   interpret: bool = False, block_n: int = 8, num_warps: int = 4,
                   fp8_cast: str = "auto", stat_rows: bool = False):
    """``prologue.apply`` fused into the store. qkv [N, H + 2 Hkv, D]: the chunk's raw q, k
    and v heads in that order, one array (so XLA hands the merged QKV projection over
    without slicing it) -> (q' [N, H, D], layer, stats_row), layer/stats as ``store_kv``
    for K = k'. One program per (token block, KV head) normalizes and rotates its K rows
    and its G = H / Hkv query heads. Static arguments as ``store_kv``; K is stored as
    computed (no ``kv_rotation``).
    ``block_n`` 8 (not the plain store's 32): a decode step's few rows still spread over
    many programs, and a program's G query heads fit its registers (sm_90 PTX: 80-122
    registers at 8, up to 255 with spills at 32)."""
    hkv = cfg.num_kv_heads
    h = qkv.shape[1] - 2 * hkv
    if h <= 0 or h % hkv:
        raise ValueError(f"qkv has {qkv.shape[1]} heads: expected H + 2 * {hkv} with H a "
                         f"multiple of the {hkv} KV heads")
    static = _Prologue(h, pro.has_norm, float(pro.eps))
    ins = [pro.cos.astype(jnp.float32), pro.sin.astype(jnp.float32)]
    if pro.has_norm:
        ins += [pro.q_norm, pro.k_norm]
    layer, rows, q_out = _launch(layer, qkv, qkv, slots, cfg, interpret, block_n, num_warps,
                                 fp8_cast, static, ins,
                                 jax.ShapeDtypeStruct((qkv.shape[0], h, qkv.shape[2]),
                                                      qkv.dtype))
    return q_out, layer, rows if stat_rows else reduce_stat_rows(rows)


def _launch(layer, k_new, v_new, slots, cfg, interpret, block_n, num_warps, fp8_cast,
            pro=None, pro_inputs=(), q_shape=None):
    """The store's ``pallas_call`` (with the prologue's inputs and a q_shape output when
    ``pro``): (layer, stats rows [programs, 6] (``cache.reduce_stat_rows`` gives the stats
    row), q_out or None)."""
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
    if mode.is_static:  # 1/s once per call ([Hkv, D], correctly rounded), not per element:
        # channel mode's per-element rcp.rn took 20 MUFU.RCP and 16 slow-path calls per
        # program in sm_90 SASS (docs/lab/kernels-notes.md)
        kin, vin = fp8.reciprocal(ks), fp8.reciprocal(vs)
    else:
        kin, vin = ks, vs
    pages_shape = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    out_shape = [pages_shape, pages_shape]
    aliases = {3: 0, 4: 1}
    if dynamic:
        out_shape += [jax.ShapeDtypeStruct(ks.shape, ks.dtype)] * 2
        aliases.update({5: 2, 6: 3})
    out_shape.append(jax.ShapeDtypeStruct((grid_n, hkv, STAT_PAD), jnp.float32))
    if pro is not None:
        out_shape.append(q_shape)
    kernel = functools.partial(_store_kernel, cfg=cfg, block_n=block_n, dynamic=dynamic,
                               interpret=interpret, cast=cast, pro=pro)
    outs = pl.pallas_call(
        kernel, grid=(grid_n, hkv), out_shape=tuple(out_shape),
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="jfp8kv_store_kv" if pro is None else "jfp8kv_prologue_store_kv",
    )(slots.astype(jnp.int32), k_new, v_new, k_pages, v_pages, kin, vin, *pro_inputs)
    q_out = None
    if pro is not None:
        *outs, q_out = outs
    if dynamic:
        k_pages, v_pages, ks, vs, part = outs
        k_scale, v_scale = ks.reshape(layer.k_scale.shape), vs.reshape(layer.v_scale.shape)
    else:
        k_pages, v_pages, part = outs
        k_scale, v_scale = layer.k_scale, layer.v_scale
    stats = part[..., :6].reshape(-1, 6)  # one partial row per program
    new_layer = LayerKV(k_pages.reshape(layer.k.shape), v_pages.reshape(layer.v.shape),
                        k_scale, v_scale)
    return new_layer, stats, q_out
