"""DeepSeek-V4's forward over the engine's cache (a ``kvcache.layout.Cache`` of
``v4_pools.v4_layout``'s pools, addressed as below): each row reads its dense per-sequence
state out of the pools (its slot's window ring and compressor state, its pages' compressed
and indexer entries), runs the reference layers
(``deepseek_v4.hidden_states``, the same code the reference forward runs) and writes back
what the chunk's real tokens produced, stored as the pools hold it.

The rows read back are exactly the reference's: window rows and compressed entries are
stored by ``v4_pools.store_rows`` (e4m3 + float16 per-32 scales, or bf16) and read by
``read_rows`` in the compute dtype, as the reference forward's ``storage`` rounds them; the
indexer keys are bf16 and the compressor state float32. So the engine's tokens equal the
reference forward's with ``storage`` set to the pools' dtype.

Row b's real tokens are n_new[b] = seq_lens[b] - positions[b, 0] (clipped to [0, T]):
padding rows and decode rows past their limit have none and write nothing.

Addressing (ps = page_size, m = a layer's compress ratio, ps a multiple of every m):

    compressed / indexer entry w of a sequence   page table[w*m // ps], row w % (ps/m)
    window row of position p                     slot's ring row p % W
    compressor buffers and overlap halves        the slot's rows

Page 0 and slot 0 are the padding sinks (never a sequence's); nothing is written to them
either: writes of padding tokens are dropped. A slot needs no clearing when it is handed
to a new sequence: a chunk that starts at position 0 reads a fresh compressor state, and
window rows and entries before a sequence's first write are never visible to it.
"""

from __future__ import annotations

import jax.numpy as jnp

from jfp8kv.config import ModelConfig
from jfp8kv.kvcache import v4_pools
from jfp8kv.kvcache.layout import Cache
from jfp8kv.models import deepseek_v4 as dv4
from jfp8kv.models import v4_attention as va

QUERY_BLOCK = 512  # queries per attention block of a long chunk (``forward``)


def _rows(pool, dtype):
    """(values[, scales]) gathered rows -> the compute ``dtype`` (as ``read_rows``)."""
    return v4_pools.read_rows(pool[0], pool[1] if len(pool) > 1 else None, dtype)


def _entries(pool, page_tables, dtype):
    """A paged entry pool [pages, ps/m, d] -> each row's entries [B, P*ps/m, d] (entry w at
    flat index w), read in ``dtype``."""
    b, p = page_tables.shape
    got = tuple(a[page_tables].reshape(b, -1, a.shape[-1]) for a in pool)
    return _rows(got, dtype)


def _compressor(state, off: int, slots, fresh, entries) -> va.CompressorState:
    """A row-batched ``CompressorState`` from the slot state arrays at ``off`` (4 with an
    overlap half, else 2); ``fresh`` rows (position 0) start empty."""
    buf_kv, buf_gate = (jnp.where(fresh[:, None, None], 0, state[off + j][0][slots])
                        for j in range(2))
    if buf_kv.shape[-1] == entries.shape[-1]:  # no overlap (HCA)
        return va.CompressorState(buf_kv, buf_gate, None, None, entries)
    prev_kv = jnp.where(fresh[:, None, None], 0, state[off + 2][0][slots])
    prev_gate = jnp.where(fresh[:, None, None], -jnp.inf, state[off + 3][0][slots])
    return va.CompressorState(buf_kv, buf_gate, prev_kv, prev_gate, entries)


def _spec(cache: Cache) -> v4_pools.V4PoolSpec:
    return cache.plan.layout.pool("compressed").spec


def _state_layout(cache: Cache, cfg: ModelConfig) -> list[dict]:
    kinds = tuple(cfg.v4.layer_kind(i) for i in range(cfg.num_layers))
    return v4_pools.state_layout(_spec(cache), kinds)


def read_state(cache: Cache, cfg: ModelConfig, pos, page_tables, slots, dtype) -> list:
    """Per layer, the reference's state of each row (``deepseek_v4.init_state``'s layers):
    the W-1 window rows before ``pos`` (ring order undone), compressor / indexer state."""
    w = cfg.v4.sliding_window
    ring = (pos[:, None] - (w - 1) + jnp.arange(w - 1)[None]) % w  # [B, W-1]
    fresh = pos == 0
    sdt = jnp.promote_types(dtype, jnp.float32)
    state = cache["compressor"]
    layers = []
    for i, at in enumerate(_state_layout(cache, cfg)):
        win = tuple(a[slots[:, None], ring] for a in cache["window"][i])
        ls = {"window": _rows(win, dtype)}
        if "compressed" in at:
            ent = _entries(cache["compressed"][at["compressed"]], page_tables, dtype).astype(sdt)
            ls["compressor"] = _compressor(state, at["state"], slots, fresh, ent)
        if "indexer" in at:
            ent = _entries(cache["indexer"][at["indexer"]], page_tables, dtype).astype(sdt)
            ls["indexer"] = _compressor(state, at["state"] + 4, slots, fresh, ent)
        layers.append(ls)
    return layers


