"""Paged decode attention over fp8 pages on Pallas Mosaic GPU (Hopper, sm_90a): a prototype
beside ``pallas_decode`` that the engine does not use (it takes 1.6-2.3x the Triton kernel's
time on the H200; docs/lab/kernels-notes.md has the measurements and what limits it).

FlashAttention-3's structure: one *memory* warpgroup walks the split's page table (staged in
shared memory) and copies each 64-key tile's pages (K, V and, in token mode, their scales)
with TMA into ``stages`` fp8 slots; ``compute_wgs`` *compute* warpgroups take tiles in turn,
upcast K and V to f16 into their own swizzled buffers (V rows past the end zeroed), free the
slot, and run q.K^T and P.V as ``wgmma`` around the online softmax. Each writes its partial
state (unnormalized acc, max, sum) like a split; ``pallas_decode.combine_splits`` merges them.
The q block is the KV head's G query heads padded to 64 rows (wgmma's M); padded rows hold
whatever shared memory held and are never stored.

Numerics: ``reference.decode_attention``'s contract as ``pallas_decode`` computes it (f16
operands, f32 accumulation, token scales on logits and probabilities); static scales outside
the kernel (K's folded into q as ``tiles.prepare_q`` does, V's on the merged output).
Supported: fp8 pages; scale modes token, tensor, channel; head_dim 64 or 128; page sizes >= 8
that divide the 64-key tile or are multiples of it; no K rotation. ``check_supported`` raises
ValueError for the rest.
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
from jfp8kv.kernels.mosaic_ops import (ROWS, MosaicOps,  # ROWS: wgmma's M, the q block
                                       grouped_queries, interpret_kwargs, layout_problems,
                                       load_plgpu, page_chunks, SplitProgram,
                                       split_page_tables, stage_page_table, swizzled,
                                       walk_tiles)
from jfp8kv.kernels.device import num_sms
from jfp8kv.kernels.pallas_decode import combine_splits
from jfp8kv.kernels.tiles import LOG2E, KVLayout
from jfp8kv.kvcache.cache import LayerKV

BLOCK_K = 64  # keys per tile: wgmma's N for q.K^T and its K for P.V


@dataclasses.dataclass(frozen=True)
class MosaicDecodeTuning:
    """``stages``: fp8 tiles in flight per program (a multiple of ``compute_wgs``: each
    compute warpgroup owns the slots of its tiles). ``num_splits=0``: splits until the grid
    holds ``target_programs``. ``compute_wgs``: 2 or 3 compute warpgroups."""

    stages: int = 4
    num_splits: int = 0
    target_programs: int = dataclasses.field(default_factory=num_sms)  # one per SM
    compute_wgs: int = 2
    probe: str = ""  # bench diagnostics, wrong results: "compute" | "convert" | "mma" skipped
    overlap_v: bool = False  # V's upcast while q.K^T runs (not yet measured)


def check_supported(cfg: CacheConfig, num_heads: int) -> None:
    """ValueError naming what this kernel cannot run (``pallas_decode`` runs all of it)."""
    problems = [] if cfg.is_fp8 else [f"storage {cfg.storage_dtype} (fp8 pages only)"]
    problems += layout_problems(cfg, BLOCK_K)
    if num_heads % cfg.num_kv_heads or num_heads // cfg.num_kv_heads > ROWS:
        problems.append(f"{num_heads} query heads over {cfg.num_kv_heads} KV heads "
                        f"(at most {ROWS} per KV head)")
    if problems:
        raise ValueError("the Mosaic GPU decode kernel does not support " + "; ".join(problems)
                         + "; use the Triton kernel (pallas_decode)")


def _scratch(plgpu, d, pps, st, cwgs, fp8, copies_per_tile, interpret):
    """Shared memory: q, the split's page-table slice, ``st`` fp8 slots of K, V and token
    scales, per compute warpgroup the f16 K/V tiles (sharing memory with the output
    staging, except in the interpreter, which has no RefUnion) and (m, l); barriers: slot
    ready (one arrival per copy), slot consumed, q, page table, loops done."""
    union = (lambda groups: groups) if interpret else (lambda groups: plgpu.RefUnion(*groups))
    return (
        (swizzled(plgpu, (ROWS, d), jnp.float16), plgpu.SMEM((pps,), jnp.int32),
         swizzled(plgpu, (st, BLOCK_K, d), fp8), swizzled(plgpu, (st, BLOCK_K, d), fp8),
         plgpu.SMEM((st, BLOCK_K), jnp.float32), plgpu.SMEM((st, BLOCK_K), jnp.float32),
         union(((swizzled(plgpu, (cwgs, BLOCK_K, d), jnp.float16),
                 swizzled(plgpu, (cwgs, BLOCK_K, d), jnp.float16)),
                plgpu.SMEM((cwgs, ROWS, d), jnp.float32))),
         plgpu.SMEM((cwgs, 2, ROWS), jnp.float32)),
        (plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=st),
         plgpu.Barrier(num_barriers=st),
         plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier(num_arrivals=cwgs)),
    )


class _Dims(NamedTuple):
    """The kernel's static parameters."""

    cwgs: int  # compute warpgroups
    tokens_per_split: int
    page_size: int
    stages: int
    token_scales: bool
    qk_scale: float  # sm_scale * log2(e)
    d: int
    probe: str
    overlap_v: bool


