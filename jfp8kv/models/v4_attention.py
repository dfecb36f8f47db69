"""DeepSeek-V4 attention as a pure jnp reference: shared-KV MQA over a sliding window plus,
per layer kind, compressed entries (CSA: 4:1 with overlapping windows, chosen per query by
the lightning indexer's top-k; HCA: 128:1, all attended), with a learnable per-head sink.

Per layer (hd = head_dim, m = compress ratio, W = sliding_window, one KV head, K = V)::

    q      = rope(unweighted_rmsnorm(wq_b(q_a_norm(wq_a h))))         [B, T, H, hd]
    kv     = rope(kv_norm(wkv h))                                     window rows, [B, T, hd]
    entry_w = rope_at(w*m)(c_norm(sum_slots softmax(gate + bias) * kv_slot))
               slots: window w's m tokens (HCA); window w-1's first half of the 2*hd
               projection and window w's second half (CSA: width 2m, stride m)
    out    = inverse_rope(softmax([q.k * hd^-0.5 over visible keys | sink_h]) @ values)

A query at position t sees window rows t-W < s <= t and entries w < (t+1) // m (only the
closed windows); in CSA layers only the index_topk entries with the highest indexer score
sum_h relu(q^I_h . k^I_w) * hd_I^-0.5 * weights_h(h) * n_I^-0.5.

The compressor's running state (``CompressorState``) is what a sequence carries between
chunks: the source tokens of the unclosed window and the overlap half of the last closed
window. Prefill, extend and decode are the same call with chunks of any length.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jfp8kv.config import ModelConfig
from jfp8kv.kernels.prologue import acc_dtype, rms_norm
from jfp8kv.models.v4_blocks import linear, rope, unweighted_rms_norm


class CompressorState(NamedTuple):
    """Per-sequence compressor state of B sequences that have seen ``pos`` tokens (the
    caller's counter): ``buf_kv``/``buf_gate`` [B, m, c]: the pos % m projected source
    tokens of the open window in the leading rows (c = 2*d with overlap, else d; gate
    without bias); ``prev_kv``/``prev_gate`` [B, m, d]: the last closed window's first half
    (gate with bias; zeros / -inf before any window closed; None without overlap);
    ``entries`` [B, capacity, d]: the pos // m compressed entries emitted so far in the
    leading rows. Fixed shapes, so one compiled step serves every decode position."""

    buf_kv: jax.Array
    buf_gate: jax.Array
    prev_kv: jax.Array | None
    prev_gate: jax.Array | None
    entries: jax.Array


def empty_compressor(batch: int, d: int, m: int, overlap: bool, capacity: int,
                     dtype) -> CompressorState:
    """The state of a sequence with no tokens yet, room for ``capacity`` entries."""
    c = 2 * d if overlap else d
    prev_kv = jnp.zeros((batch, m, d), dtype) if overlap else None
    prev_gate = jnp.full((batch, m, d), -jnp.inf, dtype) if overlap else None
    return CompressorState(jnp.zeros((batch, m, c), dtype), jnp.zeros((batch, m, c), dtype),
                           prev_kv, prev_gate, jnp.zeros((batch, capacity, d), dtype))


def _pool(wkv, wgate, prev_kv, prev_gate, d: int, overlap: bool):
    """Entries [B, K, d] (before norm / RoPE) of K consecutive windows [B, K, m, c] whose
    gates already carry the bias; with overlap each entry also pools the previous window's
    first half (``prev_*`` for window 0). Returns (pooled, first halves [B, K, m, d] x2)."""
    if not overlap:
        return jnp.sum(wkv * jax.nn.softmax(wgate, 2), 2), None, None
    pk = jnp.concatenate([prev_kv[:, None], wkv[:, :-1, :, :d]], 1)
    pg = jnp.concatenate([prev_gate[:, None], wgate[:, :-1, :, :d]], 1)
    slot_kv = jnp.concatenate([pk, wkv[..., d:]], 2)
    slot_gate = jnp.concatenate([pg, wgate[..., d:]], 2)
    return (jnp.sum(slot_kv * jax.nn.softmax(slot_gate, 2), 2), wkv[..., :d], wgate[..., :d])


def compress_rows(state: CompressorState, pos, kv, gate, cp, eps: float, inv_freq, n=None):
    """Feed the first ``n`` (default all T) of kv/gate [B, T, c] (projections of the tokens
    after the first ``pos``, a traced scalar) to the compressor; tokens t >= n are padding
    and change nothing. Returns (state with new buffers, entries untouched; the candidate
    entries [B, K, d] after norm and RoPE, before storage; their entry indices int32 [K],
    -1 where the window did not close). ``cp``: bias [m, c] (per slot in window), norm [d].
    Static shapes: the K = T // m + 1 candidate windows (an upper bound) are all pooled.
    The returned buffers hold zeros past the open window's (pos + n) % m tokens, so a
    padded chunk leaves exactly the state of the unpadded one."""
    m, c = cp["bias"].shape
    d = cp["norm"].shape[0]
    overlap = c == 2 * d
    b, t = kv.shape[:2]
    n = t if n is None else n
    real = (jnp.arange(t) < n)[None, :, None]
    kv, gate = jnp.where(real, kv, 0), jnp.where(real, gate, 0)
    acc = acc_dtype(kv.dtype)
    k_max = t // m + 1
    r = pos % m
    room = jnp.zeros((b, (k_max + 1) * m, c), acc)

    def line_up(buf, new):  # open window's rows, then the new tokens, from row 0
        out = jax.lax.dynamic_update_slice(room, buf.astype(acc), (0, 0, 0))
        return jax.lax.dynamic_update_slice(out, new.astype(acc), (0, r, 0))

    skv, sgate = line_up(state.buf_kv, kv), line_up(state.buf_gate, gate)
    closed = (r + n) // m
    wkv = skv[:, :k_max * m].reshape(b, k_max, m, c)
    wgate = sgate[:, :k_max * m].reshape(b, k_max, m, c) + cp["bias"].astype(acc)
    prev_kv, prev_gate = state.prev_kv, state.prev_gate
    pooled, first_kv, first_gate = _pool(
        wkv, wgate, None if prev_kv is None else prev_kv.astype(acc),
        None if prev_gate is None else prev_gate.astype(acc), d, overlap)
    if overlap:
        last = jnp.maximum(closed - 1, 0)
        take = functools.partial(jax.lax.dynamic_index_in_dim, index=last, axis=1,
                                 keepdims=False)
        prev_kv = jnp.where(closed > 0, take(first_kv), prev_kv.astype(acc)).astype(
            state.prev_kv.dtype)
        prev_gate = jnp.where(closed > 0, take(first_gate), prev_gate.astype(acc)).astype(
            state.prev_gate.dtype)
    first = pos // m
    pooled = rms_norm(pooled.astype(kv.dtype), cp["norm"], eps)
    idx = first + jnp.arange(k_max)
    new = rope(pooled, jnp.broadcast_to(idx * m, (b, k_max)), inv_freq)
    open_rows = (jnp.arange(m) < (r + n) % m)[None, :, None]

    def tail(buf, like):
        out = jax.lax.dynamic_slice_in_dim(buf, closed * m, m, 1)
        return jnp.where(open_rows, out, 0).astype(like.dtype)

    st = CompressorState(tail(skv, state.buf_kv), tail(sgate, state.buf_gate), prev_kv,
                         prev_gate, state.entries)
    return st, new, jnp.where(jnp.arange(k_max) < closed, idx, -1).astype(jnp.int32)


def with_entries(state: CompressorState, new, ids, store=lambda x: x) -> CompressorState:
    """``state`` with the candidate entries ``new`` [B, K, d] stored (rounded by ``store``
    as their pool holds them) at their indices ``ids`` [K] (-1: dropped)."""
    cap = state.entries.shape[1]
    rows = jnp.where(ids >= 0, ids, cap)  # out of range: dropped
    entries = state.entries.at[:, rows].set(store(new).astype(state.entries.dtype),
                                            mode="drop")
    return state._replace(entries=entries)


def compress(state: CompressorState, pos, kv, gate, cp, eps: float, inv_freq,
             store=lambda x: x, n=None):
    """``compress_rows`` then ``with_entries``: every window that closes among the first
    ``n`` tokens emits its entry, rounded by ``store`` as its pool holds it; returns the new
    state."""
    st, new, ids = compress_rows(state, pos, kv, gate, cp, eps, inv_freq, n)
    return with_entries(st, new, ids, store)


def compress_batch(state: CompressorState, pos, kv, gate, cp, eps: float, inv_freq,
                   store=lambda x: x, n=None):
    """``compress`` for B sequences at their own positions pos int32 [B], each with its own
    count of real tokens n int32 [B] (None: all T), vmapped. Returns (state, the candidate
    entries [B, K, d] before storage, their indices int32 [B, K], -1: not closed)."""
    n = jnp.full_like(pos, kv.shape[1]) if n is None else n

    def one(st, p, k, g, nb):
        st = jax.tree.map(lambda a: a[None], st)
        out, new, ids = compress_rows(st, p, k[None], g[None], cp, eps, inv_freq, nb)
        out = with_entries(out, new, ids, store)
        return jax.tree.map(lambda a: a[0], out), new[0], ids

    return jax.vmap(one)(state, pos, kv, gate, n)


def visible_entries(positions, n_entries: int, m: int):
    """bool [B, T, N]: entry w is closed for the query at position t (w < (t+1) // m)."""
    return jnp.arange(n_entries)[None, None] < ((positions + 1) // m)[..., None]


def indexer_queries(h, q_res, positions, ip, cfg: ModelConfig, inv_freq):
    """The lightning indexer's per-token queries [B, T, nI, dI] (RoPE applied) and head
    weights [B, T, nI] (its scales folded in) from h [B, T, D] and the query latent q_res.
    ``ip``: wq_b [q_lora, nI*dI], w_weights [D, nI]."""
    v4 = cfg.v4
    acc = acc_dtype(h.dtype)
    b, t = h.shape[:2]
    q = rope(linear(q_res, ip["wq_b"]).reshape(b, t, v4.index_n_heads, v4.index_head_dim),
             positions, inv_freq)
    w = jnp.einsum("btd,dh->bth", h.astype(acc), ip["w_weights"].astype(acc))
    return q, w * (v4.index_n_heads * v4.index_head_dim) ** -0.5  # relu(c x) = c relu(x)


def indexer_select(q, w, positions, entries, cfg: ModelConfig, scores=None):
    """bool [B, T, N]: for ``indexer_queries``' q / w of the queries at positions [B, T],
    the index_topk visible entries of highest lightning-indexer score (fewer when fewer are
    visible). ``entries`` [B, N, dI]: the indexer's own compressed keys. ``scores``: a
    decode (T = 1) scorer with ``kernels.v4_sparse.indexer_scores``'s contract, or None
    (jnp here). Each query's choice depends on its own row of q / w alone."""
    v4 = cfg.v4
    acc = acc_dtype(w.dtype)
    n = entries.shape[1]
    if scores is not None and q.shape[1] == 1:
        score = scores(q[:, 0], w[:, 0], entries)[:, None]
    else:
        s = jax.nn.relu(jnp.einsum("bthd,bnd->bthn", q.astype(acc), entries.astype(acc)))
        score = jnp.einsum("bthn,bth->btn", s, w)
    vis = visible_entries(positions, n, v4.csa_ratio)
    if n == 0:
        return vis
    k = min(v4.index_topk, n)
    _, top = jax.lax.top_k(jnp.where(vis, score, -jnp.inf), k)
    bi, ti = jnp.indices(top.shape[:2])  # scatter, not a [B, T, k, N] comparison
    chosen = jnp.zeros(score.shape, bool).at[bi[..., None], ti[..., None], top].set(True)
    return chosen & vis


def blocked_attention(q, positions, keys, entries, pick, per_query, sinks, window: int,
                      block: int | None = None):
    """Attention of a chunk's queries q [B, T, H, d] at positions [B, T] (row b's from
    p_b = positions[b, 0] on) over keys [B, R + T, d] (also the values: the R >= window - 1
    rows before the chunk, then the chunk's; key r at position p_b - R + r; those at
    negative positions never seen) within the sliding ``window``, and over the compressed
    ``entries`` [B, N, d] that ``pick`` marks (None: no entries).

    Queries run in blocks of ``block`` (when it divides T, else one block of T): block j's
    queries see keys j*block .. j*block + R + block - 1 (all their window can reach) and the
    entries, so the logits held at once are [B, block, H, R + block + N] whatever T is;
    a block attends what a chunk starting at its first query would (entries not closed
    yet are masked). ``pick(x)`` -> bool [B, block, N] gets ``x``: the block's slice (axis
    1) of each array of ``per_query`` ([B, T, ...]) and "positions"."""
    t = q.shape[1]
    r = keys.shape[1] - t
    blk = block if block and t > block and t % block == 0 else t
    per_query = dict(per_query, positions=positions, q=q)

    def one(j):
        x = {k: jax.lax.dynamic_slice_in_dim(a, j * blk, blk, 1) for k, a in per_query.items()}
        kb = jax.lax.dynamic_slice_in_dim(keys, j * blk, r + blk, 1)
        key_pos = x["positions"][:, :1] - r + jnp.arange(r + blk)[None]
        mask = window_mask(x["positions"], key_pos, window) & (key_pos >= 0)[:, None]
        if entries is not None:
            kb = jnp.concatenate([kb, entries.astype(kb.dtype)], 1)
            mask = jnp.concatenate([mask, pick(x)], -1)
        return attend(x["q"], kb, mask, sinks)

    if blk == t:
        return one(0)
    out = jax.lax.map(one, jnp.arange(t // blk))  # [T/blk, B, blk, H, d]
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)


def attend(q, keys, key_mask, sinks):
    """q [B, T, H, d], keys [B, S, d] (also the values), key_mask bool [B, T, S], sinks [H]
    -> [B, T, H, d]: softmax over the visible keys and one sink logit per head."""
    acc = acc_dtype(q.dtype)
    logits = jnp.einsum("bthd,bsd->bths", q.astype(acc), keys.astype(acc))
    logits = jnp.where(key_mask[:, :, None], logits * q.shape[-1] ** -0.5, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(acc)[None, None, :, None], logits.shape[:3] + (1,))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], -1), -1)[..., :-1]
    return jnp.einsum("bths,bsd->bthd", probs, keys.astype(acc)).astype(q.dtype)


def window_mask(positions, key_positions, window: int):
    """bool [B, T, S]: key s visible to query t (t - W < s <= t)."""
    diff = positions[:, :, None] - key_positions[:, None, :]
    return (diff >= 0) & (diff < window)
