"""Gated DeltaNet's causal conv and delta rule on the slot pool, routed by backend: the one
place the model's DeltaNet layers reach their kernels (as ``kernels.paged_attention`` is for
attention). The model calls ``causal_conv`` and ``gated_delta_rule``; which implementation
runs is decided here, in Python, from the backend string and the static shapes.

Both entry points take one linear layer's pool (``kvcache.state_pool``: conv [S, K-1, C],
recurrent [S, Hv, Dk, Dv]; slot 0 the padding sink) and the rows' slot ids int32[B], and
return (out, pool) with each row's state read from its slot and written back there. Rows
with ``fresh`` (their chunk starts the sequence) read zeros; padding rows point at slot 0
(garbage by contract); a slot no row names is left bit for bit.

==================  ==========================================  ==============================
backend             T == 1 (a decode step)                       T > 1 (prefill, extend)
==================  ==========================================  ==============================
reference           gather -> ``delta_rule`` -> scatter (twin)  gather -> ``delta_prefill
                                                                 .chunked(impl="xla")``
                                                                 -> scatter
pallas              ``delta_decode`` kernels, in place           gather -> impl "auto": jla's
                                                                 Hopper kernel where it takes
                                                                 the call, else XLA -> scatter
pallas_triton       ``delta_decode`` kernels, in place           impl "xla"
pallas_interpret    ``delta_decode`` in interpret mode, in       impl "xla"
                    place (CPU tests)
==================  ==========================================  ==============================

The decode kernels (``delta_decode.recurrent_step`` / ``conv_step``) alias the pool to
their output: under the engine's jit, which donates the cache, the step updates each row's
state where it lies, with no gather/scatter copy of the states and no copy of the pool.
They run where ``decode_in_place`` says so (a Pallas backend, a float32 or bfloat16 pool,
power-of-two Dk and Dv, conv channels a multiple of the kernel's block, offsets within
int32); otherwise the twin runs (the float64 check mode's pools, odd test shapes). The
prefill keeps the gather/scatter around ``delta_prefill.chunked``: its state traffic is
one read and one write per row and chunk, small against the chunk's FLOPs. ``prefill_impl``
maps the backend to ``delta_prefill``'s ``impl``; ``delta_prefill.route`` then decides "auto"
from the device, jla's import and the shapes (``pallas_triton`` and interpret mode never
take jla: it is a Mosaic GPU kernel). The Triton chunk walk (``impl="triton"``) is a
candidate, not routed to until a GPU run has measured it.

Tests: tests/kernels/test_deltanet_routing.py (routing, twin equality, untouched slots) and
tests/engine/test_qwen3_hybrid_engine.py (greedy tokens, no copy of the pool).
"""

from __future__ import annotations

import logging

import jax.numpy as jnp

from jfp8kv.kernels import delta_decode, delta_prefill, delta_rule

log = logging.getLogger(__name__)
PREFILL_IMPL = {"reference": "xla", "pallas": "auto", "pallas_triton": "xla",
                "pallas_interpret": "xla"}
PREFILL_CHUNK = 64


def _check(backend: str) -> None:
    if backend not in PREFILL_IMPL:
        raise ValueError(f"unknown backend {backend!r} for the DeltaNet layers; choose one of "
                         f"{list(PREFILL_IMPL)}")


def prefill_impl(backend: str) -> str:
    """``delta_prefill.chunked``'s ``impl`` for a chunk of T > 1 tokens on ``backend``."""
    _check(backend)
    return PREFILL_IMPL[backend]


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def decode_in_place(backend: str, pool_shape, pool_dtype, kind: str) -> str | None:
    """None when ``backend``'s one-token step of a ``kind`` ("recurrent" | "conv") pool of
    this shape and dtype runs ``delta_decode``'s in-place kernel, else why not (the twin
    runs). Static: decided at trace time."""
    _check(backend)
    if backend == "reference":
        return "the reference backend runs the twin"
    if jnp.dtype(pool_dtype).name not in delta_decode.POOL_DTYPES:
        return f"a {jnp.dtype(pool_dtype).name} pool (the kernels take {delta_decode.POOL_DTYPES})"
    if kind == "recurrent":
        _, _, dk, dv = pool_shape
        if not (_pow2(dk) and _pow2(dv)):
            return f"Dk={dk}, Dv={dv} are not powers of two"
        size = 1
        for d in pool_shape:
            size *= d
        if size >= 2**31:
            return f"a pool of {size} elements (the kernel's offsets are int32)"
        return None
    c = pool_shape[-1]
    block = min(delta_decode.DeltaDecodeTuning().block_c, c)
    if not _pow2(block) or c % block:
        return f"{c} conv channels are not a multiple of a power-of-two block"
    return None


def _in_place(backend, pool, kind) -> bool:
    why = decode_in_place(backend, pool.shape, pool.dtype, kind)
    if why is not None and backend != "reference":
        log.warning("DeltaNet %s decode step on %s runs the gather/scatter twin: %s", kind,
                    backend, why)
    return why is None


def _gather(pool, slot_ids, fresh):
    """The rows' states [B, ...], zero where ``fresh``."""
    state = pool[slot_ids]
    return jnp.where(fresh.reshape((-1,) + (1,) * (state.ndim - 1)), 0, state)


def causal_conv(pool, slot_ids, x, weight, n_valid, fresh, backend: str = "reference"):
    """``delta_rule.causal_conv`` continuing from each row's slot: pool [S, K-1, C]; slot_ids
    int32[B]; x [B, T, C]; weight [C, K]; n_valid int32[B] (the row's real tokens, the rest
    padding: its window ends before them); fresh bool[B]. Returns (silu(conv) [B, T, C] in
    x's dtype, pool). Static: backend."""
    if x.shape[1] == 1 and _in_place(backend, pool, "conv"):
        out, pool = delta_decode.conv_step(pool, slot_ids, x[:, 0], weight, n_valid, fresh,
                                           interpret=backend == "pallas_interpret")
        return out[:, None], pool
    out, state = delta_rule.causal_conv(x, _gather(pool, slot_ids, fresh), weight, n_valid)
    return out, pool.at[slot_ids].set(state.astype(pool.dtype))


def gated_delta_rule(pool, slot_ids, q, k, v, g, beta, fresh, backend: str = "reference"):
    """The gated delta rule from each row's slot: pool [S, Hv, Dk, Dv]; slot_ids int32[B];
    q, k [B, T, Hk, Dk] raw, v [B, T, Hv, Dv], g, beta [B, T, Hv] (padding tokens beta = g =
    0: the state stays as it was); fresh bool[B]. Returns (out [B, T, Hv, Dv] in v's dtype,
    pool). T == 1: the recurrent step (in place where ``decode_in_place``), T > 1: the
    chunked form through ``delta_prefill.chunked`` (``prefill_impl``). Static: backend."""
    if q.shape[1] == 1:
        if _in_place(backend, pool, "recurrent"):
            out, pool = delta_decode.recurrent_step(
                pool, slot_ids, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], fresh,
                interpret=backend == "pallas_interpret")
            return out[:, None], pool
        out, state = delta_rule.recurrent(q, k, v, g, beta, _gather(pool, slot_ids, fresh))
    else:
        out, state = delta_prefill.chunked(q, k, v, g, beta, _gather(pool, slot_ids, fresh),
                                           PREFILL_CHUNK, impl=prefill_impl(backend))
    return out, pool.at[slot_ids].set(state.astype(pool.dtype))
