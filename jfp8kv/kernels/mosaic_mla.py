"""MLA latent decode attention on Pallas Mosaic GPU (Hopper, sm_90a) with the products
transposed (``mosaic_transposed``); the engine's decode kernel for latent caches on Hopper
where ``check_supported`` accepts the cache (``pallas_mla``, Triton, runs the rest).

Contract: ``mla_reference.latent_attention``'s for decode (T == 1, absorbed queries):
q [B, 1, H, R] with R = r + d_r (kv_lora_rank + qk_rope_head_dim, 512 + 64 for
DeepSeek-V2/V3), pages [1, P, S, R] with rows ``[c | k_rope]``, value = the first r columns,
out [B, 1, H, r] in q's dtype. Query b sees key j iff j < seq_lens[b] and
j <= q_positions[b, 0] (the lengths are clipped in XLA).

One program per (batch row, head block of N = 8 or 16 query heads, split); per 64-key tile:
S^T = C_lat q_lat^T + C_rope q_rope^T (two wgmmas into one [64, N] accumulator; the latent
and RoPE parts are separate tiles and TMA copies, 576 fp8 bytes a row not being a multiple
of 128), the online softmax down the columns (token scales on the rows of the logits and
probabilities, keys past the end masked, the running sum kept per element and summed in
XLA), then O^T += C_lat^T P^T with the *same* latent tile viewed transposed, so one tile
(upcast once for fp8) feeds both products. Why: this is the form whose fp8 upcast the kernel
controls (the Triton kernel reads the latent tile back byte by byte as P.V's operand).

Storage: bf16/f16 pages are the wgmma operands as TMA lands them (latent rows past the end
zeroed in place in the split's last tile: 0 x NaN is NaN); fp8 pages (e4m3, e5m2) are upcast
to f16 exactly by the compute warpgroup; fp8 ``block`` scales vary along both contractions,
so the upcast multiplies each 64-column chunk by its groups' scales in f16 (one rounding of
the exact product, as ``tiles.dequant_kv``). Block scales, and token scales of pages under 32
tokens, are gathered per split in XLA first (a lane-semantics copy moves a multiple of 128
bytes).

Warpgroups: a *memory* warpgroup copies q, the split's page-table slice and each tile's rows
into ``stages`` slots with TMA; one *compute* warpgroup runs the tiles and writes its split's
partial state, merged by ``pallas_decode.combine_splits``. Shared memory bounds the stages
(``smem_bytes``; the arithmetic per setting is in docs/lab/mla-moe.md); more than the H200's
block limit is a ValueError naming fewer stages or head block 8.
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
from jfp8kv.kernels import device
from jfp8kv.kernels.mosaic_ops import (SplitProgram, interpret_kwargs, load_plgpu,
                                       page_chunks, split_page_tables, stage_page_table,
                                       swizzled, walk_tiles)
from jfp8kv.kernels.mosaic_transposed import LatentOps
from jfp8kv.kernels.pallas_decode import combine_splits
from jfp8kv.kernels.tiles import LOG2E

BLOCK_K = 64  # keys per tile: wgmma's M for S^T, its K for O^T
HEAD_BLOCKS = (8, 16)  # wgmma's N: query heads per program
RANKS = (128, 256, 512)  # kv_lora_rank: whole 128-column chunks, O^T's [r, N] in registers
ROPE = 64  # qk_rope_head_dim
SMEM_LIMIT = 232448  # bytes of shared memory a block may take on the H200
# barriers, Mosaic's reduction scratch (~2.2 KB) and its 1 KB alignment of each buffer:
# lowered, the bench's settings take 4.1-4.4 KB over ``smem_bytes``
SMEM_RESERVE = 6144
BLOCK_SCALE_WIDTHS = (32, 64)  # fp8 block scales: whole 32-column tiles of the wide layout


@dataclasses.dataclass(frozen=True)
class MosaicMLATuning:
    """``stages``: tiles in flight per program (see the module docstring for what fits).
    ``head_block``: query heads per program (8 or 16; 0: 16, or 8 when H <= 8).
    ``num_splits`` 0: splits until the grid holds ``target_programs``."""

    stages: int = 2
    head_block: int = 0
    num_splits: int = 0
    # 128 on the H200's 132 SMs, the setting measured (bench.mla_kernels "st2 tp128"; at
    # B = 64 it gives 2 splits a row where 132 gives 4); the same per SM elsewhere
    target_programs: int = dataclasses.field(default_factory=lambda: device.scaled(128))

    def block(self, num_heads: int) -> int:
        return self.head_block or (8 if num_heads <= 8 else 16)


def check_supported(cfg: CacheConfig, num_heads: int, value_dim: int = 512) -> None:
    """ValueError naming what this kernel cannot run (Triton ``pallas_mla`` runs it)."""
    problems = []
    if cfg.layout != "latent" or cfg.num_kv_heads != 1:
        problems.append(f"layout {cfg.layout!r} with {cfg.num_kv_heads} KV heads (a latent "
                        "cache: layout 'latent', one KV head)")
    fp8 = cfg.is_fp8
    if not fp8 and cfg.storage_dtype not in ("bfloat16", "float16"):
        problems.append(f"storage {cfg.storage_dtype} (bfloat16, float16 or fp8)")
    if fp8 and cfg.scale_mode not in ("token", "block"):
        problems.append(f"fp8 scale mode {cfg.scale_mode!r} (token or block)")
    if fp8 and cfg.scale_mode == "block" and cfg.scale_block not in BLOCK_SCALE_WIDTHS:
        problems.append(f"scale blocks of {cfg.scale_block} values ({BLOCK_SCALE_WIDTHS})")
    if value_dim not in RANKS or cfg.head_dim - value_dim != ROPE:
        problems.append(f"rows of {value_dim} + {cfg.head_dim - value_dim} (kv_lora_rank in "
                        f"{RANKS}, qk_rope_head_dim {ROPE})")
    if (s := cfg.page_size) < 8 or (BLOCK_K % s and s % BLOCK_K):
        problems.append(f"page_size {s} (a divisor of {BLOCK_K} >= 8, or a multiple of it)")
    if num_heads < 1:
        problems.append(f"{num_heads} query heads")
    if problems:
        raise ValueError("the Mosaic GPU MLA kernel does not support " + "; ".join(problems)
                         + "; use the Triton kernel (pallas_mla)")


def check_tuning(tuning: MosaicMLATuning) -> None:
    """ValueError for a tuning the kernel cannot run (shared memory: ``smem_bytes``)."""
    if tuning.stages < 1 or tuning.head_block not in (0,) + HEAD_BLOCKS:
        raise ValueError(f"stages must be >= 1 and head_block one of {(0,) + HEAD_BLOCKS}; "
                         f"got {tuning}")


def smem_bytes(stages: int, n: int, rank: int, fp8: bool, pps: int,
               token_scales: bool, block_groups: int = 0) -> int:
    """Shared memory the kernel's buffers take (barriers and the reduction scratch on top).

    stages x 64 x R x (1 | 2) slots, + 64 x R x 2 f16 tiles (fp8), + N x R x 2 q,
    + r x N x 4 O^T staging, + 64 x N x 4 l, + N x 4 m, + N x 64 x 2 P^T, + stages x 64 x 4
    token scales or stages x G x 64 x 2 block scales (G = R / block), + the page-table
    slice (rounded up to 32 entries)."""
    width = rank + ROPE
    total = stages * BLOCK_K * width * (1 if fp8 else 2) + rank * n * 4  # slots, O^T
    total += BLOCK_K * width * 2 if fp8 else 0
    total += n * width * 2 + BLOCK_K * n * 4 + n * 4 + n * BLOCK_K * 2
    total += stages * BLOCK_K * 4 if token_scales else 0
    total += stages * block_groups * BLOCK_K * 2
    return total + -(-pps // 32) * 32 * 4


class _Dims(NamedTuple):
    stages: int
    tokens_per_split: int
    page_size: int
    fp8: bool
    token_scales: bool
    gathered_scales: bool
    qk_scale: float  # sm_scale * log2(e)
    rank: int
    n: int
    cdt: object  # the dots' operand dtype
    block: int  # fp8 block scales: values per scale (0: none)


def _kernel(len_ref, pt_ref, ql_ref, qr_ref, pages_ref, *refs, dims, plgpu, lay):
    if dims.token_scales or dims.block:
        sc_ref, o_ref, m_ref, l_ref, smem, barriers = refs
    else:
        o_ref, m_ref, l_ref, smem, barriers = refs
        sc_ref = None
    b, sp = lax.axis_index("b"), lax.axis_index("sp")
    start = sp * dims.tokens_per_split
    end = jnp.minimum(len_ref[b], start + dims.tokens_per_split)
    h = lax.axis_index("h")
    n_tiles = jnp.maximum(end - start + BLOCK_K - 1, 0) // BLOCK_K
    prog = SplitProgram(b, h, sp, lax.axis_index("wg"), start, end, n_tiles)

    @pl.when(prog.wg == 1)
    def _():
        _memory_warpgroup(prog, pt_ref, ql_ref, qr_ref, pages_ref, sc_ref, smem, barriers,
                          dims=dims, plgpu=plgpu)

    @pl.when(prog.wg == 0)
    def _():
        _compute_warpgroup(prog, o_ref, m_ref, l_ref, smem, barriers, dims=dims,
                           plgpu=plgpu, lay=lay)


def _memory_warpgroup(prog: SplitProgram, pt_ref, ql_ref, qr_ref, pages_ref, sc_ref, smem,
                      barriers, *, dims, plgpu):
    """q's two parts, the split's page-table slice, then each tile's latent and RoPE rows
    (and token scales) into its slot once the slot's previous tile is consumed."""
    page_size, stages, rank = dims.page_size, dims.stages, dims.rank
    ready, consumed = barriers["ready"], barriers["consumed"]
    b, sp, start, end = prog.b, prog.sp, prog.start, prog.end
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
    plgpu.copy_gmem_to_smem(ql_ref.at[b, prog.h], smem["q_lat"], barriers["q"])
    plgpu.copy_gmem_to_smem(qr_ref.at[b, prog.h], smem["q_rope"], barriers["q"])
    pt_s = smem["pt"]
    pps = dims.tokens_per_split // page_size
    stage_page_table(plgpu, pt_ref, b, sp * pps, pt_s, barriers["pt"])

    def copy_tile(t, slot):
        for rows, dst in page_chunks(pt_s, sp, pps, start, t, end, page_size, BLOCK_K):
            plgpu.copy_gmem_to_smem(pages_ref.at[rows, pl.ds(0, rank)],
                                    smem["lat"].at[slot, dst], ready.at[slot])
            plgpu.copy_gmem_to_smem(pages_ref.at[rows, pl.ds(rank, ROPE)],
                                    smem["rope"].at[slot, dst], ready.at[slot])
            if dims.token_scales and not dims.gathered_scales:  # pages of >= 32 tokens
                plgpu.copy_gmem_to_smem(sc_ref.at[rows], smem["sc"].at[slot, dst],
                                        ready.at[slot], oob_mode=in_bounds)
        keys = pl.ds(pl.multiple_of(start + t * BLOCK_K, BLOCK_K), BLOCK_K)
        if dims.gathered_scales:  # the tile's 64 scales, contiguous per split
            plgpu.copy_gmem_to_smem(sc_ref.at[b, keys], smem["sc"].at[slot], ready.at[slot],
                                    oob_mode=in_bounds)
        if dims.block:  # [G, 64] block scales, gathered per split (group-major) in XLA
            plgpu.copy_gmem_to_smem(sc_ref.at[b, :, keys], smem["bsc"].at[slot],
                                    ready.at[slot], oob_mode=in_bounds)

    walk_tiles(plgpu, prog.n_tiles, stages, consumed, copy_tile)


