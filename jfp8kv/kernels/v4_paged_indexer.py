"""DeepSeek-V4's lightning indexer reading its pool in place, and the exact top-k that turns
its scores into a CSA layer's index list (issue 57): Pallas Triton, with jnp twins.

The indexer pool ``keys`` [pages, E, dI] (bf16, E = page_size / m) is addressed as the
compressed pool: entry w of a sequence at flat id ``table[w // E] * E + w % E``
(``v4_paged_sparse``'s module docstring has the pools; its ``entry_ids`` / ``entry_cap`` /
``closed_entries`` are the helpers used here).

Contracts
---------
``paged_indexer_scores(q, w, keys, page_tables, n_entries, cap, table_rows=None,
interpret=False, key_tile=64) -> [N, cap] float32`` equals
``paged_indexer_scores_reference``: for query row i (q [N, Hi, Di], w [N, Hi], the head
weights with the scales folded in) and its sequence's page table row
page_tables[table_rows[i]] (default i), sum_h w[i, h] * relu(q[i, h] . key_e) for every
entry e < n_entries[i] (int32 [N]: the closed entries the query sees, (p+1) // m), -inf for
e >= n_entries[i]. Static ``cap`` must be >= every n_entries (entries past cap are not
scored): it bounds the output, the grid and the top-k, so the caller derives it from the
batch's real lengths (``entry_cap``), not the table width. Programs whose tile starts past
their row's count load nothing.

``topk_entries(scores, page_tables, per_page, k, table_rows=None) -> int32 [N, k]``: the
flat entry ids of the (at most) k highest-scoring entries with a finite score, -1 for the
rest. Selection is ``jax.lax.top_k``'s: among equal scores the lower entry index wins,
exactly as ``v4_attention.indexer_select`` breaks ties (it runs ``lax.top_k`` over the
visible-masked scores of every entry; the entries past a row's count score -inf in both).
The ids come in descending score order, not index order (the attention does not care).
``indexer_topk`` = ``paged_indexer_scores`` then ``topk_entries``.

``chunk_topk(q, w, keys, page_tables, positions, ratio, k, cap)`` -> int32 [B, T, k]: a
prefill chunk's index lists, every query one row of ``indexer_topk``.

Kernel: one program per (query row, ``key_tile`` entries): the tile's table entries, then
its keys (masked past the row's count, never read), scores sum_h w_h relu(q_h . k).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.kernels import v4_sparse
from jfp8kv.kernels.tiles import check_dot_tile, cols, next_pow2
from jfp8kv.kernels.v4_paged_sparse import closed_entries, entry_ids

TRITON = v4_sparse.TRITON


def _scores_kernel(nent_ref, trow_ref, pt_ref, q_ref, w_ref, k_ref, o_ref, *, n_heads,
                   key_tile, per_page):
    i, j = pl.program_id(0), pl.program_id(1)
    hp, di = q_ref.shape[1], k_ref.shape[1]
    n_ent = plgpu.load(nent_ref.at[i])
    e = j * key_tile + jnp.arange(key_tile)
    ok = e < n_ent

    @pl.when(j * key_tile < n_ent)
    def _():
        trow = plgpu.load(trow_ref.at[i])
        page = plgpu.load(pt_ref.at[trow, jnp.minimum(e // per_page, pt_ref.shape[1] - 1)],
                          mask=ok, other=0)
        rows = page * per_page + e % per_page
        keys = plgpu.load(k_ref.at[rows[:, None], cols(di)], mask=ok[:, None],
                          other=0.0).astype(jnp.float32)
        q = plgpu.load(q_ref.at[i, jnp.arange(hp)[:, None], cols(di)])
        s = jnp.maximum(plgpu.dot(q, keys, trans_b=True), 0.0)  # [Hp, key_tile]
        w = plgpu.load(w_ref.at[i, jnp.arange(hp)], mask=jnp.arange(hp) < n_heads, other=0.0)
        plgpu.store(o_ref.at[i, e], jnp.where(ok, jnp.sum(s * w[:, None], 0), -jnp.inf))

    @pl.when(j * key_tile >= n_ent)
    def _():
        plgpu.store(o_ref.at[i, e], jnp.full((key_tile,), -jnp.inf, jnp.float32))


@functools.partial(jax.jit, static_argnames=("cap", "interpret", "key_tile"))
def paged_indexer_scores(q, w, keys, page_tables, n_entries, cap: int, table_rows=None,
                         interpret: bool = False, key_tile: int = 64):
    """The Pallas kernel (module contract): indexer scores over each query row's own closed
    entries, read through its page table from the pool keys [pages, E, dI]."""
    key_tile = min(key_tile, cap)  # a small cap: one program per row
    check_dot_tile("key_tile", key_tile)
    if cap % key_tile:
        raise ValueError(f"cap={cap} must be a multiple of key_tile={key_tile}")
    nq, h, di = q.shape
    hp = next_pow2(max(h, 16))
    qp = jnp.zeros((nq, hp, di), jnp.float32).at[:, :h].set(q.astype(jnp.float32))
    trow = jnp.arange(nq, dtype=jnp.int32) if table_rows is None else table_rows
    kernel = functools.partial(_scores_kernel, n_heads=h, key_tile=key_tile,
                               per_page=keys.shape[1])
    return pl.pallas_call(kernel, grid=(nq, cap // key_tile),
                          out_shape=jax.ShapeDtypeStruct((nq, cap), jnp.float32),
                          interpret=interpret, compiler_params=TRITON)(
        n_entries.astype(jnp.int32), trow.astype(jnp.int32), page_tables.astype(jnp.int32),
        qp, w.astype(jnp.float32), keys.reshape(-1, di))


def paged_indexer_scores_reference(q, w, keys, page_tables, n_entries, cap: int,
                                   table_rows=None, **_):
    """The jnp twin: the row's entries 0 .. cap-1 gathered (``entry_ids``), scored by
    ``v4_sparse.indexer_scores_reference``, -inf past the row's count."""
    ids = entry_ids(page_tables, n_entries, keys.shape[1], cap, table_rows)
    got = keys.reshape(-1, keys.shape[-1])[jnp.maximum(ids, 0)]
    s = v4_sparse.indexer_scores_reference(q, w, got)
    return jnp.where(ids >= 0, s, -jnp.inf)


