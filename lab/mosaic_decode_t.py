"""Paged decode attention over fp8 pages on Pallas Mosaic GPU (Hopper, sm_90a) with the
products transposed: a prototype beside ``mosaic_decode`` (which pads a KV head's G query
heads to wgmma's 64 rows) and ``pallas_decode`` (Triton); the engine uses neither Mosaic one.

Per 64-key tile and KV head, with q_s the G query heads padded to N = 8 or 16 rows:

* S^T = K q^T: wgmma with A = the f16 K tile [64 keys, D] and B = q_s viewed transposed;
  the accumulator is [64 keys, N] (M = 64 keys, no padded query rows beyond N).
* The online softmax runs down the columns (one running max per query head); token K
  scales multiply rows (keys) of S^T, V token scales rows of P^T; keys past the sequence's
  end (rows) are masked. The running sum is kept per element ([64, N], rescaled like the
  accumulator) and summed over keys in XLA: no second cross-warp reduction per tile.
* P^T goes to a [N, 64] f16 buffer through a transposed view (``WGMMA_TRANSPOSED`` layout
  first, the store ``bench/mosaic_transpose_probe.py`` proved), then O^T = V^T P^T with
  A = the f16 V tile viewed transposed ([D, 64]) and B = that buffer viewed transposed;
  the accumulator is [D, N].

This needs Mosaic GPU's *lane* lowering semantics (jax 0.10.2 lowers the transposed P^T
store only there; 0.11.2 runs it), unlike ``mosaic_decode``/``mosaic_prefill``.

Warpgroups of one (batch row, KV head, split) program: a *memory* warpgroup copies q and
the split's page-table slice into shared memory, then each tile's pages (K, V, token
scales) with TMA into ``stages`` fp8 slots (``mosaic_decode``'s page walk). The fp8 -> f16
upcast runs either in the compute warpgroups (``upcast="compute"``: each upcasts its tile
into its own f16 buffers and frees the fp8 slot) or in a dedicated *upcast* warpgroup
(``upcast="warpgroup"``) that fills a ring of ``f16_stages`` f16 slots. ``compute_wgs``
compute warpgroups (1 or 2) take alternate tiles; each writes its partial state like a
split, merged by ``pallas_decode.combine_splits``.

Lane semantics issues each TMA copy with every thread of the warpgroup arriving for 1/128 of
its bytes, so Mosaic takes only copies of a multiple of 128 bytes: a page's token scales
(4 bytes a token) qualify from 32-token pages up; for smaller pages XLA gathers each split's
scales through the page table into a contiguous [B, Hkv, tokens] array first (K's and V's:
8 bytes a token and KV head read and 8 written beside the kernel, ~6% over the 256 K/V
bytes at head_dim 128; inside the timed call), and the kernel copies 64 scales a tile. The
page-table slice is copied rounded up to 32 entries.

Registers (``registers``): 65,536 a block, split evenly at launch (256 a thread for two
warpgroups, 168 for three, 128 for four); the memory warpgroup drops to 40 and the others
take no more than it gives back (setmaxnreg waits forever otherwise).

The max down S^T's columns crosses the 4 warps of a warpgroup, and Mosaic's lane-semantics
reduction goes through one shared-memory scratch area common to all warpgroups; with two
compute warpgroups they therefore take turns at that reduction (two ``turn`` barriers, tile
t's warpgroup passes the turn to tile t+1's), which the interpreter cannot check (it does
not model the scratch).

Numerics: ``reference.decode_attention``'s contract as ``pallas_decode`` computes it (f16
operands, f32 accumulation, token scales on logits and probabilities); static scales outside
the kernel (K's folded into q, V's on the merged output). Supported: fp8 pages (e4m3, e5m2);
scale modes token, tensor, channel; head_dim 64 or 128; page sizes ``layout_problems``
allows; 1 to 16 query heads per KV head; no K rotation. ``check_supported`` raises
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
from jfp8kv.kernels.mosaic_ops import (drain_slots, grouped_queries,
                                       interpret_kwargs, layout_problems, load_plgpu,
                                       page_chunks, SplitProgram, split_page_tables,
                                       stage_page_table, swizzled, walk_tiles)
from jfp8kv.kernels.mosaic_transposed import TransposedOps
from jfp8kv.kernels.device import num_sms
from jfp8kv.kernels.pallas_decode import combine_splits
from jfp8kv.kernels.tiles import LOG2E, KVLayout
from jfp8kv.kvcache.cache import LayerKV

BLOCK_K = 64  # keys per tile: wgmma's M for S^T = K q^T, its K for O^T = V^T P^T
MAX_GROUP = 16  # query heads per KV head (wgmma's N: 8 or 16)
UPCASTS = ("compute", "warpgroup")
# ``MosaicDecodeTTuning.probe`` (timing only, wrong results): "copies": the compute
# warpgroups release each tile as it is ready (the copies, and the upcast warpgroup's
# upcast, alone); "no_upcast": the f16 tiles are not written; "no_mma": neither product runs
PROBES = ("", "copies", "no_upcast", "no_mma")
SMEM_LIMIT = 232448  # bytes of shared memory a block may take on the H200


@dataclasses.dataclass(frozen=True)
class MosaicDecodeTTuning:
    """``stages``: fp8 tiles in flight per program. ``upcast``: where fp8 pages become f16,
    "compute" (each compute warpgroup, its own tiles) or "warpgroup" (a dedicated upcast
    warpgroup filling ``f16_stages`` f16 slots). ``compute_wgs``: 1 or 2 compute
    warpgroups taking alternate tiles. The slots a compute warpgroup waits on must be its
    own: with 2 of them, ``stages`` ("compute") or ``f16_stages`` ("warpgroup") even.
    ``num_splits=0``: splits until the grid holds ``target_programs``. ``wide_upcast``:
    the upcast through ``MosaicOps.upcast`` (8 fp8 values a thread), else the layout Mosaic
    infers for a plain load. ``k_regs`` (upcast "compute" only): K is upcast into registers
    in the WGMMA layout and is S^T's A operand from there (no f16 K tile in shared memory:
    its store and the wgmma's reads of it go; the fp8 loads are 2 bytes a thread)."""

    stages: int = 4
    upcast: str = "warpgroup"
    compute_wgs: int = 1
    f16_stages: int = 2
    num_splits: int = 0
    target_programs: int = dataclasses.field(default_factory=num_sms)  # one per SM
    wide_upcast: bool = True
    k_regs: bool = False
    probe: str = ""  # bench diagnostics, wrong results: one of PROBES skipped


