"""MLA latent attention on the Pallas Triton backend: decode (absorbed) and prefill/extend.

Contract
--------
``latent_attention(q, pages, scale, page_tables, seq_lens, q_positions, cfg, sm_scale,
value_dim, interpret=False, tuning=None) -> out`` is ``mla_reference.latent_attention``:

* q [B, T, H, R] absorbed queries ``[W_UK_h^T q_nope_h | q_rope_h]``; pages: one layer's
  latent pool [1, P, S, R] (``cfg.layout == "latent"``), rows ``[c | k_rope]``;
  scale: the pool's scales (``token``: one f32 per row, ``block``: one f16 per 32
  values; unscaled for 16/32-bit pages). Static modes do not apply to latents (ValueError).
* Every head attends the same latent rows (MQA with one KV head of width R): score =
  q . row * sm_scale, value = the first ``value_dim`` (= kv_lora_rank) columns of the row.
  Query (b, t) sees key j iff j < seq_lens[b] and j <= q_positions[b, t] (decode too: the
  kernel honours positions for T == 1); a query that sees no key returns zeros.
* out [B, T, H, value_dim] in q's dtype (o_lat; the caller applies W_UV per head).
* Numerics as the dense kernels (``pallas_decode``): fp8 rows upcast to f16 exactly, the
  dots in f16 with f32 accumulation (q cast to f16: |q| < 65504); per-token scales on the
  logits and probabilities, per-block scales on the tile; bf16/f16 pages: dots in the
  storage dtype; f32 pages: IEEE f32 dots.
* Static: cfg, sm_scale, value_dim, interpret, tuning. Nothing is donated. Needs
  kv_lora_rank and qk_rope_head_dim powers of two (Triton block shapes; 512 + 64 for
  DeepSeek-V2/V3), else a ValueError naming the reference backend.

Kernel
------
One program per (batch row, block of ``block_m`` (query, head) rows, split). Row i of the
flattened [T * H] (query, head) index is t = i // H, h = i % H, gathered straight from q
and scattered straight into the output. T == 1 (decode) makes a block a group of heads
sharing the one latent KV head, so each latent byte is read once per (head block, split):
H = 16 heads (DeepSeek-V2-Lite) fit one block. Each tile of ``block_k`` tokens is read as
two column chunks through ``tiles.load_kv_raw``: the latent c [BK, r] and the RoPE tail
[BK, d_r] (block scales per chunk); the logits are q_c . c + q_r . k_r (``softmax_step``
with chunk tuples) and the value tile is the same dequantized c (no second read). The key
range [0, min(seq_len, max position in the block + 1)) is cut into ``num_splits``
tile-aligned parts (``pallas_decode.choose_splits``) merged by ``combine_splits``; the key
loop, masking (tokens at or past the end read nothing, so NaN in unused pages never
reaches the output) and online softmax are ``tiles``'.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.config import CacheConfig
from jfp8kv.kernels.pallas_decode import (DecodeTuning, SplitTuning, choose_splits,
                                          combine_splits, split_state_shapes, triton_call)
from jfp8kv.kernels.tiles import (LOG2E, KVLayout, Variant, check_dot_tile, cols,
                                  dequant_kv, init_state, k_variant, key_loop, load_kv_raw,
                                  next_pow2, normalize, softmax_step)


@dataclasses.dataclass(frozen=True)
class MLATuning(SplitTuning):
    """``SplitTuning`` with its own defaults, plus ``block_m`` (query, head) rows per
    program, 0: the largest power of two >= 16 that covers T * H, capped so the f32
    accumulator [block_m, r] stays near 32 KiB. ``vmask`` and ``nomma`` variants do not
    apply: the value tile is the key's latent chunk."""

    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 2
    block_m: int = 0

    def rows(self, n_rows: int, rank: int) -> int:
        if self.block_m:
            return self.block_m
        cap = max(16, min(64, 8192 // next_pow2(rank)))
        return min(max(16, next_pow2(n_rows)), cap)


def default_tuning(cfg: CacheConfig) -> MLATuning:
    """The H200 sweep's best at 16 heads, B = 64, ctx 4096 (bench/results/mla-kernels-h200.json):
    4 warps; 64-token tiles, 2 stages for bf16 and token-scaled rows; 32-token tiles, 3 stages
    for block scales. Page prefetch; PTX upcast for fp8."""
    block = cfg.scale_mode == "block"
    return MLATuning(block_k=32 if block else 64, num_warps=4, num_stages=3 if block else 2,
                     variant=Variant(page_prefetch=True, asm=cfg.is_fp8))


def check_shapes(cfg: CacheConfig, width: int, value_dim: int) -> None:
    """ValueError unless the latent rows fit the kernel (see the contract)."""
    if cfg.layout != "latent" or cfg.num_kv_heads != 1 or cfg.head_dim != width:
        raise ValueError("the Pallas MLA kernel needs a latent cache (CacheConfig.layout="
                         f"'latent', one KV head of width {width}); got layout "
                         f"{cfg.layout!r}, {cfg.num_kv_heads} heads of {cfg.head_dim}")
    rope = width - value_dim
    for name, n in (("kv_lora_rank", value_dim), ("qk_rope_head_dim", rope)):
        if n < 1 or n & (n - 1):
            raise ValueError(f"the Pallas MLA kernel needs {name} a power of two, got {n}; "
                             "use attention backend 'reference' for this model")
    if KVLayout.of(cfg).mode.is_static:
        raise ValueError(f"kv_scale_mode={cfg.scale_mode!r} does not apply to the MLA latent "
                         "cache; use 'block' or 'token'")


def _mla_kernel(len_ref, pt_ref, pos_ref, q_ref, p_ref, s_ref, *out_refs, sm_scale, rank,
                block_m, block_k, num_splits, kv, split, variant):
    # len_ref [B]; pt_ref [B, MP]; pos_ref [B, T] i32; q_ref [B, T, H, R];
    # p_ref [1, P*S, R]; s_ref None | [1, P*S*G] (the policy's kernel layout)
    b, mb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t_len, nh, width = q_ref.shape[1], q_ref.shape[2], q_ref.shape[3]
    rope = width - rank
    i = mb * block_m + jnp.arange(block_m, dtype=jnp.int32)
    t_idx, h_idx = i // nh, i % nh
    row_ok = t_idx < t_len

    def load_q(col0, d):
        x = plgpu.load(q_ref.at[b, t_idx[:, None], h_idx[:, None], col0 + cols(d)],
                       mask=jnp.broadcast_to(row_ok[:, None], (block_m, d)), other=0.0)
        return x.astype(jnp.float32).astype(kv.cdt)

    q_c, q_r = load_q(0, rank), load_q(rank, rope)
    qpos = plgpu.load(pos_ref.at[b, t_idx], mask=row_ok, other=-1)  # [M]
    kv_end = jnp.minimum(len_ref[b], jnp.max(qpos) + 1)
    per_split = ((kv_end + num_splits - 1) // num_splits + block_k - 1) // block_k * block_k
    start = sp * per_split
    end = jnp.minimum(kv_end, start + per_split)
    kvar = k_variant(variant)

    def step(tok, valid, rows, state):
        c, c_tok = dequant_kv(*load_kv_raw(p_ref, s_ref, 0, rows, valid, kv, 0, rank),
                              valid, kv, kvar)
        k_r, _ = dequant_kv(*load_kv_raw(p_ref, s_ref, 0, rows, valid, kv, rank, rope),
                            valid, kv, kvar)  # a per-token scale is c's (one per row)
        visible = valid[None, :] & (tok[None, :] <= qpos[:, None])
        return softmax_step(state, (q_c, q_r), (c, k_r), c_tok, visible, sm_scale * LOG2E,
                            lambda: (c, c_tok), kv.cdt)

    acc, m_i, l_i = key_loop(pt_ref, b, start, end, block_k, kv.page_size,
                             init_state(block_m, rank), step, variant.page_prefetch)
    if not split:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[b, t_idx[:, None], h_idx[:, None], cols(rank)],
                    normalize(acc, l_i).astype(o_ref.dtype),
                    mask=jnp.broadcast_to(row_ok[:, None], (block_m, rank)))
    else:  # every row of the block is stored (padding rows are sliced off after the merge)
        o_ref, m_ref, l_ref = out_refs
        r_idx = jnp.arange(block_m, dtype=jnp.int32)
        plgpu.store(o_ref.at[b, mb, sp, r_idx[:, None], cols(rank)], acc)
        plgpu.store(m_ref.at[b, mb, sp, r_idx], m_i)
        plgpu.store(l_ref.at[b, mb, sp, r_idx], l_i)


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale", "value_dim", "interpret",
                                             "tuning"))
