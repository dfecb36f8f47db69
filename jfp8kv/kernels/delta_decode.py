"""Gated DeltaNet's decode step in place on the slot pool (Pallas Triton backend).

The engine keeps each running sequence's DeltaNet state in one slot of a pool
(``kvcache.state_pool``: recurrent [num_slots, Hv, Dk, Dv], conv [num_slots, K-1, C], slot 0
the padding sink). The XLA step gathers the batch's states out of the pool, runs
``delta_rule.recurrent`` and scatters them back: two extra copies of every state per step
(docs/qwen3-hybrid.md measured 3.2x the step itself at B 128). The kernels here read each
row's state from its slot and write it back where it was (``input_output_aliases``: with the
pool donated by the caller's jit, XLA updates it in place, no copy of the pool or of the
states).

``recurrent_step`` -- one token of the gated delta rule, ``delta_rule.recurrent``'s
convention exactly: q and k raw (the kernel L2-normalizes them in float32 with eps 1e-6, q
also times Dk**-0.5), decay exp(g) with g <= 0, arithmetic in float32, the state stored back
in the pool's dtype. One program per (row, value head, block of ``block_v`` value columns):
it loads the [Dk, block_v] tile of its slot's state, decays it, forms the correction
u = beta (v - S^T k), adds k u^T, writes o = S^T q and the tile. The columns of a value head
are independent in the delta rule (S^T k and S^T q reduce over Dk only), so the tiles need no
communication. Grouped heads: value head h reads q/k head h // (Hv // Hk), as
``delta_rule`` repeats them.

``conv_step`` -- one token of the causal depthwise conv with SiLU (``delta_rule.causal_conv``
at T = 1): program (row, block of channels) reads its slot's K-1 previous inputs, writes
silu(conv) and the shifted window (unchanged when the row's ``n_valid`` is 0).

Rows: ``slot_ids`` int32[B] in any order; a padding row points at slot 0 (the sink), so it
reads and writes only slot 0 (several padding rows race on it: its contents are garbage by
contract). No other slot is read or written: a slot no row names is untouched bit for bit.
Two real rows must not share a slot. Offsets are int32: a pool of fewer than 2**31 elements
(1,000 slots at 35B-A3B's 32 x 128 x 128 take 5.2e8). ``fresh`` bool[B] (optional): the row
starts its sequence, its state is read as zeros (the model's ``fresh``), whatever its slot
holds.

Twins: ``recurrent_step_reference`` / ``conv_step_reference``: gather -> ``delta_rule`` ->
scatter, the XLA path the engine runs today. Tests: tests/kernels/test_delta_decode.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.kernels import delta_rule
from jfp8kv.kernels.tiles import Launch

POOL_DTYPES = ("float32", "bfloat16")
EPS = 1e-6  # delta_rule.l2norm's


@dataclasses.dataclass(frozen=True)
class DeltaDecodeTuning(Launch):
    """``block_v``: value columns per program of ``recurrent_step`` (a power of two; cut to
    Dv); ``block_c``: channels per program of ``conv_step``. Not measured yet: the GPU run of
    ``bench.deltanet`` times block_v 32/64/128 side by side."""

    block_v: int = 64
    block_c: int = 256
    num_stages: int = 1


def _check_pool(pool, what: str) -> None:
    if jnp.dtype(pool.dtype).name not in POOL_DTYPES:
        raise ValueError(f"{what} pool dtype {pool.dtype} is not supported; choose one of "
                         f"{list(POOL_DTYPES)}")


def _pow2(name: str, n: int) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{name} must be a power of two, got {n}")


def _fresh(fresh, b: int):
    if fresh is None:
        return jnp.zeros((b,), jnp.int32)
    return fresh.astype(jnp.int32)


def _recurrent_kernel(slot_ref, fresh_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref,
                      o_ref, pool_out_ref, *, group, block_v, scale):
    # slot_ref/fresh_ref [B] i32; q_ref/k_ref [B, Hk, Dk]; v_ref [B, Hv, Dv]; g_ref/beta_ref
    # [B, Hv] f32; pool_ref (aliased to pool_out_ref) [S, Hv, Dk, Dv]; o_ref [B, Hv, Dv]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ref[b]
    hk = h // group
    cols = pl.ds(j * block_v, block_v)
    q = q_ref[b, hk, :].astype(jnp.float32)
    k = k_ref[b, hk, :].astype(jnp.float32)
    q = q * (jax.lax.rsqrt(jnp.sum(q * q) + EPS) * scale)
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + EPS)
    v = v_ref[b, h, cols].astype(jnp.float32)
    g = g_ref[b, h]
    beta = beta_ref[b, h]
    s = pool_ref[slot, h, :, cols].astype(jnp.float32)  # [Dk, block_v]
    s = jnp.where(fresh_ref[b] != 0, 0.0, s)
    s = s * jnp.exp(g)
    u = beta * (v - jnp.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * u[None, :]
    o_ref[b, h, cols] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)
    pool_out_ref[slot, h, :, cols] = s.astype(pool_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def recurrent_step(pool, slot_ids, q, k, v, g, beta, fresh=None, *, interpret: bool = False,
                   tuning: DeltaDecodeTuning | None = None):
    """One gated-delta-rule token per row, its state read from and written back to its slot.

    pool [S, Hv, Dk, Dv] float32 or bfloat16, aliased to the returned pool; slot_ids int32[B]
    (padding rows: 0); q, k [B, Hk, Dk] raw (normalized here, as ``delta_rule.recurrent``
    does), v [B, Hv, Dv], g, beta [B, Hv] (any float dtype; padding tokens beta = g = 0);
    fresh bool[B] or None: read the row's state as zeros.
    Hk divides Hv; Dk, Dv powers of two. Returns (out [B, Hv, Dv] in v's dtype, pool).
    Static: interpret, tuning. Nothing is donated here: a caller whose jit donates the pool
    (the engine's step, ``bench.deltanet``'s loop) gets it updated in place; otherwise XLA
    copies it once before the kernel.
    """
    tuning = tuning or DeltaDecodeTuning()
    _check_pool(pool, "recurrent state")
    n_slots, hv, dk, dv = pool.shape
    b, hk, _ = q.shape
    if k.shape != q.shape or v.shape != (b, hv, dv) or q.shape[-1] != dk or hv % hk:
        raise ValueError(f"shapes q {q.shape}, k {k.shape}, v {v.shape} do not fit the pool "
                         f"{pool.shape} (q/k [B, Hk, Dk], v [B, Hv, Dv], Hk dividing Hv)")
    if g.shape != (b, hv) or beta.shape != (b, hv):
        raise ValueError(f"g {g.shape} and beta {beta.shape} must be [B, Hv] = {(b, hv)}")
    _pow2("Dk", dk), _pow2("Dv", dv), _pow2("block_v", tuning.block_v)
    if pool.size >= 2**31:
        raise ValueError(f"pool of {pool.size} elements: the kernel's offsets are int32")
    bv = min(tuning.block_v, dv)
    kernel = functools.partial(_recurrent_kernel, group=hv // hk, block_v=bv,
                               scale=float(dk) ** -0.5)
    out, pool = pl.pallas_call(
        kernel, grid=(b, hv, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((b, hv, dv), v.dtype),
                   jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        input_output_aliases={7: 1}, interpret=interpret, name="jfp8kv_delta_decode",
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
    )(slot_ids.astype(jnp.int32), _fresh(fresh, b), q, k, v, g.astype(jnp.float32),
      beta.astype(jnp.float32), pool)
    return out, pool


def recurrent_step_reference(pool, slot_ids, q, k, v, g, beta, fresh=None):
    """The twin of ``recurrent_step``: gather the rows' states, one ``delta_rule.recurrent``
    step, scatter them back (the engine's XLA path). Same arguments and return; nothing is
    donated here."""
    state = pool[slot_ids]
    if fresh is not None:
        state = jnp.where(fresh[:, None, None, None], 0, state)
    out, state = delta_rule.recurrent(q[:, None], k[:, None], v[:, None], g[:, None],
                                      beta[:, None], state)
    return out[:, 0], pool.at[slot_ids].set(state.astype(pool.dtype))


def _conv_kernel(slot_ref, fresh_ref, nv_ref, x_ref, w_ref, pool_ref, o_ref, pool_out_ref, *,
                 block_c, width):
    # slot/fresh/nv [B] i32; x_ref [B, C]; w_ref [C, K]; pool_ref (aliased) [S, K-1, C]
    b, j = pl.program_id(0), pl.program_id(1)
    slot = slot_ref[b]
    c = pl.ds(j * block_c, block_c)
    fresh = fresh_ref[b] != 0
    ext = [jnp.where(fresh, 0.0, pool_ref[slot, i, c].astype(jnp.float32))
           for i in range(width - 1)]
    ext.append(x_ref[b, c].astype(jnp.float32))
    acc = ext[0] * w_ref[c, 0].astype(jnp.float32)
    for i in range(1, width):
        acc = acc + ext[i] * w_ref[c, i].astype(jnp.float32)
    o_ref[b, c] = (acc * jax.nn.sigmoid(acc)).astype(o_ref.dtype)
    shift = nv_ref[b] > 0
    for i in range(width - 1):
        pool_out_ref[slot, i, c] = jnp.where(shift, ext[i + 1], ext[i]).astype(
            pool_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def conv_step(pool, slot_ids, x, weight, n_valid, fresh=None, *, interpret: bool = False,
              tuning: DeltaDecodeTuning | None = None):
    """One token of the causal conv with SiLU per row, its window read from and written back
    to its slot.

    pool [S, K-1, C] float32 or bfloat16, aliased to the returned pool; slot_ids int32[B]
    (padding rows: 0); x [B, C]; weight [C, K] (``delta_rule.causal_conv``'s); n_valid
    int32[B]: 1 for a real token, 0 for a padding one (its window stays as it was); fresh
    bool[B] or None: the row's previous inputs read as zeros. Returns (silu(conv) [B, C] in
    x's dtype, pool). Static: interpret, tuning. Nothing is donated (as ``recurrent_step``).
    """
    tuning = tuning or DeltaDecodeTuning()
    _check_pool(pool, "conv state")
    _, km1, c = pool.shape
    b = x.shape[0]
    if x.shape != (b, c) or weight.shape != (c, km1 + 1) or n_valid.shape != (b,):
        raise ValueError(f"x {x.shape}, weight {weight.shape}, n_valid {n_valid.shape} do not "
                         f"fit the conv pool {pool.shape}")
    bc = min(tuning.block_c, c)
    _pow2("block_c", bc)
    if c % bc:
        raise ValueError(f"conv channels {c} must be a multiple of block_c {bc}")
    kernel = functools.partial(_conv_kernel, block_c=bc, width=km1 + 1)
    out, pool = pl.pallas_call(
        kernel, grid=(b, c // bc),
        out_shape=(jax.ShapeDtypeStruct((b, c), x.dtype),
                   jax.ShapeDtypeStruct(pool.shape, pool.dtype)),
        input_output_aliases={5: 1}, interpret=interpret, name="jfp8kv_delta_conv_step",
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
    )(slot_ids.astype(jnp.int32), _fresh(fresh, b), n_valid.astype(jnp.int32), x, weight, pool)
    return out, pool


def conv_step_reference(pool, slot_ids, x, weight, n_valid, fresh=None):
    """The twin of ``conv_step``: gather, ``delta_rule.causal_conv`` over one token, scatter.
    Same arguments and return; nothing is donated here."""
    state = pool[slot_ids]
    if fresh is not None:
        state = jnp.where(fresh[:, None, None], 0, state)
    out, state = delta_rule.causal_conv(x[:, None], state, weight, n_valid)
    return out[:, 0], pool.at[slot_ids].set(state)
