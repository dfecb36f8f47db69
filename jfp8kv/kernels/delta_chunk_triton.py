"""A candidate chunked DeltaNet prefill: XLA's chunk-parallel factors, then one Pallas Triton
kernel for the walk over the chunks (sm_89 and sm_90). Not a default: a row of
``bench.deltanet`` (``prefill-triton``) beside XLA and jla, so that the GPU run says whether
the serial part is what makes ``delta_rule.chunked`` slow, and what an Ada path could reach.

``delta_rule.chunked`` is two parts: ``delta_rule.chunk_factors`` (every chunk at once: the
normalized q/k, the cumulative decays G, the unit lower-triangular solves giving u_v, u_k),
then a ``lax.scan`` over the chunks carrying the state, a few small einsums per chunk for
all rows and heads (one XLA loop iteration each). Here the factors are the same XLA code;
the scan is one kernel, one program per (row, value head, ``block_v`` state columns) that
keeps its [Dk, block_v] state tile in registers across the chunks and per chunk of C tokens
computes (the twin's step, same order)::

    u     = u_v - u_k S                            [C, bv]
    attn  = (q k^T) * exp(G_t - G_s) (s <= t)      [C, C]
    o     = (q * exp(G)) S + attn u                [C, bv]
    S     = exp(G_C) S + (k * exp(G_C - G))^T u    [Dk, bv]

``precision``: "ieee" (float32 products; interpret mode equals the twin to float32
rounding), "tf32" (what XLA's float32 einsums run at on the GPU), "bf16" (operands rounded
to bfloat16, float32 accumulation: the tensor cores' fast path). Tests:
tests/kernels/test_delta_chunk_triton.py.
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

PRECISIONS = ("ieee", "tf32", "bf16")


@dataclasses.dataclass(frozen=True)
class ChunkTuning(Launch):
    """``block_v`` state columns per program (a power of two >= 16, cut to Dv); ``precision``
    of the kernel's products (see the module docstring). Not measured yet."""

    block_v: int = 32
    precision: str = "tf32"
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of {list(PRECISIONS)}")


def _dot(a, b, contract, precision: str):
    """a . b contracting dims ``contract`` (lhs, rhs), float32 result."""
    if precision == "bf16":
        a, b, prec = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None
    else:
        prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               precision=prec, preferred_element_type=jnp.float32)


def _walk_kernel(q_ref, k_ref, cum_ref, uv_ref, uk_ref, s0_ref, o_ref, s_ref, *, chunk, block_v,
                 num_chunks, precision):
    # q/k/uk [B, H, Tp, Dk]; cum [B, H, Tp]; uv [B, H, Tp, Dv]; s0 [B, H, Dk, Dv];
    # o [B, Tp, H, Dv] (the user layout); s (final) [B, H, Dk, Dv]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    t_idx = jnp.arange(chunk, dtype=jnp.int32)
    causal = t_idx[:, None] >= t_idx[None, :]

    def body(n, s):
        rows = pl.ds(n * chunk, chunk)
        q = q_ref[b, h, rows, :].astype(jnp.float32)
        k = k_ref[b, h, rows, :].astype(jnp.float32)
        cum = cum_ref[b, h, rows].astype(jnp.float32)
        g_end = cum_ref[b, h, n * chunk + chunk - 1].astype(jnp.float32)
        u = uv_ref[b, h, rows, cols].astype(jnp.float32) - _dot(
            uk_ref[b, h, rows, :].astype(jnp.float32), s, (1, 0), precision)
        decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))
        attn = _dot(q, k, (1, 1), precision) * decay
        o = (_dot(q * jnp.exp(cum)[:, None], s, (1, 0), precision)
             + _dot(attn, u, (1, 0), precision))
        o_ref[b, rows, h, cols] = o.astype(o_ref.dtype)
        k_dec = k * jnp.exp(g_end - cum)[:, None]
        return s * jnp.exp(g_end) + _dot(k_dec, u, (0, 0), precision)

    s = s0_ref[b, h, :, cols].astype(jnp.float32)
    s = jax.lax.fori_loop(0, num_chunks, body, s)
    s_ref[b, h, :, cols] = s.astype(s_ref.dtype)


def chunked(q, k, v, g, beta, state, chunk: int = 64, *, interpret: bool = False,
            tuning: ChunkTuning | None = None):
    """``delta_rule.chunked``'s contract (q, k [B, T, Hk, Dk] raw, v [B, T, Hv, Dv], g, beta
    [B, T, Hv], state [B, Hv, Dk, Dv] -> (out [B, T, Hv, Dv] in v's dtype, final state in the
    accumulation dtype, float32 for 16-bit or float32 inputs)). Dk, Dv, chunk powers of two
    >= 16. Static: chunk, interpret, tuning. Nothing is donated."""
    tuning = tuning or ChunkTuning()
    b, t, _, dk = q.shape
    hv, dv = v.shape[2:]
    for name, x in (("Dk", dk), ("Dv", dv), ("chunk", chunk), ("block_v", tuning.block_v)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {x}")
    if jnp.dtype(delta_rule._acc(v.dtype)) != jnp.float32:
        raise ValueError(f"{v.dtype} inputs: the kernel computes in float32 (float64 is the "
                         "twin's)")
    qn, kn, cum, _, u_v, u_k = delta_rule.chunk_factors(q, k, v, g, beta, chunk)
    n = cum.shape[2]
    flat = lambda x: x.reshape(b, hv, n * chunk, *x.shape[4:])  # noqa: E731
    bv = min(tuning.block_v, dv)
    kernel = functools.partial(_walk_kernel, chunk=chunk, block_v=bv, num_chunks=n,
                               precision=tuning.precision)
    out, final = pl.pallas_call(
        kernel, grid=(b, hv, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((b, n * chunk, hv, dv), v.dtype),
                   jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32)),
        interpret=interpret, name="jfp8kv_delta_chunk_walk",
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
    )(flat(qn), flat(kn), cum.reshape(b, hv, n * chunk), flat(u_v), flat(u_k),
      state.astype(jnp.float32))
    return out[:, :t], final