def check_supported(cfg: CacheConfig, num_heads: int) -> None:
    """ValueError naming what this kernel cannot run (``pallas_decode`` runs all of it)."""
    problems = [] if cfg.is_fp8 else [f"storage {cfg.storage_dtype} (fp8 pages only)"]
    problems += layout_problems(cfg, BLOCK_K)
    if num_heads % cfg.num_kv_heads or num_heads // cfg.num_kv_heads > MAX_GROUP:
        problems.append(f"{num_heads} query heads over {cfg.num_kv_heads} KV heads "
                        f"(1 to {MAX_GROUP} per KV head)")
    if problems:
        raise ValueError("the transposed Mosaic GPU decode kernel does not support "
                         + "; ".join(problems) + "; use the Triton kernel (pallas_decode)")


def padded_group(g: int) -> int:
    """wgmma's N for G query heads: 8 or 16."""
    return 8 if g <= 8 else 16


def smem_bytes(tuning: MosaicDecodeTTuning, d: int, n: int, pps: int,
               token_scales: bool) -> int:
    """Shared memory ``_scratch`` asks for (buffers only; barriers and Mosaic's reduction
    scratch, ~2.2 KB, come on top)."""
    cw, st = tuning.compute_wgs, tuning.stages
    f16_slots = tuning.f16_stages if tuning.upcast == "warpgroup" else cw
    f16_tiles = 1 if tuning.k_regs else 2
    total = st * 2 * BLOCK_K * d + f16_slots * f16_tiles * BLOCK_K * d * 2  # fp8, f16 tiles
    if token_scales:
        total += (st + (tuning.f16_stages if tuning.upcast == "warpgroup" else 0)) * 2 * BLOCK_K * 4
    total += n * d * 2 + pps * 4  # q, page-table slice
    total += cw * (n * BLOCK_K * 2 + d * n * 4 + BLOCK_K * n * 4 + n * 4)  # P^T, O^T, l, m
    return total


