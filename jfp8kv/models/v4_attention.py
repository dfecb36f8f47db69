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

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jfp8kv.config import ModelConfig
from jfp8kv.kernels.prologue import acc_dtype, rms_norm
from jfp8kv.models.v4_blocks import linear, rope, unweighted_rms_norm


class CompressorState(NamedTuple):
    """Per-sequence compressor state (batch B). ``buf_kv``/``buf_gate`` [B, r, c]: the r < m
    projected source tokens of the open window (c = 2*d with overlap, else d; gate without
    bias); ``prev_kv``/``prev_gate`` [B, m, d]: the last closed window's first half
    (gate with bias; zeros / -inf before any window closed, or None without overlap);
    ``entries`` [B, N, d]: every compressed entry emitted so far."""

    buf_kv: jax.Array
    buf_gate: jax.Array
    prev_kv: jax.Array | None
    prev_gate: jax.Array | None
    entries: jax.Array


def empty_compressor(batch: int, d: int, m: int, overlap: bool, dtype) -> CompressorState:
    """The state of a sequence with no tokens yet."""
    c = 2 * d if overlap else d
    prev_kv = jnp.zeros((batch, m, d), dtype) if overlap else None
    prev_gate = jnp.full((batch, m, d), -jnp.inf, dtype) if overlap else None
    return CompressorState(jnp.zeros((batch, 0, c), dtype), jnp.zeros((batch, 0, c), dtype),
                           prev_kv, prev_gate, jnp.zeros((batch, 0, d), dtype))


def compress(state: CompressorState, kv, gate, cp, eps: float, inv_freq):
    """Feed kv/gate [B, T, c] (projections of T new tokens) to the compressor: close every
    full window, emit its entry; returns the new state (``entries`` includes the new ones).
    ``cp``: bias [m, c] (per slot in window), norm [d]."""
    m, c = cp["bias"].shape
    d = cp["norm"].shape[0]
    overlap = c == 2 * d
    kv = jnp.concatenate([state.buf_kv, kv], 1)
    gate = jnp.concatenate([state.buf_gate, gate], 1)
    b, total = kv.shape[:2]
    n_new = total // m
    used = n_new * m
    if n_new == 0:
        return state._replace(buf_kv=kv, buf_gate=gate)
    acc = acc_dtype(kv.dtype)
    wkv = kv[:, :used].reshape(b, n_new, m, c).astype(acc)
    wgate = gate[:, :used].reshape(b, n_new, m, c).astype(acc) + cp["bias"].astype(acc)
    prev_kv, prev_gate = state.prev_kv, state.prev_gate
    if overlap:  # slots: previous window's first half, this window's second half
        pk = jnp.concatenate([prev_kv.astype(acc)[:, None], wkv[:, :-1, :, :d]], 1)
        pg = jnp.concatenate([prev_gate.astype(acc)[:, None], wgate[:, :-1, :, :d]], 1)
        slot_kv = jnp.concatenate([pk, wkv[..., d:]], 2)
        slot_gate = jnp.concatenate([pg, wgate[..., d:]], 2)
        prev_kv = wkv[:, -1, :, :d].astype(state.prev_kv.dtype)
        prev_gate = wgate[:, -1, :, :d].astype(state.prev_gate.dtype)
    else:
        slot_kv, slot_gate = wkv, wgate
    pooled = jnp.sum(slot_kv * jax.nn.softmax(slot_gate, 2), 2).astype(kv.dtype)
    pooled = rms_norm(pooled, cp["norm"], eps)
    first = state.entries.shape[1]
    pos = jnp.broadcast_to((first + jnp.arange(n_new)) * m, (b, n_new))
    new = rope(pooled, pos, inv_freq)
    return CompressorState(kv[:, used:], gate[:, used:], prev_kv, prev_gate,
                           jnp.concatenate([state.entries, new.astype(state.entries.dtype)], 1))


def visible_entries(positions, n_entries: int, m: int):
    """bool [B, T, N]: entry w is closed for the query at position t (w < (t+1) // m)."""
    return jnp.arange(n_entries)[None, None] < ((positions + 1) // m)[..., None]


def indexer_select(h, q_res, positions, entries, ip, cfg: ModelConfig, inv_freq):
    """bool [B, T, N]: the index_topk visible entries of highest lightning-indexer score
    (fewer when fewer are visible). ``entries`` [B, N, dI]: the indexer's own compressed
    keys; ``ip``: wq_b [q_lora, nI*dI], w_weights [D, nI]."""
    v4 = cfg.v4
    acc = acc_dtype(h.dtype)
    b, t = h.shape[:2]
    n = entries.shape[1]
    q = rope(linear(q_res, ip["wq_b"]).reshape(b, t, v4.index_n_heads, v4.index_head_dim),
             positions, inv_freq)
    s = jax.nn.relu(jnp.einsum("bthd,bnd->bthn", q.astype(acc), entries.astype(acc)))
    s = s * v4.index_head_dim ** -0.5
    w = jnp.einsum("btd,dh->bth", h.astype(acc), ip["w_weights"].astype(acc))
    score = jnp.einsum("bthn,bth->btn", s, w * v4.index_n_heads ** -0.5)
    vis = visible_entries(positions, n, v4.csa_ratio)
    if n == 0:
        return vis
    k = min(v4.index_topk, n)
    _, top = jax.lax.top_k(jnp.where(vis, score, -jnp.inf), k)
    chosen = jnp.any(top[..., :, None] == jnp.arange(n), -2)
    return chosen & vis


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