def _prepare_tile(prog: SplitProgram, t, slot, smem, *, dims, lay):
    """The tile's wgmma operands (latent, RoPE): fp8 upcast into the f16 tiles; 16-bit pages
    as landed, the latent rows past the end zeroed in place in the split's last tile."""
    lat, rope = smem["lat"].at[slot], smem["rope"].at[slot]
    last = prog.n_tiles - 1
    valid = prog.end - prog.start - t * BLOCK_K
    if dims.fp8:
        lat16, rope16 = smem["lat16"], smem["rope16"]
        scaled = {}
        if dims.block:  # the scales' groups: the latent's first, then the RoPE tail's
            scaled = dict(scales=smem["bsc"].at[slot], block=dims.block)
        up = functools.partial(lay.upcast_chunks, dtype=jnp.float16, **scaled)
        up(rope, rope16, None, **({"group0": dims.rank // dims.block} if dims.block else {}))
        pl.when(t < last)(lambda: up(lat, lat16, None))
        pl.when(t == last)(lambda: up(lat, lat16, valid))

        return lat16, rope16

    @pl.when(t == last)
    def _():
        lay.upcast_chunks(lat, lat, valid, dtype=dims.cdt)

    return lat, rope


def _compute_warpgroup(prog: SplitProgram, o_ref, m_ref, l_ref, smem, barriers, *, dims, plgpu,
                       lay):
    """Runs the split's tiles, then writes its partial state (O^T, m, per-element l)."""
    n, rank = dims.n, dims.rank
    plgpu.barrier_wait(barriers["q"])
    step = functools.partial(_tile_step, prog, smem, barriers, dims=dims, plgpu=plgpu,
                             lay=lay)
    init = (lay.cast(jnp.zeros((rank, n), jnp.float32), lay.wgmma),
            lay.cast(jnp.full((n,), -jnp.inf, jnp.float32), lay.col),
            lay.cast(jnp.zeros((BLOCK_K, n), jnp.float32), lay.wgmma))
    acc, m_i, l_i = lax.fori_loop(0, prog.n_tiles, step, init)
    smem["o"][...] = acc
    smem["m"][...] = m_i
    smem["l"][...] = l_i
    plgpu.commit_smem()
    at = (prog.b, prog.h, prog.sp)
    plgpu.copy_smem_to_gmem(smem["o"], o_ref.at[at])
    plgpu.copy_smem_to_gmem(smem["m"], m_ref.at[at])
    plgpu.copy_smem_to_gmem(smem["l"], l_ref.at[at])
    plgpu.wait_smem_to_gmem(0)


def _tile_step(prog: SplitProgram, smem, barriers, t, carry, *, dims, plgpu, lay):
    """One tile: (upcast,) S^T = C q^T in two parts, the online softmax down the columns,
    P^T to shared memory, O^T += C_lat^T P^T. carry = (acc [r, N], m [N], l [BK, N])."""
    acc, m_i, l_i = carry
    slot = lax.rem(t, dims.stages)
    plgpu.barrier_wait(barriers["ready"].at[slot])
    lat, rope = _prepare_tile(prog, t, slot, smem, dims=dims, lay=lay)
    if dims.token_scales:
        tok = lay.load_rows(smem["sc"].at[slot])
    plgpu.commit_smem()  # the upcast / zeroed tiles visible to the wgmma
    if dims.fp8:
        plgpu.barrier_arrive(barriers["consumed"].at[slot])  # the fp8 slot is read
    s = lay.qk_t2(lat, smem["q_lat"], rope, smem["q_rope"])  # [BK, N]
    shape = s.shape
    visible = lay.iota(shape, 0) + prog.start + t * BLOCK_K < prog.end
    if dims.token_scales:
        s = s * lax.broadcast_in_dim(tok, shape, [0])
    s = jnp.where(visible, s * dims.qk_scale, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=0))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, shape, [1]))
    l_new = l_i * lax.broadcast_in_dim(alpha, shape, [1]) + p
    if dims.token_scales:  # past the end the scales are unwritten (NaN in the tests)
        p = jnp.where(visible, p * lax.broadcast_in_dim(tok, shape, [0]), 0.0)
    lay.store_pt(smem["p"], p.astype(dims.cdt))
    plgpu.commit_smem()  # P^T visible to the wgmma
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
    acc = lay.pv_t_into(acc, lat, smem["p"])
    if not dims.fp8:
        plgpu.barrier_arrive(barriers["consumed"].at[slot])  # both products read the slot
    return acc, m_new, l_new


