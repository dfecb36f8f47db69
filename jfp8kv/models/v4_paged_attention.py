"""DeepSeek-V4's attention over the engine's pools, read in place (issue 57): what
``v4_paged.forward`` calls per layer once the layer's window rows and closed entries are
stored. The Pallas backends run ``kernels.v4_paged_sparse`` / ``v4_paged_indexer``; the
"reference" backend runs jnp twins that gather only bounded blocks. Nothing here is sized
by the page table's width (``max_model_len``): work and memory follow each row's own
length, or the batch's longest row, in blocks of a fixed number of entries.

Pools as ``kernels.v4_paged_sparse`` addresses them: the window ring [slots, W, hd], a
compressed pool [pages, E, hd] (E = page_size / m), its float16 per-32 scales or None, the
indexer pool [pages, E, dI] bf16; flat entry id ``page * E + offset``, -1 = none.

Contracts
---------
``csa_index(iq, iw, keys, page_tables, n_entries, k, block, backend="reference")
-> int32 [R, G, k]``: for G queries per sequence (a decode step: G = 1; a chunk: its T
queries) of R sequences (q [R, G, nI, dI], head weights [R, G, nI], sequence r's table
``page_tables[r]``), the flat ids of each query's k highest lightning-indexer scores among
its closed entries w < n_entries[r, g], -1 past the visible ones; equal to
``v4_paged_indexer.indexer_topk_reference`` with any cap >= max(n_entries) (the same set;
ties: the lower entry index, as ``v4_attention.indexer_select``). No static cap: the scores
of ``block`` entries at a time (``block_size``) are merged into a running top-k
(``lax.top_k`` over the k kept then the block's, in entry order, so ties still go to the
lower index) by a device loop of cdiv(max(n_entries), block) trips. Memory: [R, G,
k + block] scores (the jnp twin also gathers the block's keys once per sequence,
[R, block, dI], and sums the heads one at a time); work: every query's entries up to the
longest's.

``decode(q, win, win_scale, slots, pos, sinks, sm_scale, *, comp=None, comp_scale=None,
idx=None, page_tables=None, ratio=None, block, backend) -> [B, H, hd] float32``:
``paged_sparse_decode``'s contract (pos -1: a padding row, zeros); the "reference" twin
reads the slot's W ring rows, the index list's entries or (HCA) the row's closed entries
``block`` at a time, in an online softmax (``attend_reference``).

``chunk(q, keys, positions, start, sinks, sm_scale, window, *, comp=None, comp_scale=None,
idx=None, page_tables=None, ratio=None, block, backend, query_block=None)
-> [B, T, H, hd] float32``: ``paged_sparse_prefill``'s contract (keys [B, R + T, hd]: the
R >= W - 1 rows before the chunk, then its own; positions [B, T], -1: padding queries;
``start`` [B] row b's first position); the "reference" twin runs ``attend_reference`` in
blocks of ``query_block`` queries (when it divides T).

``attend_reference``: the jnp attention of a chunk over its window keys, then its index
list's entries or its closed entries walked ``block`` at a time; masked rows are zeroed
before any product, so NaN in rows no query may see never reaches the output.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jfp8kv.kernels import v4_paged_indexer as vpi
from jfp8kv.kernels import v4_paged_sparse as vps
from jfp8kv.kernels import v4_sparse
from jfp8kv.models import v4_attention as va

# Entries per block of the CSA top-k loop and the jnp HCA walk (8,192 tokens at m = 4): the
# loop's trips per step against the columns each trip sorts; not tuned on a GPU yet.
INDEX_BLOCK = 2048


def block_size(per_page: int, want: int) -> int:
    """Entries per block for pools of ``per_page`` entries per page: whole pages, a
    multiple of 16 (the indexer kernel's smallest key tile), at least ``want``."""
    step = per_page * 16 // math.gcd(per_page, 16)
    return max(step, -(-want // step) * step)


def _block_table(page_tables, j, pages: int):
    """Columns j * pages .. (j + 1) * pages - 1 of page_tables [R, P], those past P clamped
    to the last (their entries lie past every row's count, so they are never read)."""
    col = jnp.minimum(j * pages + jnp.arange(pages), page_tables.shape[1] - 1)
    return jnp.take(page_tables, col, axis=1)


def _interpret(backend: str) -> bool:
    return backend == "pallas_interpret"


def _kernel_scores(backend: str, block: int):
    """scores(iq, iw, keys, pt, n, ids) -> [R, G, block]: ``paged_indexer_scores`` with
    every query one row reading its sequence's table row."""
    def scores(iq, iw, keys, pt, n, ids):
        r, g = n.shape
        rows = None if g == 1 else jnp.repeat(jnp.arange(r, dtype=jnp.int32), g)
        s = vpi.paged_indexer_scores(iq.reshape(r * g, *iq.shape[2:]), iw.reshape(r * g, -1),
                                     keys, pt, n.reshape(-1), block, rows,
                                     interpret=_interpret(backend),
                                     key_tile=math.gcd(block, 64))
        return s.reshape(r, g, block)
    return scores


def _twin_scores(iq, iw, keys, pt, n, ids):
    """The jnp twin of ``_kernel_scores``: the block's keys gathered once per sequence
    (ids [R, block], -1: none), sum_h w_h relu(q_h . k) one head at a time, -inf at each
    query's entries past its count."""
    got = keys.reshape(-1, keys.shape[-1])[jnp.maximum(ids, 0)].astype(jnp.float32)
    got = jnp.where((ids >= 0)[..., None], got, 0.0)  # [R, block, dI]
    q, w = iq.astype(jnp.float32), iw.astype(jnp.float32)

    def head(h, acc):
        qh = jax.lax.dynamic_index_in_dim(q, h, 2, keepdims=False)  # [R, G, dI]
        wh = jax.lax.dynamic_index_in_dim(w, h, 2, keepdims=False)  # [R, G]
        return acc + wh[..., None] * jax.nn.relu(jnp.einsum("rgd,rkd->rgk", qh, got))

    s = jax.lax.fori_loop(0, q.shape[2], head,
                          jnp.zeros(n.shape + ids.shape[-1:], jnp.float32))
    return jnp.where(jnp.arange(ids.shape[-1]) < n[..., None], s, -jnp.inf)


def csa_index(iq, iw, keys, page_tables, n_entries, k: int, block: int,
              backend: str = "reference"):
    """A CSA layer's index lists (module contract)."""
    per_page = keys.shape[1]
    block = block_size(per_page, block)
    pages = block // per_page
    n = n_entries.astype(jnp.int32)  # [R, G]
    scorer = _twin_scores if backend == "reference" else _kernel_scores(backend, block)

    def step(j, carry):
        vals, ids = carry
        pt = _block_table(page_tables, j, pages)
        nj = jnp.clip(n - j * block, 0, block)
        got = vps.entry_ids(pt, jnp.max(nj, 1), per_page, block)  # [R, block]
        scores = scorer(iq, iw, keys, pt, nj, got).astype(jnp.float32)
        got = jnp.where(jnp.arange(block) < nj[..., None], got[:, None], -1)
        vals, at = jax.lax.top_k(jnp.concatenate([vals, scores], -1), k)
        return vals, jnp.take_along_axis(jnp.concatenate([ids, got], -1), at, -1)

    init = (jnp.full(n.shape + (k,), -jnp.inf, jnp.float32), jnp.full(n.shape + (k,), -1,
                                                                      jnp.int32))
    vals, ids = jax.lax.fori_loop(0, (jnp.max(n) + block - 1) // block, step, init)
    return jnp.where(vals > -jnp.inf, ids, -1)


def _update(state, logits, ok, weigh):
    """One online-softmax step: ``state`` (running max [..., H], sum, weighted rows
    [..., H, D]), logits [..., H, S] masked by ``ok``; weigh(p) -> [..., H, D]."""
    m, l, acc = state
    logits = jnp.where(ok, logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, -1))  # m starts at the sink: finite
    p = jnp.exp(logits - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + jnp.sum(p, -1), acc * alpha[..., None] + weigh(p)


def _walk_reference(state, q, positions, comp, comp_scale, page_tables, ratio: int,
                    block: int, sm_scale: float):
    """The HCA entries of each query (w < (t+1) // m) into ``state``, ``block`` entries of
    the row's table at a time, shared by the row's queries, up to the longest row's."""
    per_page = comp.shape[1]
    block = block_size(per_page, block)
    pages = block // per_page
    n_q = vps.closed_entries(positions, ratio)  # [B, T]
    n_row = jnp.max(n_q, 1)

    def step(j, st):
        pt = _block_table(page_tables, j, pages)
        ids = vps.entry_ids(pt, jnp.clip(n_row - j * block, 0, block), per_page, block)
        rows = vps.gather_entries(comp, comp_scale, ids)  # [B, block, D], zeros past n
        w = j * block + jnp.arange(block)
        ok = ((w[None, None] < n_q[..., None]) & (ids >= 0)[:, None])[:, :, None]
        logits = jnp.einsum("bthd,bkd->bthk", q, rows) * sm_scale
        return _update(st, logits, ok, lambda p: jnp.einsum("bthk,bkd->bthd", p, rows))

    return jax.lax.fori_loop(0, (jnp.max(n_row) + block - 1) // block, step, state)


def attend_reference(q, keys, positions, start, sinks, sm_scale: float, window: int,
                     comp=None, comp_scale=None, idx=None, page_tables=None,
                     ratio: int | None = None, block: int = INDEX_BLOCK):
    """The jnp attention of q [B, T, H, D] at positions [B, T] (-1: padding) over keys
    [B, R + T, D] (key r at position start[b] - R + r) within ``window``, and over the
    entries of ``idx`` [B, T, K] or (``page_tables``, ``ratio``) the closed entries ->
    [B, T, H, D] float32 (module contract)."""
    b, t, h, d = q.shape
    r = keys.shape[1] - t
    qf = q.astype(jnp.float32)
    key_pos = start[:, None] - r + jnp.arange(r + t)[None]  # [B, S]
    see = ((positions >= 0)[..., None] & va.window_mask(positions, key_pos, window)
           & (key_pos >= 0)[:, None])  # [B, T, S]
    kf = jnp.where(jnp.any(see, 1)[..., None], keys.astype(jnp.float32), 0.0)  # seen rows
    state = (jnp.broadcast_to(sinks.astype(jnp.float32), (b, t, h)),
             jnp.ones((b, t, h), jnp.float32), jnp.zeros((b, t, h, d), jnp.float32))
    state = _update(state, jnp.einsum("bthd,bsd->bths", qf, kf) * sm_scale, see[:, :, None],
                    lambda p: jnp.einsum("bths,bsd->bthd", p, kf))
    if idx is not None:
        rows = vps.gather_entries(comp, comp_scale, idx)  # [B, T, K, D], zeros where -1
        state = _update(state, jnp.einsum("bthd,btkd->bthk", qf, rows) * sm_scale,
                        (idx >= 0)[:, :, None], lambda p: jnp.einsum("bthk,btkd->bthd", p, rows))
    elif page_tables is not None:
        state = _walk_reference(state, qf, positions, comp, comp_scale, page_tables, ratio,
                                block, sm_scale)
    _, l, acc = state
    return acc / l[..., None]


def _ring(win, win_scale, slots, pos):
    """The W ring rows of positions pos - W + 1 .. pos of each row's slot, float32."""
    w = win.shape[1]
    ring = (pos[:, None] - w + 1 + jnp.arange(w)[None]) % w
    s = None if win_scale is None else win_scale[slots[:, None], ring]
    return v4_sparse._dequant(win[slots[:, None], ring], s)


def decode(q, win, win_scale, slots, pos, sinks, sm_scale: float, *, comp=None,
           comp_scale=None, idx=None, page_tables=None, ratio: int | None = None,
           block: int = INDEX_BLOCK, backend: str = "reference"):
    """A decode step's attention (module contract) -> [B, H, hd] float32."""
    if backend != "reference":
        return vps.paged_sparse_decode(q, win, win_scale, slots, pos, comp, comp_scale, sinks,
                                       sm_scale, idx=idx, page_tables=page_tables,
                                       ratio=ratio, interpret=_interpret(backend))
    keys = _ring(win, win_scale, slots, pos)
    out = attend_reference(q[:, None], keys, pos[:, None], pos, sinks, sm_scale,
                           win.shape[1], comp, comp_scale,
                           None if idx is None else idx[:, None], page_tables, ratio, block)
    return out[:, 0]


def chunk(q, keys, positions, start, sinks, sm_scale: float, window: int, *, comp=None,
          comp_scale=None, idx=None, page_tables=None, ratio: int | None = None,
          block: int = INDEX_BLOCK, backend: str = "reference", query_block: int | None = None):
    """A chunk's attention (module contract) -> [B, T, H, hd] float32."""
    if backend != "reference":
        return vps.paged_sparse_prefill(q, keys, positions, sinks, sm_scale, window, comp,
                                        comp_scale, idx=idx, page_tables=page_tables,
                                        ratio=ratio, interpret=_interpret(backend))
    t = q.shape[1]
    r = keys.shape[1] - t
    blk = query_block if query_block and t > query_block and t % query_block == 0 else t

    def one(j):
        def cut(a):
            return jax.lax.dynamic_slice_in_dim(a, j * blk, blk, 1)

        return attend_reference(cut(q), jax.lax.dynamic_slice_in_dim(keys, j * blk, r + blk, 1),
                                cut(positions), start + j * blk, sinks, sm_scale, window,
                                comp, comp_scale, None if idx is None else cut(idx),
                                page_tables, ratio, block)

    if blk == t:
        return one(0)
    out = jax.lax.map(one, jnp.arange(t // blk))  # [T/blk, B, blk, H, D]
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)