def check_tuning(tuning: MosaicDecodeTTuning) -> None:
    """ValueError for a tuning the kernel cannot run."""
    cw = tuning.compute_wgs
    own = tuning.stages if tuning.upcast == "compute" else tuning.f16_stages
    if tuning.upcast not in UPCASTS:
        raise ValueError(f"upcast must be one of {UPCASTS}, got {tuning.upcast!r}")
    if tuning.k_regs and tuning.upcast != "compute":
        raise ValueError("k_regs needs upcast='compute' (the compute warpgroup reads K's fp8 "
                         "slot)")
    if tuning.probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {tuning.probe!r}")
    if cw not in (1, 2) or tuning.stages < 1 or tuning.f16_stages < 1 or own % cw:
        raise ValueError(
            f"compute_wgs must be 1 or 2 and the slots its warpgroups wait on a multiple of "
            f"it; got compute_wgs={cw}, stages={tuning.stages}, "
            f"f16_stages={tuning.f16_stages}, upcast={tuning.upcast!r}")


def registers(tuning: MosaicDecodeTTuning) -> tuple[int | None, int | None, int | None]:
    """Per-thread registers (memory, upcast, compute warpgroup) to set with setmaxnreg, None
    for unchanged. A block launches at 65,536 / its threads (168 for three warpgroups, 128
    for four); what the increases take must not exceed what the decreases give back, or
    ``setmaxnreg`` waits forever (96 / 208 hung the prefill kernel)."""
    upcast_wg = tuning.upcast == "warpgroup"
    nwg = tuning.compute_wgs + 1 + upcast_wg
    if nwg == 2:  # 256 registers a thread at launch: nothing to move
        return None, None, None
    if nwg == 3:  # 168: the memory warpgroup gives 128, two warpgroups take 64 each
        return 40, (232 if upcast_wg else None), 232
    # four warpgroups, 128 at launch: 88 given back, 40 to the upcast, 16 to each compute
    # (496 of 512 in all, the margin of ``mosaic_decode``'s four warpgroups, which ran)
    return 40, 168, 144


class _Dims(NamedTuple):
    """The kernel's static parameters."""

    cwgs: int
    upcast_wg: bool
    stages: int
    f16_stages: int
    tokens_per_split: int
    page_size: int
    token_scales: bool
    qk_scale: float  # sm_scale * log2(e)
    d: int
    n: int  # padded query heads (wgmma's N)
    regs: tuple
    gathered_scales: bool  # token scales gathered per split in XLA (pages under 32 tokens)
    wide_upcast: bool
    probe: str
    k_regs: bool  # upcast="compute": K upcast into registers, S^T's A operand from there


