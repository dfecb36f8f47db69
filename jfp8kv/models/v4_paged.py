"""DeepSeek-V4's forward over the engine's cache (a ``kvcache.cache_tree.Cache`` of
``v4_pools.v4_layout``'s pools, addressed as below), reading the pools in place (issue 57).
The reference layers run (``deepseek_v4.hidden_states``, the code the reference forward
runs) with one attention per layer of this module's: its projections and compressors run
over the chunk, then what the chunk's real tokens produced is stored first (window rows,
closed compressed and indexer entries, stored as the pools hold them; compressor state),
then the queries attend through ``v4_paged_attention``, which reads the window ring, the
compressed pool and the indexer pool where they are: no per-row dense gather of a row's
pages, nothing sized by the page table's width.

What is read per layer and row: its slot's compressor state (float32, m rows); for a chunk
of T > 1 tokens the W - 1 ring rows before it (the chunk overwrites the ring, so its early
queries read their window from ``keys``: those rows dequantized, then the chunk's own as
the pool rounds them); everything else in place (window ring for decode; CSA: the indexer
keys of every closed entry, scored a block at a time into an exact top-k, then those k
entries; HCA: the row's closed entries through its page table).

The rows attended are exactly the reference's: window rows and compressed entries are
stored by ``v4_pools.store_rows`` (e4m3 + float16 per-32 scales, or bf16) and dequantized
on read (in the kernel, or by the jnp twins), as the reference forward's ``storage`` rounds
them; the indexer keys are bf16 and the compressor state float32. So the engine's tokens
equal the reference forward's with ``storage`` set to the pools' dtype, to float32
rounding (the sums run in another order).

Row b's real tokens are n_new[b] = seq_lens[b] - positions[b, 0] (clipped to [0, T]):
padding rows and decode rows past their limit have none, write nothing and attend nothing
(their queries get position -1); padding tokens of a real row attend nothing either.

Addressing (ps = page_size, m = a layer's compress ratio, ps a multiple of every m):

    compressed / indexer entry w of a sequence   page table[w*m // ps], row w % (ps/m)
    window row of position p                     slot's ring row p % W
    compressor buffers and overlap halves        the slot's rows

Page 0 and slot 0 are the padding sinks (never a sequence's); nothing is written to them
either: writes of padding tokens are dropped. A slot needs no clearing when it is handed
to a new sequence: a chunk that starts at position 0 reads a fresh compressor state, and
window rows and entries before a sequence's first write are never read for it.
"""

from __future__ import annotations

import jax.numpy as jnp

from jfp8kv.config import ModelConfig
from jfp8kv.kvcache import v4_pools
from jfp8kv.kvcache.cache_tree import Cache
from jfp8kv.kernels import v4_paged_sparse as vps
from jfp8kv.models import deepseek_v4 as dv4
from jfp8kv.models import v4_attention as va
from jfp8kv.models import v4_paged_attention as v4pa
from jfp8kv.models.layers import ONE_DEVICE

QUERY_BLOCK = 512  # queries per attention block of a long chunk, reference (``forward``)


def _rows(pool, dtype):
    """(values[, scales]) gathered rows -> the compute ``dtype`` (as ``read_rows``)."""
    return v4_pools.read_rows(pool[0], pool[1] if len(pool) > 1 else None, dtype)


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