def _slot(plgpu, shape, dtype):
    """A TMA slot of rows copied from the [P*S, R] pool. Mosaic tiles the pool's row like the
    slot, and R = 576 must be a multiple of the tile: 64 columns, a 128-byte swizzle for
    16-bit rows (the tile is then a wgmma operand); 64 fp8 columns (a 64-byte swizzle) for
    fp8 rows, which only the upcast reads."""
    if jnp.dtype(dtype).itemsize != 1:
        return swizzled(plgpu, shape, dtype)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, ROPE)),
                                                plgpu.SwizzleTransform(ROPE)))


def _scratch(plgpu, dims: _Dims, pps: int, storage, copies_per_tile: int):
    st, n, rank, cdt = dims.stages, dims.n, dims.rank, dims.cdt
    smem = {
        "q_lat": swizzled(plgpu, (n, rank), cdt),
        "q_rope": swizzled(plgpu, (n, ROPE), cdt),
        "pt": plgpu.SMEM((-(-pps // 32) * 32,), jnp.int32),
        "p": swizzled(plgpu, (n, BLOCK_K), cdt),
        "m": plgpu.SMEM((n,), jnp.float32),
        "l": plgpu.SMEM((BLOCK_K, n), jnp.float32),
        "lat": _slot(plgpu, (st, BLOCK_K, rank), storage),
        "rope": _slot(plgpu, (st, BLOCK_K, ROPE), storage),
        "o": plgpu.SMEM((rank, n), jnp.float32),
    }
    if dims.fp8:
        smem["lat16"] = swizzled(plgpu, (BLOCK_K, rank), jnp.float16)
        smem["rope16"] = swizzled(plgpu, (BLOCK_K, ROPE), jnp.float16)
    if dims.token_scales:
        smem["sc"] = plgpu.SMEM((st, BLOCK_K), jnp.float32)
    if dims.block:
        groups = (rank + ROPE) // dims.block
        smem["bsc"] = plgpu.SMEM((st, groups, BLOCK_K), jnp.float16)
    barriers = {
        "ready": plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=st),
        "consumed": plgpu.Barrier(num_barriers=st),
        "q": plgpu.Barrier(num_arrivals=2),
        "pt": plgpu.Barrier(),
    }
    return smem, barriers


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale", "value_dim", "interpret",
                                             "tuning"))