def _kernel(len_ref, pt_ref, q_ref, k_ref, v_ref, *refs, dims, plgpu, lay):
    if dims.token_scales:
        ks_ref, vs_ref, o_ref, m_ref, l_ref, smem, barriers = refs
    else:
        o_ref, m_ref, l_ref, smem, barriers = refs
        ks_ref = vs_ref = None
    b, sp = lax.axis_index("b"), lax.axis_index("sp")
    start = sp * dims.tokens_per_split
    end = jnp.minimum(len_ref[b], start + dims.tokens_per_split)
    prog = SplitProgram(b, lax.axis_index("h"), sp, lax.axis_index("wg"), start, end,
                    jnp.maximum(end - start + BLOCK_K - 1, 0) // BLOCK_K)
    mem_regs, up_regs, comp_regs = dims.regs
    cwgs = dims.cwgs

    @pl.when(prog.wg == cwgs + dims.upcast_wg)
    def _():
        if mem_regs is not None:
            plgpu.set_max_registers(mem_regs, action="decrease")
        _memory_warpgroup(prog, pt_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, smem, barriers,
                          dims=dims, plgpu=plgpu)

    if dims.upcast_wg:
        @pl.when(prog.wg == cwgs)
        def _():
            if up_regs is not None:
                plgpu.set_max_registers(up_regs, action="increase")
            _upcast_warpgroup(prog, smem, barriers, dims=dims, plgpu=plgpu, lay=lay)

    @pl.when(prog.wg < cwgs)
    def _():
        if comp_regs is not None:
            plgpu.set_max_registers(comp_regs, action="increase")
        _compute_warpgroup(prog, o_ref, m_ref, l_ref, smem, barriers, dims=dims,
                           plgpu=plgpu, lay=lay)


def _memory_warpgroup(prog: SplitProgram, pt_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, smem,
                      barriers, *, dims, plgpu):
    """Copies q, the split's page-table slice, then each tile's pages into its fp8 slot
    once the slot's previous tile is consumed (``mosaic_decode``'s page walk)."""
    page_size, stages = dims.page_size, dims.stages
    ready, consumed = barriers["ready8"], barriers["consumed8"]
    b, h, sp, start, end = prog.b, prog.h, prog.sp, prog.start, prog.end
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS  # every copy reads a real page
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], smem["q"], barriers["q"])
    # the split's page-table entries, rounded up to 32 (a lane-semantics copy moves a
    # multiple of 128 bytes), read from shared memory per copy
    pt_s = smem["pt"]
    pps = dims.tokens_per_split // page_size
    stage_page_table(plgpu, pt_ref, b, sp * pps, pt_s, barriers["pt"])

    def copy_tile(t, slot):
        for rows, dst in page_chunks(pt_s, sp, pps, start, t, end, page_size, BLOCK_K):
            plgpu.copy_gmem_to_smem(k_ref.at[h, rows], smem["k8"].at[slot, dst],
                                    ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[h, rows], smem["v8"].at[slot, dst],
                                    ready.at[slot])
            if dims.token_scales and not dims.gathered_scales:  # pages of >= 32 tokens
                for r, src in enumerate((ks_ref, vs_ref)):
                    plgpu.copy_gmem_to_smem(src.at[h, rows], smem["sc8"].at[slot, r, dst],
                                            ready.at[slot], oob_mode=in_bounds)
        if dims.gathered_scales:  # the tile's 64 scales, contiguous per split
            keys = pl.ds(pl.multiple_of(start + t * BLOCK_K, BLOCK_K), BLOCK_K)
            for r, src in enumerate((ks_ref, vs_ref)):
                plgpu.copy_gmem_to_smem(src.at[b, h, keys], smem["sc8"].at[slot, r],
                                        ready.at[slot], oob_mode=in_bounds)

    walk_tiles(plgpu, prog.n_tiles, stages, consumed, copy_tile)


def _upcast_tile(prog: SplitProgram, t, k8, v8, k16, v16, *, dims, lay, masked: bool):
    """fp8 tile t -> f16 (V's rows past the split's end zeroed when ``masked``: P^T is 0
    there, but 0 x NaN is NaN)."""
    if not dims.wide_upcast:  # the layout Mosaic infers for a plain load
        if not dims.k_regs:
            k16[...] = k8[...].astype(jnp.float16)
        v = v8[...].astype(jnp.float16)
        if masked:
            rows = lay.iota((BLOCK_K, dims.d), 0) + prog.start + t * BLOCK_K
            v = jnp.where(rows < prog.end, v, jnp.zeros_like(v))
        v16[...] = v
        return
    if not dims.k_regs:
        k16[...] = lay.upcast(k8, jnp.float16)
    v16[...] = lay.upcast(v8, jnp.float16,
                          prog.end - prog.start - t * BLOCK_K if masked else None)


def _upcast_both(prog: SplitProgram, t, k8, v8, k16, v16, *, dims, lay):
    """``_upcast_tile``, masked only in the split's last tile (the only partial one)."""
    if dims.probe == "no_upcast":
        return
    last = prog.n_tiles - 1
    up = functools.partial(_upcast_tile, prog, t, k8, v8, k16, v16, dims=dims, lay=lay)
    pl.when(t < last)(lambda: up(masked=False))
    pl.when(t == last)(lambda: up(masked=True))