def _kernel(len_ref, pt_ref, q_ref, k_ref, v_ref, *refs, dims, plgpu, lay):
    cwgs, tokens_per_split = dims.cwgs, dims.tokens_per_split
    if dims.token_scales:
        ks_ref, vs_ref, o_ref, ml_ref, smem, barriers = refs
    else:
        o_ref, ml_ref, smem, barriers = refs
        ks_ref = vs_ref = None
    b, sp = lax.axis_index("b"), lax.axis_index("sp")
    start = sp * tokens_per_split
    end = jnp.minimum(len_ref[b], start + tokens_per_split)
    prog = SplitProgram(b, lax.axis_index("h"), sp, lax.axis_index("wg"), start, end,
                    jnp.maximum(end - start + BLOCK_K - 1, 0) // BLOCK_K)
    pl.when(prog.wg == cwgs)(functools.partial(
        _memory_warpgroup, prog, pt_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, smem, barriers,
        dims=dims, plgpu=plgpu))
    pl.when(prog.wg < cwgs)(functools.partial(
        _compute_warpgroup, prog, o_ref, ml_ref, smem, barriers, dims=dims, plgpu=plgpu,
        lay=lay))


def _memory_warpgroup(prog: SplitProgram, pt_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, smem,
                      barriers, *, dims, plgpu):
    """Copies q, the split's page-table slice, then each tile's pages into its fp8 slot."""
    page_size, stages, token_scales = dims.page_size, dims.stages, dims.token_scales
    q_s, pt_s, k8_s, v8_s, ks_s, vs_s = smem[:6]
    ready, consumed, q_bar, pt_bar, _ = barriers
    b, h, sp, start, end = prog.b, prog.h, prog.sp, prog.start, prog.end
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS  # every copy reads a real page
    plgpu.set_max_registers(40, action="decrease")
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_s.at[pl.ds(0, q_ref.shape[2])], q_bar)
    pps = pt_s.shape[0]  # the split's page-table entries
    stage_page_table(plgpu, pt_ref, b, sp * pps, pt_s, pt_bar)

    def copy_tile(t, slot):
        for rows, dst in page_chunks(pt_s, sp, pps, start, t, end, page_size, BLOCK_K):
            plgpu.copy_gmem_to_smem(k_ref.at[h, rows], k8_s.at[slot, dst], ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[h, rows], v8_s.at[slot, dst], ready.at[slot])
            if token_scales:  # 4 bytes a token: plain bulk copies (16-byte aligned)
                for src, dst_s in ((ks_ref, ks_s), (vs_ref, vs_s)):
                    plgpu.copy_gmem_to_smem(src.at[h, rows], dst_s.at[slot, dst],
                                            ready.at[slot], oob_mode=in_bounds)

    walk_tiles(plgpu, prog.n_tiles, stages, consumed, copy_tile)


