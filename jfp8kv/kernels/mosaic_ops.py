"""Mosaic GPU operations a warpgroup-semantics kernel body calls through one object, so that
the same body runs natively (layouts, wgmma) and in the CPU's GPU interpret mode (jnp).

Shapes: wgmma's M is ``ROWS`` (64) rows; vectors come in the WGMMA layout's row or column
reductions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jfp8kv.kernels.pallas_decode import DecodeTuning, choose_splits
from jfp8kv.kernels.tiles import KVLayout

ROWS = 64  # wgmma's M


def load_plgpu():
    """``jax.experimental.pallas.mosaic_gpu``, imported late: it needs absl-py."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def swizzled(plgpu, shape, dtype):
    """Shared memory for a wgmma operand or a TMA tile: (8, 128-byte) tiles, swizzled."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[-1] * bits)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)))


def layout_problems(cfg, block_k: int) -> list[str]:
    """What the Mosaic kernels' page walk and upcast cannot take of ``cfg`` (a
    ``CacheConfig``), each naming what works: block scales, head sizes other than 64/128,
    page sizes that neither divide the key tile nor are multiples of it, K rotation."""
    problems = []
    if KVLayout.of(cfg).groups > 1:
        problems.append("block scales (token, tensor or channel)")
    if cfg.head_dim not in (64, 128):
        problems.append(f"head_dim {cfg.head_dim} (64 or 128)")
    if (s := cfg.page_size) < 8 or (block_k % s and s % block_k):
        problems.append(f"page_size {s} (a divisor of {block_k} >= 8, or a multiple of it)")
    if cfg.kv_rotation != "none":
        problems.append(f"kv_rotation {cfg.kv_rotation!r} (none)")
    return problems


def grouped_queries(q, kv: KVLayout, k_scales, num_kv_heads: int):
    """q [..., H, D] -> f32 [..., Hkv, G, D], static K scales ([Hkv, D], the kernel layout)
    folded in per channel as ``tiles.prepare_q`` does inside the Triton kernels; the Mosaic
    kernels take q this way, prepared in XLA."""
    *lead, nh, d = q.shape
    qg = q.astype(jnp.float32).reshape(*lead, num_kv_heads, nh // num_kv_heads, d)
    if kv.mode.is_static:
        qg = qg * k_scales.astype(jnp.float32)[:, None, :]
    return qg


@dataclasses.dataclass(frozen=True)
class SplitProgram:
    """What every warpgroup of one (batch row, KV head, split) decode program knows."""

    b: jax.Array
    h: jax.Array
    sp: jax.Array
    wg: jax.Array
    start: jax.Array  # the split's first token
    end: jax.Array  # min(seq_len, the split's end)
    n_tiles: jax.Array


MAX_SPLIT_PAGES = 2048  # page-table entries a program holds in shared memory (8 KB)


@dataclasses.dataclass(frozen=True)
class SplitLayout:
    """A decode call's page tables cut into ``num_splits`` splits of ``tokens_per_split``
    tokens (``pages_per_split`` pages) each."""

    num_splits: int
    tokens_per_split: int
    pages_per_split: int


def split_page_tables(page_tables, page_size: int, programs: int, tuning, block_k: int, *,
                      step_tiles: int = 1, table_round: int = 1):
    """(SplitLayout, int32 page tables padded to its width). The split count is
    ``pallas_decode.choose_splits``' rule for ``programs`` programs a batch row (``tuning``'s
    ``num_splits`` and ``target_programs``; a program's step of ``step_tiles`` tiles counts as
    its block), doubled until a split's slice holds at most ``MAX_SPLIT_PAGES`` pages. A split
    holds whole ``block_k`` tiles and whole groups of 4 pages (its slice starts on 16 bytes:
    ``stage_page_table``); the table is padded so that every split's slice, rounded up to
    ``table_round`` entries, lies inside it."""
    batch, max_pages = page_tables.shape
    max_tokens = max_pages * page_size
    ns = choose_splits(batch, programs, max_tokens, DecodeTuning(
        block_k=step_tiles * block_k, num_splits=tuning.num_splits,
        target_programs=tuning.target_programs))
    while -(-max_tokens // ns) > MAX_SPLIT_PAGES * page_size:
        ns *= 2
    unit = max(block_k, 4 * page_size)
    tokens_per_split = -(-max_tokens // (ns * unit)) * unit
    pps = tokens_per_split // page_size
    width = (ns - 1) * pps + -(-pps // table_round) * table_round
    pt = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, width - max_pages)))
    return SplitLayout(ns, tokens_per_split, pps), pt


def stage_page_table(plgpu, pt_ref, b, first_page, pt_s, barrier) -> None:
    """Copies ``pt_s.shape[0]`` entries of row ``b`` of the page table from ``first_page``
    (a multiple of 4: copies move 16-byte units) into shared memory and waits for them: a
    page index is then read from shared memory per copy instead of a dependent global load
    (which serialized the copies' issue)."""
    plgpu.copy_gmem_to_smem(pt_ref.at[b, pl.ds(pl.multiple_of(first_page, 4), pt_s.shape[0])],
                            pt_s, barrier, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
    plgpu.barrier_wait(barrier)


def walk_tiles(plgpu, n_tiles, stages: int, consumed, copy_tile) -> None:
    """A decode memory warpgroup's loop over its ``n_tiles`` tiles in ``stages`` slots:
    ``copy_tile(t, slot)`` once the slot's previous tile is consumed (``consumed``, one
    barrier a slot), then a wait on every slot's last release (a barrier ends its life with
    no phase unseen)."""

    @pl.loop(0, n_tiles)
    def _tile(t):
        slot = lax.rem(t, stages)

        @pl.when(t >= stages)
        def _():
            plgpu.barrier_wait(consumed.at[slot])

        copy_tile(t, slot)

    drain_slots(plgpu, n_tiles, stages, consumed)


def drain_slots(plgpu, n_tiles, stages: int, consumed) -> None:
    """Waits on each of the ``stages`` slots' last release (``consumed``) of ``n_tiles``
    tiles: a barrier ends its life with no phase unseen."""

    @pl.loop(jnp.maximum(n_tiles - stages, 0), n_tiles)
    def _drain(t):
        plgpu.barrier_wait(consumed.at[lax.rem(t, stages)])


def page_chunks(pt_s, split, split_pages: int, start, t, end, page_size: int, block_k: int):
    """The pool rows of tile ``t`` of a split that starts at token ``start``: per page-sized
    chunk of the tile's ``block_k`` keys (one chunk when a page holds the tile),
    ``(rows, dst)``: the chunk's rows in the [P * S, ...] pool and its rows in the tile.
    ``pt_s`` is the split's page-table slice in shared memory (entries from page
    ``split * split_pages``); past ``end`` a chunk reads page 0 (a real page; its keys are
    masked)."""
    copy_rows = min(page_size, block_k)
    for j in range(block_k // copy_rows):
        tok0 = start + t * block_k + j * copy_rows
        pidx = tok0 // page_size
        page = pt_s[pidx - split * split_pages]
        page = jnp.where(tok0 < end, page, 0)
        row0 = page * page_size + (tok0 - pidx * page_size)
        yield pl.ds(pl.multiple_of(row0, copy_rows), copy_rows), pl.ds(j * copy_rows, copy_rows)


def take_turns(plgpu, barrier) -> None:
    """FA3's ping-pong turn between two compute warpgroups (nothing when ``barrier`` is
    None): both arrive on ``barrier`` (two arrivals), each waits for the other. Each passes
    it twice per tile (issuing q.K^T, before P.V); the second warpgroup once more before its
    first tile and the first once more after its last, so their softmax and wgmma alternate."""
    if barrier is not None:
        plgpu.barrier_arrive(barrier)
        plgpu.barrier_wait(barrier)


def interpret_kwargs(interpret: bool) -> dict:
    """``plgpu.kernel`` keywords: the CPU's GPU interpret mode with its race detector on
    (tests read its verdict), or nothing."""
    if not interpret:
        return {}
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return {"interpret": InterpretGPUParams(detect_races=True)}


class MosaicOps:
    """The calls that carry a layout or a wgmma; in interpret mode (no layouts on the CPU, no
    transposed wgmma operand) the plain jnp operations."""

    def __init__(self, plgpu, interpret: bool):
        self.plgpu, self.interpret = plgpu, interpret
        self.wgmma = plgpu.Layout.WGMMA
        self.row = self.wgmma.reduce(1)  # one value per q row
        self.col = self.wgmma.reduce(0)  # one value per key

    def cast(self, x, layout):
        return x if self.interpret else self.plgpu.layout_cast(x, layout)

    def iota(self, shape, dim):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return self.plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self.wgmma)

    def row_iota(self):
        """0 .. ROWS-1, one value per row of a WGMMA-layout array."""
        if self.interpret:
            return lax.iota(jnp.int32, ROWS)
        return self.plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=self.row)

    def zero_rows_from(self, ref, n_valid):
        """ref [BK, D] (shared memory, BK a multiple of ROWS): rows at or past ``n_valid``
        set to 0, in [ROWS, 128-byte] chunks (a chunk fits a memory warpgroup's 40
        registers). 16-bit only: Mosaic has no 8-bit select."""
        bk, d = ref.shape
        width = min(d, 128 // ref.dtype.itemsize)
        keep = self.row_iota()
        for r0 in range(0, bk, ROWS):
            rows = lax.broadcast_in_dim(keep + r0 < n_valid, (ROWS, width), [0])
            for c0 in range(0, d, width):
                chunk = ref.at[pl.ds(r0, ROWS), pl.ds(c0, width)]
                x = chunk[...]
                chunk[...] = jnp.where(rows, x, jnp.zeros_like(x))

    def qk(self, q_s, k16, during=None):
        """q [ROWS, D] . K^T, both in shared memory -> f32 [ROWS, BK] (the interpreter has no
        transposed wgmma operand: jnp dots there); ``during()`` runs while it computes."""
        if self.interpret:
            s = lax.dot_general(q_s[...], k16[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
            return s if during is None else (during(), s)[1]
        return self._wgmma((ROWS, k16.shape[0]), q_s, self.plgpu.transpose_ref(k16, (1, 0)),
                           during)

    def pv(self, p16, v16):
        """P [ROWS, BK] (registers) . V [BK, D] (shared memory) -> f32 [ROWS, D]."""
        if self.interpret:
            return lax.dot_general(p16, v16[...], (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return self._wgmma((p16.shape[0], v16.shape[1]), p16, v16)

    def pv_into(self, acc, p16, v16):
        """acc + P [ROWS, BK] (registers) . V [BK, D] (shared memory): the wgmma accumulates
        into ``acc`` itself (no second accumulator to add)."""
        if self.interpret:
            return acc + self.pv(p16, v16)

        def body(acc_ref):
            self.plgpu.wgmma(acc_ref, p16, v16)

        return pl.run_state(body)(self.plgpu.ACC.init(acc))

    def pv8_into(self, acc, p_s, vt):
        """acc + P [ROWS, BK] . V for 8-bit operands in shared memory: P itself and V^T
        [D, BK] (an 8-bit wgmma reads B K-major only, so V is stored transposed)."""
        if self.interpret:
            return acc + lax.dot_general(p_s[...], vt[...], (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)

        def body(acc_ref):
            self.plgpu.wgmma(acc_ref, p_s, self.plgpu.transpose_ref(vt, (1, 0)))

        return pl.run_state(body)(self.plgpu.ACC.init(acc))

    def transpose8(self, src, dst, valid_rows=None):
        """An 8-bit tile [R, C] in shared memory (R a multiple of ``ROWS``) -> ``dst`` [C, R]
        (8-bit, swizzled), exactly; src rows at or past ``valid_rows`` (if given) zero. Via
        f16 registers: Mosaic relayouts WGMMA -> WGMMA_TRANSPOSED for 16-bit values only,
        then stores the 8-bit cast through a transposed view of ``dst``."""
        if self.interpret:
            x = src[...].astype(jnp.float16)
            rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
        else:
            x = self.plgpu.load(src, (), layout=self.wgmma).astype(jnp.float16)
            rows = self.plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=self.wgmma)
        if valid_rows is not None:
            x = jnp.where(rows < valid_rows, x, jnp.zeros_like(x))
        if self.interpret:
            dst[...] = x.T.astype(dst.dtype)
            return
        x = self.plgpu.layout_cast(x, self.plgpu.Layout.WGMMA_TRANSPOSED).astype(dst.dtype)
        self.plgpu.transpose_ref(dst, (1, 0))[...] = x

    def _wgmma(self, shape, a, b, during=None):
        def body(acc_ref):
            self.plgpu.wgmma(acc_ref, a, b)
            if during is not None:
                during()
            return acc_ref[...]  # waits for the wgmma

        return pl.run_scoped(body, self.plgpu.ACC(shape, jnp.float32))

    def upcast(self, ref, dtype, valid_rows=None):
        """An 8-bit tile [R, C] in shared memory (R a multiple of ``ROWS``, C of 32) ->
        ``dtype`` registers, rows at or past ``valid_rows`` (if given) zero. Loaded 8
        consecutive values a thread (``wide``), so that storing the result into a 16-bit
        swizzled tile takes one 16-byte store per 8 values: the layout the warpgroup
        semantics infers for a plain load moves 2 bytes a load and 4 a store."""
        if self.interpret:
            x = ref[...].astype(dtype)
            rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
        else:
            x = self.plgpu.load(ref, (), layout=self.wide).astype(dtype)
            rows = self.plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=self.wide)
        if valid_rows is None:
            return x
        return jnp.where(rows < valid_rows, x, jnp.zeros_like(x))

    @property
    def wide(self):
        """A tiled register layout over [64k, 32m] arrays: each thread holds 8 consecutive
        values of a row (warps take 16-row bands, lanes 8 rows x 4 column groups)."""
        plgpu = self.plgpu
        return plgpu.Layout.TILED(plgpu.Tiling(((ROWS, 32), (16, 32), (8, 32), (8,))),
                                  warp_dims=(-7,), lane_dims=(-3, -2), vector_dim=-1)

    def load_cols(self, ref):
        """A vector in shared memory, one value per column of a WGMMA-layout array."""
        return ref[...] if self.interpret else self.plgpu.load(ref, (), layout=self.col)

    def load_rows(self, ref):
        """A vector in shared memory, one value per row (``ROWS``) of a WGMMA-layout array."""
        return ref[...] if self.interpret else self.plgpu.load(ref, (), layout=self.row)