class _Step:
    """One forward's pools, read and written layer by layer (lists of the cache's arrays,
    replaced as the layers store into them while the forward is traced)."""

    def __init__(self, cache: Cache, cfg: ModelConfig, pos, n_new, page_tables, slots, dtype,
                 backend: str, query_block, index_block: int, par):
        self.cache0, self.cfg, self.spec, self.par = cache, cfg, _spec(cache), par
        self.at = _state_layout(cache, cfg)
        self.pos, self.page_tables, self.slots = pos, page_tables, slots
        self.dtype, self.backend = dtype, backend
        self.query_block, self.index_block = query_block, index_block
        self.written = jnp.where(n_new > 0, slots, cache.plan.num_slots)  # else dropped
        self.window, self.compressed = list(cache["window"]), list(cache["compressed"])
        self.indexer, self.state = list(cache["indexer"]), list(cache["compressor"])

    def cache(self) -> Cache:
        return self.cache0.replace(window=self.window, compressed=self.compressed,
                                   indexer=self.indexer, compressor=self.state)

    def layer(self, i: int, h, lp, _state, positions, n_new, kind: str, inv):
        """``deepseek_v4.hidden_states``' attention of layer i: store, then attend."""
        cfg, storage = self.cfg, self.spec.storage_dtype
        q_res, q, kv, freqs = dv4.project(h, lp, positions, cfg, kind, inv)
        t = h.shape[1]
        keys = None if t == 1 else self._chunk_keys(i, kv)  # before the ring is written
        self.window[i] = _write_window(self.window[i], kv, self.pos, n_new, self.slots,
                                       storage)
        per_query = {} if kind == "window" else self._compress(i, h, q_res, lp, positions,
                                                               n_new, kind, freqs)
        qpos = jnp.where(jnp.arange(t)[None] < n_new[:, None], positions, -1)
        out = self._attend(i, q, keys, qpos, lp["sinks"], kind, per_query)
        return dv4.output(out.astype(q.dtype), lp, positions, freqs, cfg), None, None

    def _chunk_keys(self, i: int, kv):
        """keys [B, W - 1 + T, hd] in the compute dtype: the W - 1 ring rows before the
        chunk (dequantized), then the chunk's rows as the window pool rounds them."""
        w = self.cfg.v4.sliding_window
        ring = (self.pos[:, None] - (w - 1) + jnp.arange(w - 1)[None]) % w
        old = _rows(tuple(a[self.slots[:, None], ring] for a in self.window[i]), self.dtype)
        new = v4_pools.read_rows(*v4_pools.store_rows(kv, self.spec.storage_dtype), self.dtype)
        return jnp.concatenate([old, new], 1)

    def _compress(self, i: int, h, q_res, lp, positions, n_new, kind: str, freqs) -> dict:
        """The layer's compressors over the chunk from its slot's state: closed entries
        stored in the pools, the state written back; returns the indexer's per-query
        arrays (CSA: "iq", "iw")."""
        at, spec, cfg = self.at[i], self.spec, self.cfg
        fresh = self.pos == 0
        sdt = jnp.promote_types(self.dtype, jnp.float32)
        ls = {"compressor": _compressor(self.state, at["state"], self.slots, fresh,
                                        jnp.zeros((h.shape[0], 0, cfg.head_dim), sdt))}
        if kind == "csa":
            ls["indexer"] = _compressor(self.state, at["state"] + 4, self.slots, fresh,
                                        jnp.zeros((h.shape[0], 0, cfg.v4.index_head_dim), sdt))
        states, writes, _, per_query, _ = dv4.compressors(
            h, q_res, lp, ls, positions, n_new, cfg, kind, freqs, spec.storage_dtype)
        c = at["compressed"]
        self.compressed[c] = _write_entries(self.compressed[c], *writes["compressor"],
                                            spec.compressed_ratios[c], self.page_tables,
                                            spec.storage_dtype)
        _write_state(self.state, at["state"], states["compressor"], self.written)
        if kind == "csa":
            x = at["indexer"]
            self.indexer[x] = _write_entries(self.indexer[x], *writes["indexer"],
                                             spec.indexer_ratios[x], self.page_tables, None)
            _write_state(self.state, at["state"] + 4, states["indexer"], self.written)
        return per_query

    def _attend(self, i: int, q, keys, qpos, sinks, kind: str, per_query: dict):
        """The layer's attention from the pools: decode (keys None) reads the ring in
        place, a chunk its ``keys``; entries: none, the CSA index lists or the HCA walk.
        Per query head (``par.split``: q and sinks split, the pools whole)."""
        at, cfg = self.at[i], self.cfg
        static = dict(block=self.index_block, backend=self.backend)
        rows: dict = {}
        if kind != "window":
            c = at["compressed"]
            m = self.spec.compressed_ratios[c]
            pool = self.compressed[c]
            rows.update(comp=pool[0], comp_scale=pool[1] if len(pool) > 1 else None)
            if kind == "hca":
                rows["page_tables"] = self.page_tables
                static["ratio"] = m
            else:
                rows["idx"] = self._csa_index(at["indexer"], per_query, qpos, m)
        sm = cfg.head_dim ** -0.5
        if keys is None:
            win = self.window[i]
            ring = (win[0], win[1] if len(win) > 1 else None, self.slots, qpos[:, 0])

            def decode(q, sinks, ring, rows):
                win, win_scale, slots, pos = ring
                return v4pa.decode(q, win, win_scale, slots, pos, sinks, sm, **rows, **static)

            return self.par.split(decode, (1, 0, None, None), 1)(q[:, 0], sinks, ring,
                                                                 rows)[:, None]

        def chunk(q, sinks, keys, qpos, start, rows):
            return v4pa.chunk(q, keys, qpos, start, sinks, sm, cfg.v4.sliding_window,
                              query_block=self.query_block, **rows, **static)

        return self.par.split(chunk, (2, 0, None, None, None, None), 2)(
            q, sinks, keys, qpos, self.pos, rows)

    def _csa_index(self, x: int, per_query: dict, qpos, m: int):
        """Each query's top-k flat entry ids: [B, k] for decode, [B, T, k] for a chunk
        (the indexer's heads are not split: every device computes the same lists)."""
        def index(iq, iw, keys, page_tables, n):
            return v4pa.csa_index(iq, iw, keys, page_tables, n, self.cfg.v4.index_topk,
                                  self.index_block, self.backend)

        ids = self.par.split(index, (None,) * 5, None)(
            per_query["iq"], per_query["iw"], self.indexer[x][0], self.page_tables,
            vps.closed_entries(qpos, m))
        return ids[:, 0] if qpos.shape[1] == 1 else ids


