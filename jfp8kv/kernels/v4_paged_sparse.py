"""DeepSeek-V4 sparse attention that reads the cache pools in place (issue 57): no dense
per-row gather of window rows or compressed entries, and work that follows each row's own
length, never the page-table width. A Pallas Triton kernel, with its jnp twins (which
gather, then run ``v4_sparse``'s reference); the lightning indexer that reads its pool in
place and the exact top-k that makes CSA index lists are ``v4_paged_indexer``'s.

Pools (``kvcache.v4_pools``; E = page_size / m entries per page for a layer of ratio m)
------------------------------------------------------------------------------------
* window ring ``win`` [slots, W, D]: position p of the sequence in slot s at row [s, p % W].
* compressed ``comp`` [pages, E, D]: entry w of a sequence at [table[w // E], w % E], i.e.
  FLAT entry id ``table[w // E] * E + w % E`` of ``comp.reshape(-1, D)`` (the peers'
  ``block_id * block_size + offset``). ``entry_ids`` builds them, -1 = none.
* ``win_scale`` / ``comp_scale`` [.., D/32] float16: per-32 block scales of e4m3 rows
  (``scale_modes.BLOCK``), dequantized in the kernel (value * scale per 32 columns); None
  for bf16 / f32 rows.

Contracts
---------
``paged_sparse_decode(q, win, win_scale, slot_ids, pos, comp, comp_scale, sinks, sm_scale,
idx=None, page_tables=None, ratio=None, interpret=False, tile=16, head_block=16) -> out``
equals ``paged_sparse_decode_reference`` (same arguments):

* q [B, H, D] (any float; computed in float32) the decode queries, RoPE applied; row b's
  query is at position pos[b] (int32 [B]; -1: a padding row that sees nothing and returns
  zeros) of the sequence in slot slot_ids[b] (int32 [B]).
* window: the ring rows of positions max(0, p-W+1) .. p (min(p+1, W) rows; the pool must
  already hold the query's own row). Rows of other positions and slots are never read.
* entries, one of:
  - ``comp`` None: none (window-only layers);
  - ``idx`` int32 [B, K]: flat entry ids (-1: none; any order, repeats attend twice), a CSA
    layer's top-k (``v4_paged_indexer.indexer_topk``); K is the only entry work;
  - ``page_tables`` int32 [B, P] and static ``ratio`` m: every closed entry w < (p+1) // m,
    walked through the row's page table (an HCA layer). The walk reads cdiv(n, tile) tiles
    of table entries and rows for n = (p+1) // m: the table's width P costs nothing.
* sinks [H] float32: each head's sink logit joins the softmax and carries no value.
* out [B, H, D] float32 = sum_j p_j row_j, p = softmax([q . row_j * sm_scale | sink]).
* Static: sm_scale, ratio, interpret, tile (rows per step, power of two >= 16),
  head_block (heads per program, power of two >= 16), num_warps / num_stages (Triton's).
  Nothing is donated. D must be a power of two >= 32.

``paged_sparse_prefill(q, keys, positions, sinks, sm_scale, window, comp=None,
comp_scale=None, idx=None, page_tables=None, ratio=None, ...) -> out [B, T, H, D]``: the
same attention for a chunk's T queries per row (positions [B, T], row b's from
p_b = positions[b, 0] on, -1: padding). The window is read from ``keys`` [B, R + T, D]
(R >= window - 1: the rows of positions p_b - R .. p_b - 1, then the chunk's own; in the
compute dtype, as ``v4_attention.blocked_attention`` takes them), not the ring (a chunk
longer than W overwrites it); entries as decode, per query: ``idx`` [B, T, K] (each
query's top-k, ``v4_paged_indexer.chunk_topk``) or the page-table walk of entries
w < (t+1) // m. Every query is one row of the decode kernel, so a chunk's work is
T x (W + K or its own closed entries), and nothing is sized by the table. ``paged_sparse_prefill_reference`` is its twin.

Helpers (jnp, bounded by their static ``cap``): ``entry_ids`` (flat ids of entries
0 .. cap-1 of each row, -1 past its count), ``gather_entries`` (a workspace of those rows,
dequantized); host side: ``entry_cap`` (the static bound from real lengths).

Kernels
-------
One program per (query row, block of ``head_block`` heads): an online softmax whose running
max starts at the sink logit (so the sink adds exp(sink - m) to the denominator only) runs
over the row's window rows (contiguous flat rows start .. start + count - 1: the ring's rows
0 .. min(p+1, W)-1 of the slot, whose order does not matter to a softmax) in tiles of
``tile``, then its entries: the index list in tiles, or the page-table walk, loading the
tile's table entries and then its rows. fp8 rows are loaded as e4m3 and multiplied by their
block scale gathered per column (column c takes scale c // 32). Masked rows load as zeros
with logit -inf, so NaN in rows no query may see never reaches the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.kernels import v4_sparse
from jfp8kv.kernels.tiles import check_dot_tile, cols, next_pow2

BLOCK = v4_sparse.BLOCK


# ------------------------------------------------------------------ index lists (jnp)


def entry_ids(page_tables, n_entries, per_page: int, cap: int, table_rows=None):
    """int32 [N, cap]: the flat entry id (``page * per_page + offset``) of entry w of query
    row i's sequence (page table row ``table_rows[i]``, default i) for w < n_entries[i],
    -1 for the rest. Work and shape O(N * cap), nothing of the table's width beyond the
    columns read; ``cap`` static."""
    pt = page_tables if table_rows is None else page_tables[table_rows]
    w = jnp.arange(cap, dtype=jnp.int32)[None]
    col = jnp.minimum(w // per_page, pt.shape[1] - 1)
    page = jnp.take_along_axis(pt, jnp.broadcast_to(col, (pt.shape[0], cap)), 1)
    return jnp.where(w < n_entries[:, None], page * per_page + w % per_page, -1).astype(
        jnp.int32)


def gather_entries(values, scales, ids, dtype=jnp.float32):
    """The rows ``ids`` [..., K] (flat entry ids, -1: none) of a pool values [pages, E, D]
    (+ float16 scales [pages, E, D/32] or None) -> [..., K, D] in ``dtype``, dequantized,
    zeros where -1: a bounded workspace (its size is the index list's, never the pool's)."""
    flat = values.reshape(-1, values.shape[-1])
    safe = jnp.maximum(ids, 0)
    s = None if scales is None else scales.reshape(-1, scales.shape[-1])[safe]
    rows = v4_sparse._dequant(flat[safe], s)
    return jnp.where((ids >= 0)[..., None], rows, 0).astype(dtype)


def entry_cap(max_entries: int, minimum: int = 64) -> int:
    """Host side: the static ``cap`` for a batch whose longest row has ``max_entries``
    closed entries: the next power of two >= max(max_entries, minimum, 16), so a decode
    executable serves every batch up to it (log2(width / minimum) buckets at most)."""
    return next_pow2(max(int(max_entries), int(minimum), 16))


def closed_entries(pos, ratio: int):
    """int32: entries closed for a query at position ``pos`` (-1: none), (pos + 1) // m."""
    return jnp.maximum((pos + 1) // ratio, 0).astype(jnp.int32)


def ids_to_entries(ids, page_tables, per_page: int, table_rows=None) -> np.ndarray:
    """Host side, for tests and checks: flat ids [N, K] back to each row's entry index w
    (-1 stays -1); ValueError for an id whose page is not in the row's table."""
    ids, pt = np.asarray(ids), np.asarray(page_tables)
    pt = pt if table_rows is None else pt[np.asarray(table_rows)]
    out = np.full(ids.shape, -1, np.int64)
    for i in range(ids.shape[0]):
        where = {int(p): c for c, p in reversed(list(enumerate(pt[i])))}
        for j, e in enumerate(ids[i]):
            if e < 0:
                continue
            page, off = divmod(int(e), per_page)
            if page not in where:
                raise ValueError(f"row {i}: id {e} is on page {page}, not in its table")
            out[i, j] = where[page] * per_page + off
    return out


# ------------------------------------------------------------------ attention kernel


def _softmax_step(carry, q, rows, ok, sm_scale):
    m_i, l_i, acc = carry
    logits = jnp.where(ok[None], plgpu.dot(q, rows, trans_b=True) * sm_scale, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(logits, 1))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.exp(logits - m_new[:, None])
    return m_new, l_i * alpha + jnp.sum(p, 1), acc * alpha[:, None] + plgpu.dot(p, rows)


def _load_rows(v_ref, s_ref, rows, ok, d, scaled):
    """[tile, D] float32 rows (flat ids ``rows``; masked: zeros), dequantized."""
    x = plgpu.load(v_ref.at[rows[:, None], cols(d)], mask=ok[:, None], other=0.0)
    x = x.astype(jnp.float32)
    if scaled:
        s = plgpu.load(s_ref.at[rows[:, None], cols(d) // BLOCK], mask=ok[:, None], other=0.0)
        x = x * s.astype(jnp.float32)
    return x


def _attend_kernel(start_ref, count_ref, idx_ref, trow_ref, nent_ref, pt_ref, sink_ref, q_ref,
                   w_ref, ws_ref, c_ref, cs_ref, o_ref, *, sm_scale, d, hb, tile, win_scaled,
                   comp_scaled, entries, per_page):
    n, j = pl.program_id(0), pl.program_id(1)
    heads = j * hb + jnp.arange(hb)
    q = plgpu.load(q_ref.at[n, heads[:, None], cols(d)])  # [HB, D] f32
    carry = (plgpu.load(sink_ref.at[heads]), jnp.ones((hb,), jnp.float32),  # exp(sink-m)=1
             jnp.zeros((hb, d), jnp.float32))
    start, count = plgpu.load(start_ref.at[n]), plgpu.load(count_ref.at[n])

    def window(i, c):
        r = i * tile + jnp.arange(tile)
        ok = r < count
        rows = _load_rows(w_ref, ws_ref, start + jnp.minimum(r, count - 1), ok, d, win_scaled)
        return _softmax_step(c, q, rows, ok, sm_scale)

    carry = jax.lax.fori_loop(0, (count + tile - 1) // tile, window, carry)

    if entries == "index":
        k = idx_ref.shape[1]

        def listed(i, c):
            e = i * tile + jnp.arange(tile)
            ids = plgpu.load(idx_ref.at[n, jnp.minimum(e, k - 1)], mask=e < k, other=-1)
            ok = ids >= 0
            rows = _load_rows(c_ref, cs_ref, jnp.maximum(ids, 0), ok, d, comp_scaled)
            return _softmax_step(c, q, rows, ok, sm_scale)

        carry = jax.lax.fori_loop(0, pl.cdiv(k, tile), listed, carry)
    elif entries == "table":
        n_ent, trow = plgpu.load(nent_ref.at[n]), plgpu.load(trow_ref.at[n])
        width = pt_ref.shape[1]

        def walked(i, c):
            e = i * tile + jnp.arange(tile)
            ok = e < n_ent
            page = plgpu.load(pt_ref.at[trow, jnp.minimum(e // per_page, width - 1)], mask=ok,
                              other=0)
            rows = _load_rows(c_ref, cs_ref, page * per_page + e % per_page, ok, d,
                              comp_scaled)
            return _softmax_step(c, q, rows, ok, sm_scale)

        carry = jax.lax.fori_loop(0, (n_ent + tile - 1) // tile, walked, carry)
    _, l_i, acc = carry
    plgpu.store(o_ref.at[n, heads[:, None], cols(d)], acc / l_i[:, None])


def _attend(q, rows, row_scale, start, count, sinks, sm_scale, comp, comp_scale, idx, pt,
            trow, n_ent, per_page, interpret, tile, head_block, num_warps=4, num_stages=2):
    """The kernel over N query rows q [N, H, D]: window rows ``rows`` [R, D] flat
    (start/count int32 [N]), entries per ``idx`` [N, K] or the table walk (pt [Bt, P], trow,
    n_ent int32 [N]) of ``comp`` [C, D] flat; returns [N, H, D] float32."""
    nq, h, d = q.shape
    if d % BLOCK or d & (d - 1):
        raise ValueError(f"the V4 pool kernels need a power-of-two head_dim >= {BLOCK}, got "
                         f"{d}; use the *_reference twins")
    check_dot_tile("tile", tile)
    check_dot_tile("head_block", head_block)
    for name, a, sc in (("window", rows, row_scale), ("compressed", comp, comp_scale)):
        if a is not None and sc is None and jnp.dtype(a.dtype).itemsize == 1:
            raise ValueError(f"{name} rows of {a.dtype} need their float16 block scales")
    hp = pl.cdiv(h, head_block) * head_block
    qp = jnp.zeros((nq, hp, d), jnp.float32).at[:, :h].set(q.astype(jnp.float32))
    sp = jnp.zeros((hp,), jnp.float32).at[:h].set(sinks.astype(jnp.float32))
    entries = "none" if comp is None else ("index" if idx is not None else "table")
    one = jnp.zeros((1,), jnp.int32)
    if comp is None:
        comp, comp_scale = jnp.zeros((1, d), rows.dtype), None
    idx = jnp.full((nq, 1), -1, jnp.int32) if idx is None else idx.astype(jnp.int32)
    pt = jnp.zeros((1, 1), jnp.int32) if pt is None else pt.astype(jnp.int32)
    trow = one if trow is None else trow.astype(jnp.int32)
    n_ent = one if n_ent is None else n_ent.astype(jnp.int32)
    dummy = jnp.zeros((1, d // BLOCK), jnp.float16)
    kernel = functools.partial(
        _attend_kernel, sm_scale=sm_scale, d=d, hb=head_block, tile=tile,
        win_scaled=row_scale is not None, comp_scaled=comp_scale is not None, entries=entries,
        per_page=per_page)
    out = pl.pallas_call(kernel, grid=(nq, hp // head_block),
                         out_shape=jax.ShapeDtypeStruct((nq, hp, d), jnp.float32),
                         interpret=interpret,
                         compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                                              num_stages=num_stages))(
        start.astype(jnp.int32), count.astype(jnp.int32), idx, trow, n_ent, pt, sp, qp, rows,
        dummy if row_scale is None else row_scale, comp,
        dummy if comp_scale is None else comp_scale)
    return out[:, :h]


def _flat(a):
    return None if a is None else a.reshape(-1, a.shape[-1])


def _check_entries(comp, idx, page_tables, ratio):
    if comp is None:
        if idx is not None or page_tables is not None:
            raise ValueError("idx / page_tables name entries of a compressed pool: pass comp")
        return
    if (idx is None) == (page_tables is None):
        raise ValueError("with a compressed pool pass exactly one of idx (a CSA layer's "
                         "top-k) or page_tables and ratio (an HCA layer's closed entries)")
    if page_tables is not None and not ratio:
        raise ValueError("the page-table walk needs the layer's compress ratio (static)")


@functools.partial(jax.jit, static_argnames=("sm_scale", "ratio", "interpret", "tile",
                                             "head_block", "num_warps", "num_stages"))
def paged_sparse_decode(q, win, win_scale, slot_ids, pos, comp, comp_scale, sinks,
                        sm_scale: float, idx=None, page_tables=None, ratio: int | None = None,
                        interpret: bool = False, tile: int = 16, head_block: int = 16,
                        num_warps: int = 4, num_stages: int = 2):
    """The Pallas kernel (module contract): decode attention over the window ring and the
    compressed pool, read in place."""
    _check_entries(comp, idx, page_tables, ratio)
    b, w = q.shape[0], win.shape[1]
    pos = pos.astype(jnp.int32)
    table = page_tables is not None
    return _attend(q, _flat(win), _flat(win_scale), slot_ids.astype(jnp.int32) * w,
                   jnp.clip(pos + 1, 0, w), sinks, sm_scale, _flat(comp), _flat(comp_scale),
                   idx, page_tables, jnp.arange(b, dtype=jnp.int32) if table else None,
                   closed_entries(pos, ratio) if table else None,
                   1 if comp is None else comp.shape[1], interpret, tile, head_block,
                   num_warps, num_stages)


def paged_sparse_decode_reference(q, win, win_scale, slot_ids, pos, comp, comp_scale, sinks,
                                  sm_scale: float, idx=None, page_tables=None,
                                  ratio: int | None = None, **_):
    """The jnp twin: gathers the ring (oldest first) and the entries, then
    ``v4_sparse.sparse_decode_reference``."""
    _check_entries(comp, idx, page_tables, ratio)
    b, w, d = q.shape[0], win.shape[1], q.shape[-1]
    pos = pos.astype(jnp.int32)
    ring = (pos[:, None] - w + 1 + jnp.arange(w)[None]) % w
    wv = win[slot_ids[:, None], ring]
    ws = None if win_scale is None else win_scale[slot_ids[:, None], ring]
    if comp is None:
        cv, cs, ids = jnp.zeros((1, d), jnp.float32), None, jnp.full((b, 1), -1, jnp.int32)
    else:
        cv, cs = _flat(comp), _flat(comp_scale)
        ids = idx if idx is not None else entry_ids(
            page_tables, closed_entries(pos, ratio), comp.shape[1],
            page_tables.shape[1] * comp.shape[1])
    return v4_sparse.sparse_decode_reference(q.astype(jnp.float32), wv, ws,
                                             jnp.clip(pos + 1, 0, w), cv, cs, ids,
                                             sinks.astype(jnp.float32), sm_scale)


# ------------------------------------------------------------------ prefill (chunk) path


def _chunk_window(keys, positions, window: int):
    """Per query of a chunk: (flat start, count) of its visible rows in keys [B, R + T, D]
    flattened (row r of row b at position p_b - R + r)."""
    b, t = positions.shape
    s = keys.shape[1]
    r = s - t
    p = positions.astype(jnp.int32)
    tq = jnp.arange(t, dtype=jnp.int32)[None]
    last = r + tq  # the query's own row
    first = jnp.maximum(last - (window - 1), r - p[:, :1])  # window start, position >= 0
    count = jnp.where(p >= 0, last - first + 1, 0)
    start = jnp.arange(b, dtype=jnp.int32)[:, None] * s + first
    return start.reshape(-1), jnp.maximum(count, 0).reshape(-1)


@functools.partial(jax.jit, static_argnames=("sm_scale", "window", "ratio", "interpret",
                                             "tile", "head_block", "num_warps", "num_stages"))
def paged_sparse_prefill(q, keys, positions, sinks, sm_scale: float, window: int, comp=None,
                         comp_scale=None, idx=None, page_tables=None,
                         ratio: int | None = None, interpret: bool = False, tile: int = 16,
                         head_block: int = 16, num_warps: int = 4, num_stages: int = 2):
    """The Pallas kernel for a chunk (module contract): q [B, T, H, D] -> [B, T, H, D]
    float32, each query one row of the decode kernel."""
    _check_entries(comp, idx, page_tables, ratio)
    b, t, h, d = q.shape
    if keys.shape[1] - t < window - 1:
        raise ValueError(f"keys hold {keys.shape[1] - t} rows before the chunk; the window "
                         f"needs {window - 1}")
    start, count = _chunk_window(keys, positions, window)
    table = page_tables is not None
    pos = positions.reshape(-1).astype(jnp.int32)
    out = _attend(q.reshape(b * t, h, d), keys.reshape(-1, d), None, start, count, sinks,
                  sm_scale, _flat(comp), _flat(comp_scale),
                  None if idx is None else idx.reshape(b * t, -1), page_tables,
                  jnp.repeat(jnp.arange(b, dtype=jnp.int32), t) if table else None,
                  closed_entries(pos, ratio) if table else None,
                  1 if comp is None else comp.shape[1], interpret, tile, head_block,
                  num_warps, num_stages)
    return out.reshape(b, t, h, d)


def paged_sparse_prefill_reference(q, keys, positions, sinks, sm_scale: float, window: int,
                                   comp=None, comp_scale=None, idx=None, page_tables=None,
                                   ratio: int | None = None, **_):
    """The jnp twin: per query, its window rows (oldest first) and entries gathered, then
    ``v4_sparse.sparse_decode_reference``."""
    _check_entries(comp, idx, page_tables, ratio)
    b, t, h, d = q.shape
    r = keys.shape[1] - t
    p = positions.astype(jnp.int32)
    last = r + jnp.arange(t)[None]  # [1, T]
    rows = last[..., None] - (window - 1) + jnp.arange(window)  # [1, T, W]
    wv = keys[jnp.arange(b)[:, None, None], jnp.clip(rows, 0, keys.shape[1] - 1)]
    win_len = jnp.where(p >= 0, jnp.minimum(p + 1, window), 0)  # positions >= 0 only
    flat_pos = p.reshape(-1)
    if comp is None:
        cv, cs, ids = jnp.zeros((1, d), jnp.float32), None, jnp.full((b * t, 1), -1, jnp.int32)
    else:
        cv, cs = _flat(comp), _flat(comp_scale)
        ids = idx.reshape(b * t, -1) if idx is not None else entry_ids(
            page_tables, closed_entries(flat_pos, ratio), comp.shape[1],
            page_tables.shape[1] * comp.shape[1], jnp.repeat(jnp.arange(b), t))
    out = v4_sparse.sparse_decode_reference(
        q.reshape(b * t, h, d).astype(jnp.float32), wv.reshape(b * t, window, d), None,
        win_len.reshape(-1), cv, cs, ids, sinks.astype(jnp.float32), sm_scale)
    return out.reshape(b, t, h, d)