def _compute_warpgroup(prog: SplitProgram, o_ref, ml_ref, smem, barriers, *, dims, plgpu, lay):
    """Runs every ``cwgs``-th tile from its fp8 slot, then writes its partial state."""
    cwgs, d = dims.cwgs, dims.d
    _, _, _, _, _, _, ((k16_s, v16_s), o_s), ml_s = smem
    _, _, q_bar, _, loops_done = barriers
    wg = prog.wg
    # the register file (64K) split: 40 per memory thread, the rest to compute threads
    plgpu.set_max_registers(232 if cwgs == 2 else 152, action="increase")
    plgpu.barrier_wait(q_bar)
    step = functools.partial(_tile_step, prog, smem, barriers, k16_s.at[wg], v16_s.at[wg],
                             dims=dims, plgpu=plgpu, lay=lay)
    n_mine = jnp.maximum(prog.n_tiles - wg + cwgs - 1, 0) // cwgs
    init = (lay.cast(jnp.zeros((ROWS, d), jnp.float32), lay.wgmma),
            lay.cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), lay.row),
            lay.cast(jnp.zeros((ROWS,), jnp.float32), lay.row))
    acc, m_i, l_i = lax.fori_loop(0, n_mine, step, init)
    # o_s shares memory with both warpgroups' f16 tiles: wait until neither reads them
    plgpu.barrier_arrive(loops_done)
    plgpu.barrier_wait(loops_done)
    o_s[wg] = acc
    ml_s[wg, 0] = m_i
    ml_s[wg, 1] = l_i
    plgpu.commit_smem()
    gq = o_ref.shape[3]
    split = prog.sp * cwgs + wg
    plgpu.copy_smem_to_gmem(o_s.at[wg, pl.ds(0, gq)], o_ref.at[prog.b, prog.h, split])
    for r in range(2):
        plgpu.copy_smem_to_gmem(ml_s.at[wg, r, pl.ds(0, gq)],
                                ml_ref.at[prog.b, prog.h, split, r])
    plgpu.wait_smem_to_gmem(0)


