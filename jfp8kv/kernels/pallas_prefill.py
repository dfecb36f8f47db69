"""Paged prefill / extend attention on the Pallas Triton backend.

A ragged chunk of T new queries per sequence attends causally over the cached prefix and
itself (``reference.paged_attention``'s contract: query (b, t) sees key j iff
j < seq_lens[b] and j <= q_positions[b, t]); K/V are read through the storage format.

One program per (batch row, KV head, block of BT queries). Its M = BT * Gp rows are
(query t, q head g) pairs of that KV head (Gp = next_pow2(G); row r is t = r // Gp,
g = r % Gp), gathered straight from q [B, T, H, D] and scattered straight into the output,
so no transpose runs outside the kernel. The key loop walks tiles of ``block_k`` tokens
from 0 to min(seq_len, max position in the block + 1) with the decode kernel's tiles,
masking and online softmax (``tiles``); the causal mask is by position. With
``Variant.split_loop`` the tiles before the block's smallest position (keys every row sees)
run first without masks, the diagonal tiles after them with masks. Rows that see no key
(padding queries, empty slots) are zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.config import CacheConfig
from jfp8kv.kernels.tiles import (LOG2E, KVLayout, QueryRotation, Variant, as_variant,
                                  check_head_dim, cols, init_state, k_variant, key_loop,
                                  load_kv_tile, next_pow2, normalize, prepare_q, scale_output,
                                  softmax_step)
from jfp8kv.kvcache.cache import LayerKV


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Static launch knobs: ``block_m`` rows (queries x padded group) and ``block_k`` keys.

    ``variant``: a ``tiles.Variant`` (short spelling accepted). Page prefetch is off by
    default for prefill (measured slower, docs/lab/kernels-notes.md).
    """

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    variant: Variant = Variant()

    def __post_init__(self):
        object.__setattr__(self, "variant", as_variant(self.variant))


def default_tuning(cfg: CacheConfig) -> PrefillTuning:
    """The measured best per storage family (``python -m bench.kernels --sweep-prefill``,
    bench/results/kernels-h200-prefill.json): fp8 pages take 128-key tiles (token mode 0.49
    vs 0.70 ms at 64 keys, 2,048 queries over 4,096 cached, 32/8/128 heads), bf16 64.
    fp8 pages also run the keys every query row sees in an unmasked loop of their own
    (``Variant.split_loop``: 0.84-0.95x the time at 8k x 8k causal and 2k after 2k; bf16
    level, so unchanged; ``--compare split_loop``, bench/results/kernels-split-loop-h200.json)."""
    if cfg.is_fp8:
        return PrefillTuning(block_k=128, variant=Variant(split_loop=True))
    return PrefillTuning()


def _prefill_kernel(len_ref, pt_ref, pos_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, *refs,
                    sm_scale, num_groups, group_pad, kv, block_m, block_k, variant, rot):
    # len_ref [B]; pt_ref [B, MP]; pos_ref [B, T] i32; q_ref/o_ref [B, T, Hkv, G, D]
    # k_ref/v_ref [Hkv, P*S, D]; scales in the policy's kernel layout (see tiles)
    # refs: [the rotation's matrix [D, D] when ``rot``], o_ref
    rot_ref, o_ref = refs if rot is not None else (None, *refs)
    b, h, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t_len, d = q_ref.shape[1], q_ref.shape[-1]
    bt = block_m // group_pad
    r = jnp.arange(block_m, dtype=jnp.int32)
    t_idx = qb * bt + r // group_pad  # [M]
    g_idx = r % group_pad
    row_ok = (t_idx < t_len) & (g_idx < num_groups)
    row_mask = jnp.broadcast_to(row_ok[:, None], (block_m, d))

    q = plgpu.load(q_ref.at[b, t_idx[:, None], h, g_idx[:, None], cols(d)], mask=row_mask,
                   other=0.0).astype(jnp.float32)  # [M, D]
    if rot is not None:
        q = rot.apply(q, rot_ref, q_ref.dtype)
    q = prepare_q(q, ks_ref, h, kv)
    qpos = plgpu.load(pos_ref.at[b, t_idx], mask=row_ok, other=-1)  # [M]
    kv_end = jnp.minimum(len_ref[b], jnp.max(qpos) + 1)
    qk_scale = sm_scale * LOG2E
    kvar = k_variant(variant)

    def step(tok, valid, rows, state):
        k, k_tok = load_kv_tile(k_ref, ks_ref, h, rows, valid, kv, kvar)
        visible = None if valid is None else valid[None, :] & (tok[None, :] <= qpos[:, None])
        return softmax_step(state, q, k, k_tok, visible, qk_scale,
                            lambda: load_kv_tile(v_ref, vs_ref, h, rows, valid, kv, variant),
                            kv.cdt)

    acc, _, l_i = key_loop(pt_ref, b, 0, kv_end, block_k, kv.page_size,
                           init_state(block_m, d), step, variant.page_prefetch,
                           full_tiles_end(kv_end, qpos, row_ok) if variant.split_loop else None)
    out = normalize(scale_output(acc, vs_ref, h, kv), l_i)
    plgpu.store(o_ref.at[b, t_idx[:, None], h, g_idx[:, None], cols(d)],
                out.astype(o_ref.dtype), mask=row_mask)


def full_tiles_end(kv_end, qpos, row_ok):
    """Keys before the smallest real row's position + 1 are seen by every row of the block
    (``key_loop``'s ``full_end``)."""
    return jnp.minimum(kv_end, jnp.min(jnp.where(row_ok, qpos, kv_end)) + 1)


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale", "interpret", "tuning"))
def prefill_attention(q, layer: LayerKV, page_tables, seq_lens, q_positions, cfg: CacheConfig,
                      sm_scale: float, interpret: bool = False,
                      tuning: PrefillTuning | None = None):
    """q [B, T, H, D] -> [B, T, H, D]; the contract of ``reference.paged_attention`` on
    ``k_transform.query_rows(q)`` (a rotating ``cfg.kv_rotation``: the kernel rotates the
    queries, ``tiles.QueryRotation``).

    Static: cfg, sm_scale, interpret, tuning. Nothing is donated.
    """
    tuning = tuning or default_tuning(cfg)
    b, t, nh, d = q.shape
    hkv = cfg.num_kv_heads
    g = nh // hkv
    gp = next_pow2(g)
    check_head_dim(d)
    block_m = max(tuning.block_m, gp, 16)
    if block_m & (block_m - 1) or tuning.block_k & (tuning.block_k - 1):
        raise ValueError("block_m and block_k must be powers of two")
    bt = block_m // gp
    kv = KVLayout.of(cfg)
    rot = QueryRotation.of(cfg)
    qg = q.reshape(b, t, hkv, g, d)
    kernel = functools.partial(
        _prefill_kernel, sm_scale=float(sm_scale), num_groups=g, group_pad=gp, kv=kv,
        block_m=block_m, block_k=tuning.block_k,
        variant=tuning.variant.resolve(cfg, interpret), rot=rot)
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, -(-t // bt)),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
        name="jfp8kv_paged_prefill",
    )(seq_lens.astype(jnp.int32), page_tables.astype(jnp.int32),
      q_positions.astype(jnp.int32), qg, *kv.operands(layer, hkv),
      *([] if rot is None else [QueryRotation.matrix(cfg)]))
    return out.reshape(b, t, nh, d)
