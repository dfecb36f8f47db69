"""Paged prefill / extend attention on Pallas Mosaic GPU (Hopper, sm_90a), beside
``pallas_prefill`` (Triton); the ``pallas`` backend takes it on Hopper where it measured
faster (``kernels.mosaic_prefill_runs``).

FlashAttention-3's structure over pages. One program per (batch row, query head, block of
128 queries): two *compute* warpgroups hold 64 query rows each (wgmma's M) and one *memory*
warpgroup walks the KV head's page table, copying each tile's pages (``block_k`` keys of K,
V and, in token mode, their scales) with TMA into ``stages`` slots that both compute
warpgroups read.
bf16/f16 pages are wgmma operands as they land; fp8 pages land in a ring of their own that
the memory warpgroup upcasts, each tile once, into the f16 slots both compute warpgroups read
(or, with ``upcast_wgs=2``, the memory warpgroup K and a fourth warpgroup V).
q.K^T and P.V run as wgmma around the online softmax, the two warpgroups taking turns at the
tensor cores (``pingpong``, FA3's schedule barrier).

Masking follows ``reference.paged_attention``'s contract by position: query (b, t) sees key
j iff j < seq_lens[b] and j <= q_positions[b, t], with positions in any order. Per 64-row
block XLA computes the keys it needs (min(seq_len, max position + 1)) and the keys every
row sees (min(seq_len, min position + 1)): tiles below the latter run unmasked, the rest
masked. Rows past the program's keys may hold anything (unwritten slots, or page 0 where a
page lies past them; NaN in the tests): K's are masked out of the logits, and V's are zeroed
in the program's last tile before P.V reads them (P is 0 there, but 0 x NaN is NaN). Rows that
see no key are zero.

Numerics: ``pallas_prefill``'s (operands in the pages' dot dtype: f16 for fp8 pages, bf16
for bf16 pages; f32 accumulation; token scales on logits and probabilities; static K scales
folded into q outside, static V scales on the accumulator); with ``compute="fp8"`` (e4m3
pages) q.K^T and P.V are e4m3 wgmmas, ``fp8_products``' contract. Supported:
bf16/f16 and fp8 pages; no, token, tensor and channel scales; head_dim 64 or 128; page sizes
>= 8 that divide the key tile or are multiples of it; 128-key tiles for 16-bit pages only,
and at most 3 stages for fp8 pages (shared memory); no K rotation. ``check_supported`` and
``check_tuning`` raise ValueError for the rest.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jfp8kv.config import CacheConfig
from jfp8kv.kernels import fp8_products
from jfp8kv.kernels.fp8_products import P_MAX
from jfp8kv.kernels.mosaic_ops import (ROWS, MosaicOps, grouped_queries, interpret_kwargs,
                                       layout_problems, load_plgpu, take_turns)
from jfp8kv.kernels.mosaic_prefill_walk import (CWGS, Program, block_ends,
                                                fp8_products_warpgroup, gathered_scales,
                                                memory_warpgroup, scratch, tiles,
                                                upcasting_warpgroup)
from jfp8kv.kernels.tiles import LOG2E, KVLayout
from jfp8kv.kvcache.cache import LayerKV

BLOCK_KS = (64, 128)  # keys per tile (``MosaicPrefillTuning.block_k``)


@dataclasses.dataclass(frozen=True)
class MosaicPrefillTuning:
    """``stages``: K/V tiles in flight per program. ``pingpong``: FA3's schedule barrier, the
    two compute warpgroups taking turns at the tensor cores (one's softmax runs while the
    other's wgmma does). ``block_k``: keys per tile, 64 or 128 (16-bit pages, 2 stages: the
    CPU lowering counts 3 stages of 128 keys 102 bytes over the 232,448 of shared memory)."""

    stages: int = 3
    pingpong: bool = True
    block_k: int = 64
    # Mosaic's automatic warpgroup barrier before every TMA copy and around every shared-
    # memory store (12 a tile in the fp8 memory warpgroup, 24 with token scales). Off: the
    # kernel's own barriers order every access (a slot is rewritten only after "consumed";
    # the fp8 slot after "read", which every memory thread passes once its upcast has read
    # it; f16 tiles reach the wgmma through commit_smem, whose warpgroup barrier precedes
    # "ready"; each thread stores exactly the elements it loaded where it does both).
    auto_barriers: bool = False
    # The online softmax runs as jax's FA3 kernel writes it (the running max in log2 units,
    # one FFMA a logit). ``early_rescale``: the accumulator rescaled, and P cast, before the
    # ping-pong turn (pinned there by an optimization barrier), so the warpgroup's tensor-core
    # turn starts with its wgmma; None: by the pages, as measured on the H200
    # (docs/lab/kernels-notes.md): on for 16-bit pages (-5% at 8k x 8k, -17% at 2k after 4k) and
    # token scales (-2%, -8%), off for fp8 with static scales (+2%, +15% with it).
    early_rescale: bool | None = None
    # fp8 pages: warpgroups that upcast each tile. 1: one memory warpgroup copies and
    # upcasts K and V (96 registers a thread). 2: the first copies the tile and upcasts K (and
    # its scales), a second upcasts V (and its scales) at the same time; with four
    # warpgroups (128 registers a thread at launch) the two take 56 a thread so that the
    # compute warpgroups keep 200. Not yet timed on a GPU: off by default.
    upcast_wgs: int = 1
    # token scales: gathered per batch row in XLA first ([Hkv, B, keys], 8 bytes a key and
    # KV head), so that a tile's K and V scales are two 4 * block_k-byte copies, not two
    # 4 * page_size-byte copies a page (8 a tile at 16-token pages). Not yet timed on a GPU.
    gather_scales: bool = False
    # "dequant": fp8 tiles upcast to f16 for 16-bit products. "fp8": q quantized to e4m3 per
    # row and q.K^T an e4m3 wgmma on K as it landed (``fp8_products``' contract; e4m3 pages,
    # token/tensor/channel scales, the default softmax, one memory warpgroup, no gathering).
    compute: str = "dequant"

    def rescales_early(self, cfg: CacheConfig) -> bool:
        if self.early_rescale is not None:
            return self.early_rescale
        return not (cfg.is_fp8 and KVLayout.of(cfg).mode.is_static)


def check_supported(cfg: CacheConfig, num_heads: int, block_k: int = 64) -> None:
    """ValueError naming what this kernel cannot run (``pallas_prefill`` runs all of it)."""
    problems = []
    if not cfg.is_fp8 and jnp.dtype(cfg.storage_dtype) not in (jnp.bfloat16, jnp.float16):
        problems.append(f"storage {cfg.storage_dtype} (bfloat16, float16 or fp8)")
    problems += layout_problems(cfg, block_k)
    if block_k != 64 and cfg.is_fp8:
        problems.append(f"block_k {block_k} with fp8 pages (64)")
    if num_heads % cfg.num_kv_heads:
        problems.append(f"{num_heads} query heads over {cfg.num_kv_heads} KV heads")
    if problems:
        raise ValueError("the Mosaic GPU prefill kernel does not support " + "; ".join(problems)
                         + "; use the Triton kernel (pallas_prefill)")


COMPUTES = ("dequant", "fp8")  # ``MosaicPrefillTuning.compute``


def check_tuning(cfg: CacheConfig, tuning: MosaicPrefillTuning) -> None:
    """ValueError naming what works for a tuning this kernel cannot run on ``cfg``."""
    if tuning.block_k not in BLOCK_KS:
        raise ValueError(f"block_k must be one of {BLOCK_KS}, got {tuning.block_k}")
    if cfg.is_fp8 and tuning.stages > 3:  # 3 x (fp8 tile + its f16 copy): 176 KB
        raise ValueError(f"fp8 pages take at most 3 stages (shared memory), got {tuning.stages}")
    if tuning.upcast_wgs not in (1, 2):
        raise ValueError(f"upcast_wgs must be 1 or 2, got {tuning.upcast_wgs}")
    if tuning.compute not in COMPUTES:
        raise ValueError(f"compute must be one of {COMPUTES}, got {tuning.compute!r}")
    if tuning.compute == "fp8":
        fp8_products.check_config(cfg)
        if (tuning.upcast_wgs, tuning.gather_scales) != (1, False):
            raise ValueError("compute='fp8' runs with upcast_wgs=1 and gather_scales=False")


class _Dims(NamedTuple):
    """The kernel's static parameters."""

    page_size: int
    stages: int
    fp8: bool
    token_scales: bool
    static_v: bool
    qk_scale: float  # sm_scale * log2(e)
    d: int
    group: int  # query heads per KV head
    cdt: str  # the dot operands' dtype (``KVLayout.cdt``)
    pingpong: bool
    block_k: int
    num_blocks: int  # query blocks (programs per batch row and head)
    early_rescale: bool = True
    upcast_wgs: int = 1  # fp8 pages: 1 or 2 (``MosaicPrefillTuning.upcast_wgs``); else 1
    gather_scales: bool = False  # token scales gathered per batch row (else False)
    f8: bool = False  # fp8 products (``MosaicPrefillTuning.compute == "fp8"``)