def latent_attention(q, pages, scale, page_tables, seq_lens, q_positions, cfg: CacheConfig,
                     sm_scale: float, value_dim: int, interpret: bool = False,
                     tuning: MLATuning | None = None):
    """q [B, T, H, R] -> [B, T, H, value_dim]; the contract above (T == 1 is decode)."""
    tuning = tuning or default_tuning(cfg)
    b, t, nh, width = q.shape
    check_shapes(cfg, width, value_dim)
    check_dot_tile("block_k", tuning.block_k)
    bm = tuning.rows(t * nh, value_dim)
    check_dot_tile("block_m", bm)
    nmb = -(-(t * nh) // bm)
    kv = KVLayout.of(cfg)
    ns = choose_splits(b, nmb, page_tables.shape[1] * cfg.page_size, DecodeTuning(
        block_k=tuning.block_k, num_splits=tuning.num_splits,
        target_programs=tuning.target_programs))
    split = ns > 1
    out_shape = (split_state_shapes((b, nmb, ns), bm, value_dim) if split
                 else (jax.ShapeDtypeStruct((b, t, nh, value_dim), q.dtype),))
    variant = dataclasses.replace(tuning.variant.resolve(cfg, interpret), vmask=False,
                                  nomma=False)
    kernel = functools.partial(
        _mla_kernel, sm_scale=float(sm_scale), rank=value_dim, block_m=bm,
        block_k=tuning.block_k, num_splits=ns, kv=kv, split=split, variant=variant)
    outs = triton_call(kernel, grid=(b, nmb, ns), out_shape=out_shape, tuning=tuning,
                       interpret=interpret, name="jfp8kv_mla_attention")(seq_lens.astype(jnp.int32), page_tables.astype(jnp.int32),
      q_positions.astype(jnp.int32), q, pages.reshape(1, -1, width),
      kv.mode.kernel_scales(scale, 1))
    if not split:
        return outs[0]
    out = combine_splits(*outs).reshape(b, nmb * bm, value_dim)[:, :t * nh]
    return out.reshape(b, t, nh, value_dim).astype(q.dtype)
