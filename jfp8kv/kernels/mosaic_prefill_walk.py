"""The page walk of ``mosaic_prefill``'s programs: the memory warpgroup that copies each key
tile's pages into shared memory (16-bit pages), the one that also upcasts fp8 tiles for the
compute warpgroups, the one that feeds the fp8-products path (K as landed, V upcast), and
the shared memory and barriers they share with the compute warpgroups. A program's
warpgroups see ``_Dims`` (``mosaic_prefill``) as ``dims``."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jfp8kv.config import CacheConfig
from jfp8kv.kernels.mosaic_ops import ROWS, drain_slots, swizzled, walk_tiles
from jfp8kv.kernels.tiles import KVLayout

CWGS = 2  # compute warpgroups: a program's query block is CWGS * ROWS queries

@dataclasses.dataclass(frozen=True)
class Program:
    """What every warpgroup of one (batch row, query head, query block) program knows."""

    b: jax.Array
    h: jax.Array  # query head
    hkv: jax.Array
    qb: jax.Array
    wg: jax.Array
    seq_len: jax.Array
    kv_end: jax.Array  # keys the program needs: min(seq_len, its largest position + 1)


def tiles(end, block_k: int):
    return (end + block_k - 1) // block_k


def memory_warpgroup(prog: Program, n_tiles, pt_ref, k_ref, v_ref, ks_ref, vs_ref, smem,
                      barriers, *, dims, plgpu, lay):
    """16-bit pages: copies each of the program's tiles' pages into its slot once both
    compute warpgroups have released the slot's previous tile. The last tile's copies land on
    a barrier of their own, V's rows past the program's keys (``kv_end``: unwritten slots,
    or page 0 where a page lies past it) are zeroed, then the slot is made ready with as many
    arrivals as the copies would have made."""
    stages, bk = dims.stages, dims.block_k
    ready, consumed = barriers["ready"], barriers["consumed"]
    last = n_tiles - 1
    copy = functools.partial(_copy_tile, prog, pt_ref=pt_ref, k_ref=k_ref, v_ref=v_ref,
                             ks_ref=ks_ref, vs_ref=vs_ref, smem=smem, dims=dims, plgpu=plgpu)

    def copy_tile(t, slot):
        @pl.when(t < last)
        def _():
            copy(t, slot, barrier=ready.at[slot])

        @pl.when(t == last)
        def _():
            copies = copy(t, slot, barrier=barriers["last"])
            plgpu.barrier_wait(barriers["last"])
            lay.zero_rows_from(smem["v"].at[slot], prog.kv_end - t * bk)
            plgpu.commit_smem()  # visible to the wgmma (async proxy) before the arrivals
            for _ in range(copies):
                plgpu.barrier_arrive(ready.at[slot])

    walk_tiles(plgpu, n_tiles, stages, consumed, copy_tile)


def upcasting_warpgroup(prog: Program, n_tiles, pt_ref, k_ref, v_ref, ks_ref, vs_ref, smem,
                         barriers, *, dims, plgpu, lay, part: str = "kv"):
    """fp8 pages: copies each tile's pages into an fp8 slot ``stages`` tiles ahead, upcasts
    the landed tile once into the f16 slot both compute warpgroups read (V's rows past
    ``kv_end`` zeroed in the last tile; token scales copied beside it), then refills the
    fp8 slot once it has been read. The compute warpgroups see the same slots and barriers
    as for 16-bit pages. ``part``: "kv" (one upcasting warpgroup), or "k" (copies, upcasts
    K) / "v" (upcasts V) for two; each arrives on the slot's "ready" and "read" barriers."""
    stages, bk = dims.stages, dims.block_k
    landed, ready, consumed = barriers["landed"], barriers["ready"], barriers["consumed"]
    read = barriers["read"]
    last = n_tiles - 1
    issues_copies = part != "v"
    fp8 = {name: smem[name + "8"] for name in ("k", "v", "ks", "vs") if name + "8" in smem}
    copy = functools.partial(_copy_tile, prog, pt_ref=pt_ref, k_ref=k_ref, v_ref=v_ref,
                             ks_ref=ks_ref, vs_ref=vs_ref, smem=fp8, dims=dims, plgpu=plgpu)

    if issues_copies:
        for t in range(stages):  # the first tiles' copies
            pl.when(t < n_tiles)(lambda t=t: (copy(t, t, barrier=landed.at[t]), None)[1])

    def upcast(t, slot, masked: bool):
        if "k" in part:
            smem["k"].at[slot][...] = lay.upcast(fp8["k"].at[slot], jnp.float16)
        if "v" in part:
            smem["v"].at[slot][...] = lay.upcast(fp8["v"].at[slot], jnp.float16,
                                                 prog.kv_end - t * bk if masked else None)
        if dims.token_scales:
            for name in ("ks", "vs"):
                if name[0] in part:
                    smem[name].at[slot][...] = lay.load_cols(fp8[name].at[slot])

    @pl.loop(0, n_tiles)
    def _tile(t):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(landed.at[slot])

        @pl.when(t >= stages)
        def _():
            plgpu.barrier_wait(consumed.at[slot])

        pl.when(t < last)(lambda: upcast(t, slot, masked=False))
        pl.when(t == last)(lambda: upcast(t, slot, masked=True))
        plgpu.commit_smem()  # the f16 tile visible to the wgmma (async proxy)
        plgpu.barrier_arrive(ready.at[slot])
        # every upcasting thread has read the fp8 slot: TMA may overwrite it
        read_slot = read.at[slot] if dims.upcast_wgs == 2 else read  # one warpgroup: one
        plgpu.barrier_arrive(read_slot)
        if issues_copies:
            plgpu.barrier_wait(read_slot)

            @pl.when(t + stages < n_tiles)
            def _():
                copy(t + stages, slot, barrier=landed.at[slot])

    drain_slots(plgpu, n_tiles, stages, consumed)