def _kernel(len_ref, pt_ref, end_ref, pos_ref, q_ref, k_ref, v_ref, *refs, dims, plgpu, lay):
    # len_ref [B]; pt_ref [B, MP]; end_ref [B, blocks, 2] (keys needed, keys every row sees)
    # per 64-row block; pos_ref [B, Tp]; q_ref / o_ref [B, Tp, H, D]; k_ref / v_ref
    # [Hkv, P*S, D]; then token scales [Hkv, P*S] x 2 (``gather_scales``: [Hkv, B, keys]),
    # or static V scales [Hkv, D]
    refs = list(refs)
    qs_ref = refs.pop(0) if dims.f8 else None  # q8's row scales [B, H, Tp]
    pc_ref = refs.pop(0) if dims.f8 and dims.token_scales else None  # P's scales [B, Hkv]
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if dims.token_scales else (None, None)
    vsc_ref = refs.pop(0) if dims.static_v else None
    o_ref, smem, barriers = refs
    b, h = lax.axis_index("b"), lax.axis_index("h")
    # the last query blocks (the longest causal key ranges) launch first: a shorter tail
    qb = dims.num_blocks - 1 - lax.axis_index("qb")
    kv_end = jnp.maximum(end_ref[b, qb * CWGS, 0], end_ref[b, qb * CWGS + 1, 0])
    prog = Program(b, h, h // dims.group, qb, lax.axis_index("wg"), len_ref[b], kv_end)

    # Registers a thread: 168 at launch (3 warpgroups); what the compute warpgroups add must
    # not exceed what the memory warpgroup gives back, or setmaxnreg waits forever (it did,
    # at 96 / 208). fp8: the memory warpgroup also upcasts (64 fp8 values a thread per
    # operand); two upcasting warpgroups launch at 128 (4 warpgroups): 2 x 200 + 2 x 56.
    memory_regs, compute_regs = (40, 232) if not dims.fp8 else (
        (96, 200) if dims.upcast_wgs == 1 else (56, 200))

    def walk(part: str):
        args = (prog, tiles(kv_end, dims.block_k), pt_ref, k_ref, v_ref, ks_ref, vs_ref, smem,
                barriers)
        if dims.f8:
            fp8_products_warpgroup(*args, dims=dims, plgpu=plgpu, lay=lay)
        elif dims.fp8:
            upcasting_warpgroup(*args, dims=dims, plgpu=plgpu, lay=lay, part=part)
        else:
            memory_warpgroup(*args, dims=dims, plgpu=plgpu, lay=lay)

    @pl.when(prog.wg == CWGS)
    def _():
        plgpu.set_max_registers(memory_regs, action="decrease")
        walk("kv" if dims.upcast_wgs == 1 else "k")

    if dims.upcast_wgs == 2:
        @pl.when(prog.wg == CWGS + 1)
        def _():
            plgpu.set_max_registers(memory_regs, action="decrease")
            walk("v")

    @pl.when(prog.wg < CWGS)
    def _():
        plgpu.set_max_registers(compute_regs, action="increase")
        _compute_warpgroup(prog, end_ref, pos_ref, (q_ref, qs_ref, pc_ref), vsc_ref, o_ref, smem,
                           barriers, dims=dims, plgpu=plgpu, lay=lay)


def _compute_warpgroup(prog: Program, end_ref, pos_ref, q_refs, vsc_ref, o_ref, smem,
                       barriers, *, dims, plgpu, lay):
    """Loads its 64 query rows (fp8 products: q8 and its row scales) and their positions,
    runs the program's tiles it needs (unmasked, then masked), releases the others unread,
    then writes its rows."""
    d, wg = dims.d, prog.wg
    (q_ref, qs_ref, pc_ref), qo_s, pos_s = q_refs, smem["qo"].at[wg], smem["pos"].at[wg]
    q_s = smem["q8"].at[wg] if dims.f8 else qo_s
    blk = prog.qb * CWGS + wg
    t0 = pl.multiple_of(blk * ROWS, ROWS)
    q_bar = barriers["q"].at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[prog.b, pl.ds(t0, ROWS), prog.h], q_s, q_bar)
    plgpu.copy_gmem_to_smem(pos_ref.at[prog.b, pl.ds(t0, ROWS)], pos_s, q_bar)
    if dims.f8:
        plgpu.copy_gmem_to_smem(qs_ref.at[prog.b, prog.h, pl.ds(t0, ROWS)], smem["qs"].at[wg],
                                q_bar)
    if vsc_ref is not None:
        plgpu.copy_gmem_to_smem(vsc_ref.at[prog.hkv], smem["vsc"].at[wg], q_bar)
    plgpu.barrier_wait(q_bar)
    pos = lay.load_rows(pos_s)
    # fp8 products: each row's factor c (q8's scale, times sm_scale * log2(e) unless token
    # scales carry it)
    qc = None if not dims.f8 else lay.load_rows(smem["qs"].at[wg]) * (
        1.0 if dims.token_scales else dims.qk_scale)
    # and P's scale (``fp8_products.p_scales``)
    p_c = None if not dims.f8 else pc_ref[prog.b, prog.hkv] if dims.token_scales else P_MAX

    bk = dims.block_k
    n_mine = tiles(end_ref[prog.b, blk, 0], bk)
    # the last tile is always masked: its keys may run past the sequence
    n_full = jnp.minimum(end_ref[prog.b, blk, 1] // bk, jnp.maximum(n_mine - 1, 0))
    other = prog.qb * CWGS + (1 - wg)
    n_prog = jnp.maximum(n_mine, tiles(end_ref[prog.b, other, 0], bk))
    step = functools.partial(_tile_step, prog, q_s, pos, smem, barriers, dims=dims,
                             plgpu=plgpu, lay=lay, qc=qc, p_c=p_c)
    carry = (lay.cast(jnp.zeros((ROWS, d), jnp.float32), lay.wgmma),
             lay.cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), lay.row),
             lay.cast(jnp.zeros((ROWS,), jnp.float32), lay.row))
    turn = functools.partial(take_turns, plgpu, barriers.get("sched"))
    pl.when(wg == 1)(turn)
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(n_full, n_mine, functools.partial(step, masked=True), carry)

    @pl.loop(n_mine, n_prog)
    def _skip(t):  # tiles only the other warpgroup needs: release them unread
        slot = lax.rem(t, dims.stages)
        plgpu.barrier_wait(barriers["ready"].at[slot])
        plgpu.barrier_arrive(barriers["consumed"].at[slot])
        turn()
        turn()

    pl.when(wg == 0)(turn)
    acc, _, l_i = carry
    if vsc_ref is not None:
        acc = acc * lax.broadcast_in_dim(lay.load_cols(smem["vsc"].at[wg]), acc.shape, [1])
    l_safe = jnp.where(l_i > 0, l_i, 1.0) * (1.0 if p_c is None else p_c)
    qo_s[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(qo_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_s, o_ref.at[prog.b, pl.ds(t0, ROWS), prog.h])
    plgpu.wait_smem_to_gmem(0)


def _tile_step(prog: Program, q_s, pos, smem, barriers, t, carry, *, dims, plgpu, lay,
               masked: bool, qc=None, p_c=None):
    """One tile: q.K^T, (mask), online softmax, P.V. carry = (acc [ROWS, D], m, l). fp8
    products: ``qc`` the rows' logit factors, ``p_c`` P's scale (else None)."""
    acc, m_i, l_i = carry
    slot = lax.rem(t, dims.stages)
    tok0 = t * dims.block_k
    ready, consumed = barriers["ready"], barriers["consumed"]
    plgpu.barrier_wait(ready.at[slot])
    k_op, v_op = smem["k"].at[slot], smem["vt" if dims.f8 else "v"].at[slot]
    if dims.token_scales:
        k_tok = lay.load_cols(smem["ks"].at[slot])
        v_tok = lay.load_cols(smem["vs"].at[slot])
    turn = functools.partial(take_turns, plgpu, barriers.get("sched"))  # no-op: no pingpong
    s = lay.qk(q_s, k_op, during=turn)
    if dims.token_scales:  # per key: its scale times sm_scale * log2(e)
        s = s * lax.broadcast_in_dim(k_tok * dims.qk_scale, s.shape, [1])
    c = None if dims.token_scales else dims.qk_scale  # logits in log2 units: s * c
    c_b = c  # c broadcast over the logits
    if qc is not None:
        c, c_b = qc, lax.broadcast_in_dim(qc, s.shape, [0])
    if masked:
        key = lay.iota((ROWS, dims.block_k), 1) + tok0
        visible = (key < prog.seq_len) & (key <= lax.broadcast_in_dim(pos, s.shape, [0]))
        s = jnp.where(visible, s, -jnp.inf)
    # the running max in log2 units (for c > 0, max(s) * c == max(s * c) exactly)
    m_new = jnp.maximum(m_i, s.max(axis=1) if c is None else s.max(axis=1) * c)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    m_b = lax.broadcast_in_dim(m_use, s.shape, [0])
    p = jnp.exp2(s - m_b if c is None else s * c_b - m_b)  # s * c - m: one FFMA a logit
    l_new = l_i * alpha + p.sum(axis=1)
    if dims.token_scales:  # fp8 products: P's scale p_c rides on V's token scales
        p = p * lax.broadcast_in_dim(v_tok if qc is None else v_tok * p_c, s.shape, [1])
        if masked:  # past the sequence the scales are unwritten (NaN in the tests)
            p = jnp.where(visible, p, 0.0)
    elif qc is not None:
        p = p * p_c
    if qc is not None:  # P quantized into shared memory, where the 8-bit wgmma reads it
        p_op = smem["p8"].at[prog.wg]
        p_op[...] = p.astype(p_op.dtype)
        plgpu.commit_smem()
        pv = lay.pv8_into
    else:
        p_op, pv = p.astype(dims.cdt), lay.pv_into
    if dims.early_rescale:
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        kept = (acc, m_new, l_new) + ((p_op,) if qc is None else ())  # (p_op: a ref for fp8)
        acc, m_new, l_new, *p_kept = lax.optimization_barrier(kept)
        p_op = p_kept[0] if p_kept else p_op
        turn()  # softmax done: P.V when the other warpgroup's products are issued
        acc = pv(acc, p_op, v_op)
    else:
        turn()
        acc = pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_op, v_op)
    plgpu.barrier_arrive(consumed.at[slot])  # P.V has read the slot (the wgmma is waited for)
    return acc, m_new, l_new


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale", "interpret", "tuning"))
def prefill_attention(q, layer: LayerKV, page_tables, seq_lens, q_positions, cfg: CacheConfig,
                      sm_scale: float, interpret: bool = False,
                      tuning: MosaicPrefillTuning | None = None):
    """q [B, T, H, D] -> [B, T, H, D] (q's dtype); ``pallas_prefill.prefill_attention``'s
    contract for the configurations ``check_supported`` accepts. Static: cfg, sm_scale,
    interpret, tuning. Nothing is donated."""
    plgpu = load_plgpu()
    tuning = tuning or MosaicPrefillTuning()
    b, t, nh, d = q.shape
    bk, f8 = tuning.block_k, tuning.compute == "fp8"
    check_tuning(cfg, tuning)
    check_supported(cfg, nh, bk)
    hkv, s = cfg.num_kv_heads, cfg.page_size
    kv = KVLayout.of(cfg)
    token_scales, static_v = kv.groups == 1, kv.mode.is_static
    tp = -(-t // (CWGS * ROWS)) * CWGS * ROWS  # whole programs; padded rows dropped
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, tp - t)), mode="edge")
    k_pages, v_pages, k_sc, v_sc = kv.operands(layer, hkv)
    if f8:  # q8 [B, Tp, H, D], its row scales [B, H, Tp]
        qk, q_scale = fp8_products.quantize_queries(q, kv, k_sc, hkv)
        q_scale = jnp.pad(q_scale, ((0, 0), (0, tp - t), (0, 0)), constant_values=1.0)
        q_ops = [jnp.swapaxes(q_scale, 1, 2)] + ([fp8_products.p_scales(
            v_sc, page_tables, seq_lens, s)] if token_scales else [])
    else:
        qk, q_ops = grouped_queries(q, kv, k_sc, hkv).reshape(b, t, nh, d).astype(kv.cdt), []
    qk = jnp.pad(qk, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    # page-table entries a tile reads; the table padded to whole tiles, and to at least
    # ``stages`` of them: the first tiles' copies are traced with static indices even where
    # ``pl.when`` skips them, and jax refuses a slice past an array when it traces
    st = tuning.stages
    per_tile = max(1, bk // s)
    mp = page_tables.shape[1]
    width = max(-(-mp // per_tile), st) * per_tile
    pt = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, width - mp)))
    dims = _Dims(s, st, cfg.is_fp8, token_scales, static_v, float(sm_scale) * LOG2E, d,
                 nh // hkv, kv.cdt.name, tuning.pingpong, bk, tp // (CWGS * ROWS),
                 tuning.rescales_early(cfg),
                 tuning.upcast_wgs if cfg.is_fp8 else 1, tuning.gather_scales and token_scales,
                 f8)
    smem, barriers = scratch(plgpu, cfg, kv, dims)
    kernel = plgpu.kernel(
        functools.partial(_kernel, dims=dims, plgpu=plgpu, lay=MosaicOps(plgpu, interpret)),
        out_type=jax.ShapeDtypeStruct((b, tp, nh, d), kv.cdt),
        grid=(b, nh, tp // (CWGS * ROWS)), grid_names=("b", "h", "qb"),
        num_threads=CWGS + dims.upcast_wgs, thread_name="wg",
        scratch_types=(smem, barriers),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True,
            unsafe_no_auto_barriers=not tuning.auto_barriers),
        kernel_name="jfp8kv_mosaic_prefill", **interpret_kwargs(interpret))
    seq_lens = seq_lens.astype(jnp.int32)
    operands = [seq_lens, pt, block_ends(pos, seq_lens, tp), pos, qk, k_pages, v_pages,
                *q_ops]
    if token_scales and dims.gather_scales:
        operands += [gathered_scales(sc, pt, s) for sc in (k_sc, v_sc)]
    elif token_scales:
        operands += [k_sc.astype(jnp.float32), v_sc.astype(jnp.float32)]
    if static_v:
        operands.append(v_sc.astype(jnp.float32))
    return kernel(*operands)[:, :t].astype(q.dtype)
