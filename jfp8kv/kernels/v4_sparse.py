"""DeepSeek-V4 decode kernels on the Pallas Triton backend, each with its jnp twin: sparse
attention over a sequence's window rows plus its top-k compressed entries (with the per-head
sink), and the lightning indexer's scores.

Contract
--------
``sparse_decode(q, win, win_scale, win_len, comp, comp_scale, idx, sinks, sm_scale,
interpret=False) -> out`` equals ``sparse_decode_reference`` (same arguments):

* q [B, H, D] float32 decode queries (one per sequence, RoPE applied).
* win [B, W, D]: the sequence's window rows (the pool's ring, oldest first); the last
  win_len[b] rows are visible, the rest are never read (NaN there must not matter).
* comp [N, D]: the compressed pool's rows, flat; idx int32 [B, K]: the entries the query
  attends (-1: none; a CSA layer's indexer top-k, an HCA layer's closed entries).
* win_scale / comp_scale [.., D/32] float16: fp8 rows' per-32 block scales
  (``scale_modes.BLOCK``), dequantized in the kernel as value * scale per 32-column block;
  None for bf16 / f32 rows.
* sinks [H] float32: each head's sink logit joins the softmax and carries no value.
* out [B, H, D] float32 = sum_j p_j row_j, p = softmax([q.row_j * sm_scale | sink]).
* Static: sm_scale, interpret, tile. Nothing is donated. D must be a power of two >= 32.

``indexer_scores(q, w, keys, interpret=False) -> [B, N]`` equals
``indexer_scores_reference``: sum_h w[b, h] * relu(q[b, h] . keys[b, n]) for q [B, Hi, Di],
w [B, Hi] (the head weights, scales folded in) and the indexer keys [B, N, Di] (bf16 pool);
the caller masks unclosed entries and takes the top-k (``jax.lax.top_k``). Static:
interpret, key_tile.

Kernel
------
One program per (sequence, block of 16 heads). The source rows (window rows, then the
indexed entries) are walked in tiles of ``tile`` rows with an online softmax whose running
max starts at the sink logit (so the sink's weight is exp(sink - m) in the denominator and
nothing in the sum). A tile row is loaded at full width from its one source, the other
source masked to zeros; fp8 rows are multiplied by their block scale gathered per column
(column c takes scale c // 32), exact as the twin. Masked rows load as zeros and their
logits are -inf, so poisoned rows never reach the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.kernels.tiles import cols, next_pow2

# Triton on every jax (0.10's CUDA lowering would otherwise pick Mosaic GPU for these kernels).
TRITON = plgpu.CompilerParams(num_warps=4, num_stages=2)

BLOCK = 32
HEAD_BLOCK = 16  # heads per program (Triton dot rows)


def _dequant(rows, scale):
    x = rows.astype(jnp.float32)
    if scale is None:
        return x
    s = scale.astype(jnp.float32)
    return (x.reshape(x.shape[:-1] + (s.shape[-1], BLOCK)) * s[..., None]).reshape(x.shape)


def sparse_decode_reference(q, win, win_scale, win_len, comp, comp_scale, idx, sinks,
                            sm_scale: float):
    """The jnp twin (see module contract)."""
    wv = _dequant(win, win_scale)
    w_ok = jnp.arange(win.shape[1])[None] >= win.shape[1] - win_len[:, None]  # [B, W]
    safe = jnp.maximum(idx, 0)
    cv = _dequant(comp[safe], None if comp_scale is None else comp_scale[safe])  # [B, K, D]
    rows = jnp.concatenate([wv, cv], 1)
    ok = jnp.concatenate([w_ok, idx >= 0], 1)
    rows = jnp.where(ok[..., None], rows, 0.0)
    logits = jnp.where(ok[:, None], jnp.einsum("bhd,bsd->bhs", q, rows) * sm_scale, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None], logits.shape[:2] + (1,))
    p = jax.nn.softmax(jnp.concatenate([logits, sink], -1), -1)[..., :-1]
    return jnp.einsum("bhs,bsd->bhd", p, rows)


def _decode_kernel(len_ref, idx_ref, sink_ref, q_ref, w_ref, ws_ref, c_ref, cs_ref, o_ref, *,
                   sm_scale, n_win, n_idx, d, scaled, tile):
    b, hb = pl.program_id(0), pl.program_id(1)
    heads = hb * HEAD_BLOCK + jnp.arange(HEAD_BLOCK)
    q = plgpu.load(q_ref.at[b, heads[:, None], cols(d)])  # [HB, D]
    sink = plgpu.load(sink_ref.at[heads])
    lo = n_win - plgpu.load(len_ref.at[b])
    col_scale = cols(d) // BLOCK

    def body(i, carry):
        m_i, l_i, acc = carry
        r = i * tile + jnp.arange(tile)  # source rows: window rows, then indexed entries
        w_ok = (r >= lo) & (r < n_win)
        e = jnp.clip(r - n_win, 0, n_idx - 1)
        ids = plgpu.load(idx_ref.at[b, e], mask=(r >= n_win) & (r < n_win + n_idx), other=-1)
        c_ok = ids >= 0
        wr, cr = jnp.clip(r, 0, n_win - 1), jnp.maximum(ids, 0)
        wv = plgpu.load(w_ref.at[b, wr[:, None], cols(d)], mask=w_ok[:, None], other=0.0)
        cv = plgpu.load(c_ref.at[cr[:, None], cols(d)], mask=c_ok[:, None], other=0.0)
        wv, cv = wv.astype(jnp.float32), cv.astype(jnp.float32)
        if scaled:
            wv = wv * plgpu.load(ws_ref.at[b, wr[:, None], col_scale], mask=w_ok[:, None],
                                 other=0.0).astype(jnp.float32)
            cv = cv * plgpu.load(cs_ref.at[cr[:, None], col_scale], mask=c_ok[:, None],
                                 other=0.0).astype(jnp.float32)
        rows = wv + cv  # each row comes from one source, the other loaded as zeros
        ok = w_ok | c_ok
        logits = jnp.where(ok[None], plgpu.dot(q, rows, trans_b=True) * sm_scale, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(logits, 1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(logits - m_new[:, None])
        return m_new, l_i * alpha + jnp.sum(p, 1), acc * alpha[:, None] + plgpu.dot(p, rows)

    n_tiles = pl.cdiv(n_win + n_idx, tile)
    init = (sink, jnp.ones((HEAD_BLOCK,), jnp.float32),  # the sink: exp(sink - m) = 1
            jnp.zeros((HEAD_BLOCK, d), jnp.float32))
    _, l_i, acc = jax.lax.fori_loop(0, n_tiles, body, init)
    plgpu.store(o_ref.at[b, heads[:, None], cols(d)], acc / l_i[:, None])


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "tile"))
def sparse_decode(q, win, win_scale, win_len, comp, comp_scale, idx, sinks, sm_scale: float,
                  interpret: bool = False, tile: int = 16):
    """The Pallas kernel (see module contract); ``tile``: source rows per step (static)."""
    b, h, d = q.shape
    if d % BLOCK or d & (d - 1):
        raise ValueError(f"sparse_decode needs a power-of-two head_dim >= {BLOCK}, got {d}; "
                         "use sparse_decode_reference")
    hp = pl.cdiv(h, HEAD_BLOCK) * HEAD_BLOCK
    qp = jnp.zeros((b, hp, d), jnp.float32).at[:, :h].set(q.astype(jnp.float32))
    sp = jnp.zeros((hp,), jnp.float32).at[:h].set(sinks.astype(jnp.float32))
    scaled = win_scale is not None
    ws = win_scale if scaled else jnp.zeros((1, 1, 1), jnp.float16)
    cs = comp_scale if scaled else jnp.zeros((1, 1), jnp.float16)
    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, n_win=win.shape[1],
                               n_idx=idx.shape[1], d=d, scaled=scaled, tile=tile)
    out = pl.pallas_call(kernel, grid=(b, hp // HEAD_BLOCK),
                         out_shape=jax.ShapeDtypeStruct((b, hp, d), jnp.float32),
                         interpret=interpret, compiler_params=TRITON)(
        win_len.astype(jnp.int32), idx.astype(jnp.int32), sp, qp, win, ws, comp, cs)
    return out[:, :h]


def indexer_scores_reference(q, w, keys):
    """The jnp twin (see module contract)."""
    s = jax.nn.relu(jnp.einsum("bhd,bnd->bhn", q.astype(jnp.float32),
                               keys.astype(jnp.float32)))
    return jnp.einsum("bhn,bh->bn", s, w.astype(jnp.float32))


def _scores_kernel(q_ref, w_ref, k_ref, o_ref, *, n_heads, n_keys, key_tile):
    b, j = pl.program_id(0), pl.program_id(1)
    hp = q_ref.shape[1]
    rows = j * key_tile + jnp.arange(key_tile)
    keys = plgpu.load(k_ref.at[b, rows[:, None], cols(k_ref.shape[2])],
                      mask=(rows < n_keys)[:, None], other=0).astype(jnp.float32)
    s = jnp.maximum(plgpu.dot(q_ref[b], keys, trans_b=True), 0.0)  # [Hp, key_tile]
    w = plgpu.load(w_ref.at[b, jnp.arange(hp)], mask=jnp.arange(hp) < n_heads, other=0.0)
    plgpu.store(o_ref.at[b, rows], jnp.sum(s * w[:, None], 0), mask=rows < n_keys)


@functools.partial(jax.jit, static_argnames=("interpret", "key_tile"))
def indexer_scores(q, w, keys, interpret: bool = False, key_tile: int = 64):
    """The Pallas kernel (see module contract); one program per (sequence, ``key_tile``
    keys)."""
    b, h, d = q.shape
    hp = next_pow2(max(h, 16))
    qp = jnp.zeros((b, hp, d), jnp.float32).at[:, :h].set(q.astype(jnp.float32))
    n = keys.shape[1]
    kernel = functools.partial(_scores_kernel, n_heads=h, n_keys=n, key_tile=key_tile)
    return pl.pallas_call(kernel, grid=(b, pl.cdiv(n, key_tile)),
                          out_shape=jax.ShapeDtypeStruct((b, n), jnp.float32),
                          interpret=interpret, compiler_params=TRITON)(qp, w.astype(jnp.float32), keys)