def _store(x, pool_len: int, storage):
    """Rows x as a pool of ``pool_len`` arrays stores them."""
    q, s = v4_pools.store_rows(x, storage)
    return (q,) if pool_len == 1 else (q, s)


def _write_window(pool, kv, pos, n_new, slots, storage):
    """The last min(n_new, W) real rows of kv [B, T, hd] into their slots' ring rows."""
    num_slots, w = pool[0].shape[:2]
    t = jnp.arange(kv.shape[1])[None]
    real = (t < n_new[:, None]) & (t >= n_new[:, None] - w)
    slot = jnp.where(real, slots[:, None], num_slots)  # out of range: dropped
    row = (pos[:, None] + t) % w
    return tuple(a.at[slot, row].set(v.astype(a.dtype), mode="drop")
                 for a, v in zip(pool, _store(kv, len(pool), storage)))


def _write_entries(pool, new, ids, m: int, page_tables, storage):
    """Closed entries new [B, K, d] (indices ``ids`` [B, K], -1: none) into their pages."""
    num_pages, per_page = pool[0].shape[:2]
    ps = per_page * m
    col = jnp.clip(ids * m // ps, 0, page_tables.shape[1] - 1)
    page = jnp.where(ids >= 0, jnp.take_along_axis(page_tables, col, 1), num_pages)
    row = jnp.where(ids >= 0, ids % per_page, 0)
    vals = (new.astype(pool[0].dtype),) if storage is None else _store(new, len(pool), storage)
    return tuple(a.at[page, row].set(v.astype(a.dtype), mode="drop") for a, v in zip(pool, vals))


def _write_state(state, off: int, cs: va.CompressorState, slots):
    """The slot arrays at ``off`` from ``cs`` (rows with ``slots`` out of range dropped)."""
    parts = [cs.buf_kv, cs.buf_gate] + ([] if cs.prev_kv is None else [cs.prev_kv, cs.prev_gate])
    for j, x in enumerate(parts):
        a = state[off + j][0]
        state[off + j] = (a.at[slots].set(x.astype(a.dtype), mode="drop"),)


def write_back(cache: Cache, cfg: ModelConfig, layers, writes, pos, n_new, page_tables,
               slots) -> Cache:
    """The cache after a chunk: per layer its window rows, entries and compressor state."""
    spec = _spec(cache)
    storage = spec.storage_dtype
    written = jnp.where(n_new > 0, slots, cache.plan.num_slots)
    window, compressed = list(cache["window"]), list(cache["compressed"])
    indexer, state = list(cache["indexer"]), list(cache["compressor"])
    for i, at in enumerate(_state_layout(cache, cfg)):
        window[i] = _write_window(window[i], writes[i]["kv"], pos, n_new, slots, storage)
        if "compressed" in at:
            c, m = at["compressed"], spec.compressed_ratios[at["compressed"]]
            compressed[c] = _write_entries(compressed[c], *writes[i]["compressor"], m,
                                           page_tables, storage)
            _write_state(state, at["state"], layers[i]["compressor"], written)
        if "indexer" in at:
            x = at["indexer"]
            indexer[x] = _write_entries(indexer[x], *writes[i]["indexer"],
                                        spec.indexer_ratios[x], page_tables, None)
            _write_state(state, at["state"] + 4, layers[i]["indexer"], written)
    return cache.replace(window=window, compressed=compressed, indexer=indexer, compressor=state)


def forward(params, cache: Cache, tokens, positions, page_tables, seq_lens, slots, *,
            cfg: ModelConfig, backend: str, query_block: int | None = QUERY_BLOCK):
    """tokens [B, T] from positions[:, 0] on (row b's real tokens: seq_lens[b] -
    positions[b, 0]) of the sequences in state ``slots`` int32[B] with ``page_tables``
    [B, P] -> (final-normed hidden [B, T, D], cache). ``backend``: the engine's ("reference":
    jnp; a Pallas one: decode attention and indexer through ``kernels.v4_sparse`` and the
    MoE grouped by expert). The state is read once and written once per chunk and each
    layer runs once over all T tokens (the MoE reads each expert's weights once); only the
    attention of a chunk longer than ``query_block`` (a divisor of T; None: one block) runs
    in query blocks of that length, bounding its logits at [B, query_block, H, W - 1 +
    query_block + entries]."""
    pos = positions[:, 0]
    n_new = jnp.clip(seq_lens - pos, 0, tokens.shape[1]).astype(jnp.int32)
    dtype = params["embed"].dtype
    layers = read_state(cache, cfg, pos, page_tables, slots, dtype)
    ref = backend == "reference"
    h, new_layers, writes = dv4.hidden_states(
        params, layers, tokens, pos, n_new, cfg, _spec(cache).storage_dtype,
        "reference" if ref else ("pallas_interpret" if "interpret" in backend else "pallas"),
        None if ref else backend, query_block)
    return h, write_back(cache, cfg, new_layers, writes, pos, n_new, page_tables, slots)