def _upcast_warpgroup(prog: SplitProgram, smem, barriers, *, dims, plgpu, lay):
    """Upcasts each landed fp8 tile into the f16 ring (token scales copied beside it), then
    frees the fp8 slot; an f16 slot is refilled once its previous tile's P.V is done."""
    st, st16 = dims.stages, dims.f16_stages

    @pl.loop(0, prog.n_tiles)
    def _tile(t):
        s8, s16 = lax.rem(t, st), lax.rem(t, st16)
        plgpu.barrier_wait(barriers["ready8"].at[s8])

        @pl.when(t >= st16)
        def _():
            plgpu.barrier_wait(barriers["consumed16"].at[s16])

        _upcast_both(prog, t, smem["k8"].at[s8], smem["v8"].at[s8], smem["k16"].at[s16],
                     smem["v16"].at[s16], dims=dims, lay=lay)
        if dims.token_scales:  # K's and V's: 128 values, one a thread
            smem["sc16"].at[s16][...] = smem["sc8"].at[s8][...]
        plgpu.commit_smem()  # the f16 tile visible to the wgmma (async proxy)
        plgpu.barrier_arrive(barriers["ready16"].at[s16])
        plgpu.barrier_arrive(barriers["consumed8"].at[s8])  # every thread has read it

    drain_slots(plgpu, prog.n_tiles, st16, barriers["consumed16"])


def _compute_warpgroup(prog: SplitProgram, o_ref, m_ref, l_ref, smem, barriers, *, dims, plgpu,
                       lay):
    """Runs every ``cwgs``-th tile, then writes its partial state (O^T, m, per-element l)."""
    cwgs, d, n, wg = dims.cwgs, dims.d, dims.n, prog.wg
    plgpu.barrier_wait(barriers["q"])
    step = functools.partial(_tile_step, prog, smem, barriers, dims=dims, plgpu=plgpu,
                             lay=lay)
    n_mine = jnp.maximum(prog.n_tiles - wg + cwgs - 1, 0) // cwgs
    init = (lay.cast(jnp.zeros((d, n), jnp.float32), lay.wgmma),
            lay.cast(jnp.full((n,), -jnp.inf, jnp.float32), lay.col),
            lay.cast(jnp.zeros((BLOCK_K, n), jnp.float32), lay.wgmma))
    acc, m_i, l_i = lax.fori_loop(0, n_mine, step, init)
    smem["o"].at[wg][...] = acc
    smem["m"].at[wg][...] = m_i
    smem["l"].at[wg][...] = l_i
    plgpu.commit_smem()
    split = prog.sp * cwgs + wg
    plgpu.copy_smem_to_gmem(smem["o"].at[wg], o_ref.at[prog.b, prog.h, split])
    plgpu.copy_smem_to_gmem(smem["m"].at[wg], m_ref.at[prog.b, prog.h, split])
    plgpu.copy_smem_to_gmem(smem["l"].at[wg], l_ref.at[prog.b, prog.h, split])
    plgpu.wait_smem_to_gmem(0)