def fp8_products_warpgroup(prog: Program, n_tiles, pt_ref, k_ref, v_ref, ks_ref, vs_ref,
                           smem, barriers, *, dims, plgpu, lay):
    """fp8 products: copies tile t's pages (K and token scales where the compute warpgroups
    read them, V into "v8") once the slot's previous tile is consumed, and, one tile behind,
    transposes the landed V into "vt" (exactly; rows past ``kv_end`` zeroed in the last
    tile) and makes the slot ready. K is used as it landed."""
    stages, bk = dims.stages, dims.block_k
    landed, ready, consumed = barriers["landed"], barriers["ready"], barriers["consumed"]
    last = n_tiles - 1
    dst = {"k": smem["k"], "v": smem["v8"], **{n: smem[n] for n in ("ks", "vs") if n in smem}}
    copy = functools.partial(_copy_tile, prog, pt_ref=pt_ref, k_ref=k_ref, v_ref=v_ref,
                             ks_ref=ks_ref, vs_ref=vs_ref, smem=dst, dims=dims, plgpu=plgpu)

    def upcast(u, slot, masked: bool):
        lay.transpose8(smem["v8"].at[slot], smem["vt"].at[slot],
                       prog.kv_end - u * bk if masked else None)

    @pl.loop(0, n_tiles + 1)
    def _step(t):
        @pl.when(t < n_tiles)
        def _():
            slot = lax.rem(t, stages)

            @pl.when(t >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            copy(t, slot, barrier=landed.at[slot])

        @pl.when(t >= 1)
        def _():
            u = t - 1
            slot = lax.rem(u, stages)
            plgpu.barrier_wait(landed.at[slot])
            pl.when(u < last)(lambda: upcast(u, slot, masked=False))
            pl.when(u == last)(lambda: upcast(u, slot, masked=True))
            plgpu.commit_smem()  # V^T visible to the wgmma (async proxy)
            plgpu.barrier_arrive(ready.at[slot])

    drain_slots(plgpu, n_tiles, stages, consumed)


def _copy_tile(prog: Program, t, slot, *, pt_ref, k_ref, v_ref, ks_ref, vs_ref, smem,
               barrier, dims, plgpu) -> int:
    """Issues tile ``t``'s page copies (K, V, token scales) into ``slot``, each arriving on
    ``barrier``; returns how many. Pages past ``prog.kv_end`` copy any real page (page 0)."""
    page_size, bk = dims.page_size, dims.block_k
    copy_rows = min(page_size, bk)
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS  # every copy reads a real page
    copies = 0
    for j in range(bk // copy_rows):
        tok0 = t * bk + j * copy_rows
        pidx = tok0 // page_size
        page = jnp.where(tok0 < prog.kv_end, pt_ref[prog.b, pidx], 0)
        row0 = page * page_size + (tok0 - pidx * page_size)
        rows = pl.ds(pl.multiple_of(row0, copy_rows), copy_rows)
        dst = pl.ds(j * copy_rows, copy_rows)
        plgpu.copy_gmem_to_smem(k_ref.at[prog.hkv, rows], smem["k"].at[slot, dst], barrier)
        plgpu.copy_gmem_to_smem(v_ref.at[prog.hkv, rows], smem["v"].at[slot, dst], barrier)
        copies += 2
        if dims.token_scales and not dims.gather_scales:  # 4 bytes a token: plain bulk
            for src, dst_s in ((ks_ref, smem["ks"]), (vs_ref, smem["vs"])):  # copies
                plgpu.copy_gmem_to_smem(src.at[prog.hkv, rows], dst_s.at[slot, dst], barrier,
                                        oob_mode=in_bounds)
                copies += 1
    if dims.token_scales and dims.gather_scales:  # the tile's keys, gathered: [Hkv, B, keys]
        keys = pl.ds(t * bk, bk)
        for src, dst_s in ((ks_ref, smem["ks"]), (vs_ref, smem["vs"])):
            plgpu.copy_gmem_to_smem(src.at[prog.hkv, prog.b, keys], dst_s.at[slot], barrier,
                                    oob_mode=in_bounds)
            copies += 1
    return copies


def scratch(plgpu, cfg: CacheConfig, kv: KVLayout, dims):
    """The compute warpgroups' slots ("k", "v", token scales "ks"/"vs") hold 16-bit tiles;
    fp8 pages land in a ring of their own ("k8", ...) that the memory warpgroup upcasts.
    fp8 products (``dims.f8``): K and the scales land where the compute warpgroups read
    them, V in "v8" (upcast into "v"); q8 and its row scales ("q8", "qs") beside "qo"."""
    d, pages, st, bk = cfg.head_dim, jnp.dtype(cfg.storage_dtype), dims.stages, dims.block_k
    ring = {"k": swizzled(plgpu, (st, bk, d), pages if dims.f8 else kv.cdt)}
    if dims.f8:  # V transposed: an 8-bit wgmma's B operand is K-major only
        ring["vt"] = swizzled(plgpu, (st, d, bk), pages)
    else:
        ring["v"] = swizzled(plgpu, (st, bk, d), kv.cdt)
    if dims.token_scales:
        ring.update(ks=plgpu.SMEM((st, bk), jnp.float32), vs=plgpu.SMEM((st, bk), jnp.float32))
    smem = {"qo": swizzled(plgpu, (CWGS, ROWS, d), kv.cdt),  # q in (16-bit q), the output out
            "pos": plgpu.SMEM((CWGS, ROWS), jnp.int32), **ring}
    if dims.static_v:
        smem["vsc"] = plgpu.SMEM((CWGS, d), jnp.float32)
    if dims.f8:
        smem.update(q8=swizzled(plgpu, (CWGS, ROWS, d), pages), qs=plgpu.SMEM((CWGS, ROWS),
                    jnp.float32), v8=swizzled(plgpu, (st, bk, d), pages),
                    p8=swizzled(plgpu, (CWGS, ROWS, bk), pages))
    elif cfg.is_fp8:
        smem.update({name + "8": ref for name, ref in ring.items()},
                    k8=swizzled(plgpu, (st, bk, d), pages), v8=swizzled(plgpu, (st, bk, d), pages))
    pages = max(1, bk // cfg.page_size)
    copies = 2 * pages + (0 if not dims.token_scales else 2 if dims.gather_scales else 2 * pages)
    q_copies = 2 + int(dims.static_v) + int(dims.f8)
    barriers = {"ready": plgpu.Barrier(num_arrivals=dims.upcast_wgs if dims.fp8 else copies,
                                       num_barriers=st),
                "consumed": plgpu.Barrier(num_arrivals=CWGS, num_barriers=st),
                "q": plgpu.Barrier(num_arrivals=q_copies, num_barriers=CWGS)}
    if dims.fp8:  # copies landed in the fp8 ring; the upcast has read an fp8 slot
        barriers["landed"] = plgpu.Barrier(num_arrivals=copies, num_barriers=st)
    if dims.fp8 and not dims.f8:
        barriers["read"] = (plgpu.Barrier(num_arrivals=2, num_barriers=st)
                            if dims.upcast_wgs == 2 else plgpu.Barrier())
    if not dims.fp8:  # the last tile's copies (its V is zeroed past the sequence first)
        barriers["last"] = plgpu.Barrier(num_arrivals=copies)
    if dims.pingpong:
        barriers["sched"] = plgpu.Barrier(num_arrivals=CWGS)
    return smem, barriers


def gathered_scales(scales, page_tables, page_size: int):
    """Token scales [Hkv, P*S] -> f32 [Hkv, B, width * S]: each batch row's keys in order
    through its (tile-padded) page table; entries past a sequence read whatever page the
    table holds there (their keys are masked)."""
    tok = jnp.arange(page_tables.shape[1] * page_size, dtype=jnp.int32)
    rows = page_tables[:, tok // page_size] * page_size + tok % page_size
    return jnp.take(scales.astype(jnp.float32), rows, axis=1, mode="clip")


def block_ends(q_positions, seq_lens, tp: int):
    """int32 [B, tp / ROWS, 2]: per 64-row block, the keys it needs (min(seq_len, max
    position + 1)) and the keys every row sees (min(seq_len, min position + 1))."""
    pos = q_positions.reshape(q_positions.shape[0], tp // ROWS, ROWS)
    n = seq_lens[:, None]
    return jnp.stack([jnp.minimum(n, pos.max(-1) + 1), jnp.clip(pos.min(-1) + 1, 0, n)], -1)