def _tile_step(prog: SplitProgram, smem, barriers, k16, v16, i, carry, *, dims, plgpu, lay):
    """One tile of a compute warpgroup: upcast into ``k16``/``v16``, free the fp8 slot,
    q.K^T, online softmax, P.V. carry = (acc [ROWS, D], m [ROWS], l [ROWS])."""
    cwgs, _, _, stages, token_scales, qk_scale, d, probe, overlap_v = dims  # every field
    q_s, _, k8_s, v8_s, ks_s, vs_s = smem[:6]
    ready, consumed = barriers[:2]
    acc, m_i, l_i = carry
    t = prog.wg + cwgs * i
    slot = lax.rem(t, stages)
    tok0 = prog.start + t * BLOCK_K
    plgpu.barrier_wait(ready.at[slot])
    if probe == "compute":
        plgpu.barrier_arrive(consumed.at[slot])
        return acc, m_i, l_i
    def upcast_v():
        v16[...] = lay.upcast(v8_s.at[slot], jnp.float16, prog.end - tok0)

    def upcast_v_visible():  # during q.K^T: V's upcast, made visible to P.V's wgmma
        upcast_v()
        plgpu.commit_smem()

    overlap = overlap_v and not probe
    if probe != "convert":
        k16[...] = lay.upcast(k8_s.at[slot], jnp.float16)
        if not overlap:
            upcast_v()
    if token_scales:
        k_tok = lay.load_cols(ks_s.at[slot])
        v_tok = lay.load_cols(vs_s.at[slot])
    plgpu.commit_smem()
    if not overlap:
        plgpu.barrier_arrive(consumed.at[slot])

    if probe == "mma":
        s = lay.cast(jnp.zeros((ROWS, BLOCK_K), jnp.float32), lay.wgmma)
    else:
        s = lay.qk(q_s, k16, upcast_v_visible if overlap else None)
    if overlap:
        plgpu.barrier_arrive(consumed.at[slot])
    cols = lay.iota((ROWS, BLOCK_K), 1)
    visible = cols + tok0 < prog.end
    if token_scales:
        s = s * lax.broadcast_in_dim(k_tok, s.shape, [1])
    s = jnp.where(visible, s * qk_scale, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
    l_new = l_i * alpha + p.sum(axis=1)
    if token_scales:
        p = jnp.where(visible, p * lax.broadcast_in_dim(v_tok, s.shape, [1]), 0.0)
    pv = acc if probe == "mma" else lay.pv(p.astype(jnp.float16), v16)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
    return acc, m_new, l_new


def _prepare_q(q, kv: KVLayout, k_sc, hkv: int, gq: int):
    """q [B, H, D] -> f16 [B, Hkv, gq, D]: ``mosaic_ops.grouped_queries``, the G query heads
    of a KV head padded to ``gq`` rows."""
    qg = grouped_queries(q, kv, k_sc, hkv).astype(jnp.float16)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, gq - qg.shape[2]), (0, 0)))


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale", "interpret", "tuning"))
def decode_attention(q, layer: LayerKV, page_tables, seq_lens, cfg: CacheConfig,
                     sm_scale: float, interpret: bool = False,
                     tuning: MosaicDecodeTuning | None = None):
    """q [B, H, D] -> [B, H, D] (q's dtype); ``pallas_decode.decode_attention``'s contract
    for the configurations ``check_supported`` accepts. Static: cfg, sm_scale, interpret,
    tuning. Nothing is donated."""
    plgpu = load_plgpu()
    tuning = tuning or MosaicDecodeTuning()
    b, nh, d = q.shape
    check_supported(cfg, nh)
    cwgs = tuning.compute_wgs
    if cwgs not in (2, 3) or tuning.stages % cwgs:
        raise ValueError(f"compute_wgs must be 2 or 3 and stages a multiple of it, got "
                         f"{cwgs} and {tuning.stages}")
    hkv, s = cfg.num_kv_heads, cfg.page_size
    g = nh // hkv
    gq = -(-g // 8) * 8  # rows copied in and out: whole 8-row tiles
    kv = KVLayout.of(cfg)
    split, pt = split_page_tables(page_tables, s, hkv, tuning, BLOCK_K,
                                  step_tiles=tuning.compute_wgs)
    ns, tokens_per_split, pps = split.num_splits, split.tokens_per_split, split.pages_per_split
    token_scales = kv.groups == 1
    k_pages, v_pages, k_sc, v_sc = kv.operands(layer, hkv)
    st = tuning.stages
    scratch = _scratch(plgpu, d, pps, st, cwgs, k_pages.dtype,
                       (4 if token_scales else 2) * max(1, BLOCK_K // s), interpret)
    nsp = ns * cwgs
    out_type = (jax.ShapeDtypeStruct((b, hkv, nsp, gq, d), jnp.float32),
                jax.ShapeDtypeStruct((b, hkv, nsp, 2, gq), jnp.float32))
    dims = _Dims(cwgs, tokens_per_split, s, st, token_scales, float(sm_scale) * LOG2E, d,
                 tuning.probe, tuning.overlap_v)
    kernel = plgpu.kernel(
        functools.partial(_kernel, dims=dims, plgpu=plgpu, lay=MosaicOps(plgpu, interpret)),
        out_type=out_type,
        grid=(b, hkv, ns), grid_names=("b", "h", "sp"),
        num_threads=cwgs + 1, thread_name="wg",
        scratch_types=scratch,
        # no automatic barrier at every copy and store (16 a tile in the memory warpgroup):
        # the mbarriers, commit_smem before a wgmma and wgmma waits order the accesses
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True,
            unsafe_no_auto_barriers=True),
        kernel_name="jfp8kv_mosaic_decode", **interpret_kwargs(interpret))
    operands = [seq_lens.astype(jnp.int32), pt,
                _prepare_q(q, kv, k_sc, hkv, gq), k_pages, v_pages]
    if token_scales:
        operands += [k_sc.astype(jnp.float32), v_sc.astype(jnp.float32)]
    o, ml = kernel(*operands)
    out = combine_splits(o[:, :, :, :g], ml[:, :, :, 0, :g], ml[:, :, :, 1, :g])
    if kv.mode.is_static:
        out = out * v_sc[None, :, None, :].astype(jnp.float32)
    return out.reshape(b, nh, d).astype(q.dtype)