def _tile_step(prog: SplitProgram, smem, barriers, i, carry, *, dims, plgpu, lay):
    """One tile: (upcast,) S^T = K q^T, online softmax down the columns, P^T to shared
    memory, O^T += V^T P^T. carry = (acc [D, N], m [N], l [BK, N])."""
    acc, m_i, l_i = carry
    cwgs, wg = dims.cwgs, prog.wg
    t = wg + cwgs * i
    tok0 = prog.start + t * BLOCK_K
    if dims.upcast_wg:
        slot = lax.rem(t, dims.f16_stages)
        plgpu.barrier_wait(barriers["ready16"].at[slot])
        if dims.probe == "copies":
            plgpu.barrier_arrive(barriers["consumed16"].at[slot])
            return carry
        k16, v16 = smem["k16"].at[slot], smem["v16"].at[slot]
        sc = smem.get("sc16")
    else:
        slot = lax.rem(t, dims.stages)
        plgpu.barrier_wait(barriers["ready8"].at[slot])
        if dims.probe == "copies":
            plgpu.barrier_arrive(barriers["consumed8"].at[slot])
            return carry
        k16 = None if dims.k_regs else smem["k16"].at[wg]
        v16 = smem["v16"].at[wg]
        _upcast_both(prog, t, smem["k8"].at[slot], smem["v8"].at[slot], k16, v16,
                     dims=dims, lay=lay)
        if dims.k_regs:  # S^T's A operand: K upcast into registers, not shared memory
            k_a = lay.load_a(smem["k8"].at[slot], jnp.float16)
        sc = smem.get("sc8")
    if dims.token_scales:
        k_tok = lay.load_rows(sc.at[slot, 0])
        v_tok = lay.load_rows(sc.at[slot, 1])
    if not dims.upcast_wg:
        plgpu.commit_smem()  # the f16 tiles visible to the wgmma
        plgpu.barrier_arrive(barriers["consumed8"].at[slot])  # fp8 slot read

    if dims.probe == "no_mma":
        s = lay.cast(jnp.zeros((BLOCK_K, dims.n), jnp.float32), lay.wgmma)
    elif dims.k_regs and not dims.upcast_wg:
        s = lay.qk_t_regs(k_a, smem["q"])  # [BK, N]
    else:
        s = lay.qk_t(k16, smem["q"])  # [BK, N]
    shape = s.shape
    visible = lay.iota(shape, 0) + tok0 < prog.end
    if dims.token_scales:
        s = s * lax.broadcast_in_dim(k_tok, shape, [0])
    s = jnp.where(visible, s * dims.qk_scale, -jnp.inf)
    turns = barriers.get("turn")
    if turns is not None:  # the cross-warp max's scratch is shared: take turns at it
        pl.when(t >= 1)(lambda: plgpu.barrier_wait(turns.at[wg]))
    m_tile = s.max(axis=0)
    if turns is not None:
        pl.when(t + 1 < prog.n_tiles)(lambda: plgpu.barrier_arrive(turns.at[1 - wg]))
    m_new = jnp.maximum(m_i, m_tile)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, shape, [1]))
    l_new = l_i * lax.broadcast_in_dim(alpha, shape, [1]) + p
    if dims.token_scales:  # past the end the scales are unwritten (NaN in the tests)
        p = jnp.where(visible, p * lax.broadcast_in_dim(v_tok, shape, [0]), 0.0)
    p_s = smem["p"].at[wg]
    lay.store_pt(p_s, p.astype(jnp.float16))
    plgpu.commit_smem()  # P^T visible to the wgmma
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
    if dims.probe != "no_mma":
        acc = lay.pv_t_into(acc, v16, p_s)
    if dims.upcast_wg:
        plgpu.barrier_arrive(barriers["consumed16"].at[slot])  # P.V has read the slot
    return acc, m_new, l_new