def topk_entries(scores, page_tables, per_page: int, k: int, table_rows=None):
    """int32 [N, k] (module contract): flat ids of the top-k finite scores (ties: lower
    entry index first, as ``lax.top_k`` and the reference), -1 past them."""
    cap = scores.shape[1]
    kk = min(k, cap)
    vals, w = jax.lax.top_k(scores, kk)
    pt = page_tables if table_rows is None else page_tables[table_rows]
    page = jnp.take_along_axis(pt, jnp.minimum(w // per_page, pt.shape[1] - 1), 1)
    ids = jnp.where(vals > -jnp.inf, page * per_page + w % per_page, -1).astype(jnp.int32)
    return ids if kk == k else jnp.pad(ids, ((0, 0), (0, k - kk)), constant_values=-1)


@functools.partial(jax.jit, static_argnames=("k", "cap", "interpret", "key_tile"))
def indexer_topk(q, w, keys, page_tables, n_entries, k: int, cap: int, table_rows=None,
                 interpret: bool = False, key_tile: int = 64):
    """``paged_indexer_scores`` then ``topk_entries``: a CSA layer's index list int32
    [N, k] for ``paged_sparse_decode``'s ``idx`` (flat ids into the compressed pool, which
    is addressed as the indexer pool)."""
    s = paged_indexer_scores(q, w, keys, page_tables, n_entries, cap, table_rows,
                             interpret=interpret, key_tile=key_tile)
    return topk_entries(s, page_tables, keys.shape[1], k, table_rows)


def indexer_topk_reference(q, w, keys, page_tables, n_entries, k: int, cap: int,
                           table_rows=None, **_):
    """The jnp twin of ``indexer_topk``."""
    s = paged_indexer_scores_reference(q, w, keys, page_tables, n_entries, cap, table_rows)
    return topk_entries(s, page_tables, keys.shape[1], k, table_rows)


def chunk_topk(q, w, keys, page_tables, positions, ratio: int, k: int, cap: int,
               interpret: bool = False, key_tile: int = 64):
    """A chunk's CSA index lists int32 [B, T, k] for ``paged_sparse_prefill``'s ``idx``:
    ``indexer_topk`` with every query (q [B, T, Hi, dI], w [B, T, Hi] at positions [B, T])
    one row that reads its sequence's page table row and sees its own closed entries.
    ``cap`` >= the chunk's last closed count ((p_b + T) // m, ``entry_cap``)."""
    b, t = positions.shape
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    ids = indexer_topk(q.reshape(b * t, *q.shape[2:]), w.reshape(b * t, -1), keys,
                       page_tables, closed_entries(positions.reshape(-1), ratio), k, cap, rows,
                       interpret=interpret, key_tile=key_tile)
    return ids.reshape(b, t, k)