def forward(params, cache: Cache, tokens, positions, page_tables, seq_lens, slots, *,
            cfg: ModelConfig, backend: str, query_block: int | None = QUERY_BLOCK,
            index_block: int = v4pa.INDEX_BLOCK, par=None):
    """tokens [B, T] from positions[:, 0] on (row b's real tokens: seq_lens[b] -
    positions[b, 0]) of the sequences in state ``slots`` int32[B] with ``page_tables``
    [B, P] -> (final-normed hidden [B, T, D], cache). ``backend``: the engine's
    ("reference": the jnp twins; a Pallas one: ``kernels.v4_paged_sparse`` /
    ``v4_paged_indexer`` reading the pools in place, "pallas_interpret" in interpret mode,
    and the MoE grouped by expert). Each layer runs once over all T tokens (the MoE reads
    each expert's weights once per chunk); the reference attention of a chunk longer than
    ``query_block`` (a divisor of T; None: one block) runs in query blocks of that length.
    ``index_block``: entries per block of the CSA top-k and the jnp HCA walk
    (``v4_paged_attention.block_size``); memory per block, never per table width.
    ``par``: the per-device hooks (``layers.OneDevice``): the attention kernels run per
    query head, the MoE per slice of its experts (``models/sharding.py``)."""
    par = par or ONE_DEVICE
    pos = positions[:, 0]
    n_new = jnp.clip(seq_lens - pos, 0, tokens.shape[1]).astype(jnp.int32)
    dtype = params["embed"].dtype
    step = _Step(cache, cfg, pos, n_new, page_tables, slots, dtype, backend, query_block,
                 index_block, par)
    ref = backend == "reference"
    h, _, _ = dv4.hidden_states(params, [None] * cfg.num_layers, tokens, pos, n_new, cfg,
                                step.spec.storage_dtype, backend, None if ref else backend,
                                query_block, attention=step.layer, mlp=par.mlp)
    return h, step.cache()