def _scratch(plgpu, dims: _Dims, pps: int, fp8, copies_per_tile: int):
    """Shared memory and barriers (see the module docstring)."""
    d, n, st, cw = dims.d, dims.n, dims.stages, dims.cwgs
    f16_slots = dims.f16_stages if dims.upcast_wg else cw
    smem = {
        "q": swizzled(plgpu, (n, d), jnp.float16),
        "pt": plgpu.SMEM((-(-pps // 32) * 32,), jnp.int32),
        "k8": swizzled(plgpu, (st, BLOCK_K, d), fp8),
        "v8": swizzled(plgpu, (st, BLOCK_K, d), fp8),
        "v16": swizzled(plgpu, (f16_slots, BLOCK_K, d), jnp.float16),
        "p": swizzled(plgpu, (cw, n, BLOCK_K), jnp.float16),
        "o": plgpu.SMEM((cw, d, n), jnp.float32),
        "m": plgpu.SMEM((cw, n), jnp.float32),
        "l": plgpu.SMEM((cw, BLOCK_K, n), jnp.float32),
    }
    if not dims.k_regs:
        smem["k16"] = swizzled(plgpu, (f16_slots, BLOCK_K, d), jnp.float16)
    if dims.token_scales:
        smem["sc8"] = plgpu.SMEM((st, 2, BLOCK_K), jnp.float32)  # K's, V's
        if dims.upcast_wg:
            smem["sc16"] = plgpu.SMEM((dims.f16_stages, 2, BLOCK_K), jnp.float32)
    barriers = {
        "ready8": plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=st),
        "consumed8": plgpu.Barrier(num_barriers=st),
        "q": plgpu.Barrier(),
        "pt": plgpu.Barrier(),
    }
    if dims.upcast_wg:
        barriers.update(ready16=plgpu.Barrier(num_barriers=dims.f16_stages),
                        consumed16=plgpu.Barrier(num_barriers=dims.f16_stages))
    if cw == 2:
        barriers["turn"] = plgpu.Barrier(num_barriers=2)
    return smem, barriers


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale", "interpret", "tuning"))
def decode_attention(q, layer: LayerKV, page_tables, seq_lens, cfg: CacheConfig,
                     sm_scale: float, interpret: bool = False,
                     tuning: MosaicDecodeTTuning | None = None):
    """q [B, H, D] -> [B, H, D] (q's dtype); ``pallas_decode.decode_attention``'s contract
    for the configurations ``check_supported`` accepts. Static: cfg, sm_scale, interpret,
    tuning. Nothing is donated."""
    plgpu = load_plgpu()
    tuning = tuning or MosaicDecodeTTuning()
    b, nh, d = q.shape
    check_supported(cfg, nh)
    check_tuning(tuning)
    hkv, s = cfg.num_kv_heads, cfg.page_size
    g = nh // hkv
    n = padded_group(g)
    kv = KVLayout.of(cfg)
    # each split's page-table slice is copied rounded up to 32 entries (128 bytes)
    split, pt = split_page_tables(page_tables, s, hkv, tuning, BLOCK_K,
                                  step_tiles=tuning.compute_wgs, table_round=32)
    ns, tokens_per_split, pps = split.num_splits, split.tokens_per_split, split.pages_per_split
    token_scales = kv.groups == 1
    gathered = token_scales and s * 4 % 128 != 0
    need = smem_bytes(tuning, d, n, pps, token_scales)
    if need > SMEM_LIMIT - 4096:
        raise ValueError(f"{tuning} needs {need} bytes of shared memory at head_dim {d} "
                         f"(at most {SMEM_LIMIT - 4096}): fewer stages")
    k_pages, v_pages, k_sc, v_sc = kv.operands(layer, hkv)
    cwgs, upcast_wg = tuning.compute_wgs, tuning.upcast == "warpgroup"
    dims = _Dims(cwgs, upcast_wg, tuning.stages, tuning.f16_stages, tokens_per_split, s,
                 token_scales, float(sm_scale) * LOG2E, d, n, registers(tuning), gathered,
                 tuning.wide_upcast, tuning.probe, tuning.k_regs)
    copies = (2 + 2 * (token_scales and not gathered)) * max(1, BLOCK_K // s) + 2 * gathered
    smem, barriers = _scratch(plgpu, dims, pps, k_pages.dtype, copies)
    nsp = ns * cwgs
    out_type = (jax.ShapeDtypeStruct((b, hkv, nsp, d, n), jnp.float32),
                jax.ShapeDtypeStruct((b, hkv, nsp, n), jnp.float32),
                jax.ShapeDtypeStruct((b, hkv, nsp, BLOCK_K, n), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_kernel, dims=dims, plgpu=plgpu,
                          lay=TransposedOps(plgpu, interpret)),
        out_type=out_type,
        grid=(b, hkv, ns), grid_names=("b", "h", "sp"),
        num_threads=cwgs + 1 + upcast_wg, thread_name="wg",
        scratch_types=(smem, barriers),
        # lane semantics (the transposed P^T store lowers only there on jax 0.10.2); no
        # automatic barrier at every copy and store: the mbarriers, commit_smem before each
        # wgmma and the wgmma waits order the accesses
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        kernel_name="jfp8kv_mosaic_decode_t", **interpret_kwargs(interpret))
    qg = grouped_queries(q, kv, k_sc, hkv).astype(jnp.float16)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, n - g), (0, 0)))  # padded heads: zero rows
    operands = [seq_lens.astype(jnp.int32), pt, qg, k_pages, v_pages]
    if gathered:  # [B, Hkv, ns * tokens_per_split]: each split's scales, page by page
        idx = pt[:, : ns * pps, None] * s + jnp.arange(s)  # [B, ns * pps, S] rows
        operands += [sc.astype(jnp.float32)[:, idx.reshape(b, -1)].transpose(1, 0, 2)
                     for sc in (k_sc, v_sc)]
    elif token_scales:
        operands += [k_sc.astype(jnp.float32), v_sc.astype(jnp.float32)]
    o, m, l = kernel(*operands)
    out = combine_splits(jnp.swapaxes(o, -1, -2)[:, :, :, :g], m[..., :g],
                         l.sum(axis=-2)[..., :g])
    if kv.mode.is_static:
        out = out * v_sc[None, :, None, :].astype(jnp.float32)
    return out.reshape(b, nh, d).astype(q.dtype)