def latent_attention(q, pages, scale, page_tables, seq_lens, q_positions, cfg: CacheConfig,
                     sm_scale: float, value_dim: int, interpret: bool = False,
                     tuning: MosaicMLATuning | None = None):
    """q [B, 1, H, R] -> [B, 1, H, value_dim]; ``pallas_mla.latent_attention``'s contract
    for decode (T == 1) in the configurations ``check_supported`` accepts. Static: cfg,
    sm_scale, value_dim, interpret, tuning. Nothing is donated."""
    plgpu = load_plgpu()
    tuning = tuning or MosaicMLATuning()
    b, t, nh, width = q.shape
    if t != 1:
        raise ValueError(f"the Mosaic GPU MLA kernel is decode only (T == 1), got T = {t}; "
                         "use the Triton kernel (pallas_mla)")
    check_supported(cfg, nh, value_dim)
    check_tuning(tuning)
    if width != cfg.head_dim:
        raise ValueError(f"q rows of {width} for latent rows of {cfg.head_dim}")
    rank, s = value_dim, cfg.page_size
    n = tuning.block(nh)
    nhb = -(-nh // n)
    fp8 = cfg.is_fp8
    token_scales = fp8 and cfg.scale_mode == "token"
    block = cfg.scale_block if fp8 and cfg.scale_mode == "block" else 0
    groups = width // block if block else 0
    cdt = jnp.dtype(jnp.float16) if fp8 else jnp.dtype(cfg.storage_dtype)
    # each split's page-table slice is copied rounded up to 32 entries (128 bytes)
    split, pt = split_page_tables(page_tables, s, nhb, tuning, BLOCK_K, table_round=32)
    ns, tokens_per_split, pps = split.num_splits, split.tokens_per_split, split.pages_per_split
    gathered = token_scales and s * 4 % 128 != 0
    need = smem_bytes(tuning.stages, n, rank, fp8, pps, token_scales, groups)
    if need > SMEM_LIMIT - SMEM_RESERVE:
        raise ValueError(f"{tuning} needs {need} bytes of shared memory at N = {n}, R = "
                         f"{width} ({cfg.storage_dtype}; at most {SMEM_LIMIT - SMEM_RESERVE})"
                         ": fewer stages or head_block 8")
    dims = _Dims(tuning.stages, tokens_per_split, s, fp8, token_scales, gathered,
                 float(sm_scale) * LOG2E, rank, n, cdt, block)
    copies = ((2 + (token_scales and not gathered)) * max(1, BLOCK_K // s) + gathered
              + bool(block))
    smem, barriers = _scratch(plgpu, dims, pps, pages.dtype, copies)
    out_type = (jax.ShapeDtypeStruct((b, nhb, ns, rank, n), jnp.float32),
                jax.ShapeDtypeStruct((b, nhb, ns, n), jnp.float32),
                jax.ShapeDtypeStruct((b, nhb, ns, BLOCK_K, n), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_kernel, dims=dims, plgpu=plgpu, lay=LatentOps(plgpu, interpret)),
        out_type=out_type,
        grid=(b, nhb, ns), grid_names=("b", "h", "sp"),
        num_threads=2, thread_name="wg",
        scratch_types=(smem, barriers),
        # lane semantics (the transposed P^T store), no automatic barriers: mbarriers,
        # commit_smem before each wgmma and the wgmma waits order the accesses
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True),
        kernel_name="jfp8kv_mosaic_mla", **interpret_kwargs(interpret))
    qh = q[:, 0].astype(jnp.float32).astype(cdt)
    qh = jnp.pad(qh, ((0, 0), (0, nhb * n - nh), (0, 0))).reshape(b, nhb, n, width)
    # q <= its position + 1 keys, as the contract's causal mask for T == 1
    lens = jnp.clip(jnp.minimum(seq_lens.astype(jnp.int32),
                                q_positions[:, 0].astype(jnp.int32) + 1), 0)
    operands = [lens, pt, qh[..., :rank], qh[..., rank:], pages.reshape(-1, width)]
    if gathered:  # [B, ns * tokens_per_split]: each split's scales, page by page
        idx = pt[:, : ns * pps, None] * s + jnp.arange(s)
        operands.append(scale.reshape(-1).astype(jnp.float32)[idx.reshape(b, -1)])
    elif token_scales:
        operands.append(scale.reshape(-1).astype(jnp.float32))
    if block:  # [B, G, ns * tokens_per_split] f16: each split's scales, group-major
        idx = (pt[:, : ns * pps, None] * s + jnp.arange(s)).reshape(b, -1)
        operands.append(jnp.swapaxes(scale.reshape(-1, groups).astype(jnp.float16)[idx], 1, 2))
    o, m, l = kernel(*operands)
    out = combine_splits(jnp.swapaxes(o, -1, -2), m, l.sum(axis=-2))  # [B, NHB, N, r]
    return out.reshape(b, 1, nhb * n, rank)[:, :, :nh].astype(q.dtype)
