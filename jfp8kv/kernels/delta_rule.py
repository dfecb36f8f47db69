"""The gated delta rule (Gated DeltaNet's token mixer) and its causal conv, in jnp.

Per value head, with state S [k_dim, v_dim] and for each token t (q, k L2-normalized, q
also times k_dim**-0.5; decay g_t <= 0 in log space; beta_t in (0, 1))::

    S   <- exp(g_t) * S
    u_t  = beta_t * (v_t - S^T k_t)          # the delta rule's correction
    S   <- S + k_t u_t^T
    o_t  = S^T q_t

``recurrent`` runs it token by token (the decode step). ``chunked`` gives the same result
in chunks of C tokens (the prefill form): inside a chunk, with cumulative decays
G_t = g_1 + ... + g_t and the chunk's start state S0, the corrections solve the unit lower
triangular system (I + L) u = beta * (v - exp(G) * (K S0)), L[t, s] = beta_t exp(G_t - G_s)
k_t.k_s for s < t; then o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) u_s,
and the chunk's end state is exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T. Every exponent
is of a non-positive number, so nothing overflows. Arithmetic is in float32 (float64 for
float64 inputs); the state is carried in that dtype.

Shapes: q, k [B, T, Hk, Dk] (Hk divides Hv: each q/k head serves Hv/Hk consecutive value
heads), v [B, T, Hv, Dv], g and beta [B, T, Hv], state [B, Hv, Dk, Dv]. Tokens that must
not touch the state (padding) carry beta = 0 and g = 0. These are the twins a GPU kernel
is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _acc(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum x^2 + eps) over the last axis (transformers' and FLA's convention)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta):
    """Heads expanded to Hv, head-major [B, H, T, D], in the accumulation dtype; q and k
    normalized and q scaled."""
    acc = _acc(v.dtype)
    rep = v.shape[2] // k.shape[2]
    q, k = (jnp.repeat(x.astype(acc), rep, axis=2) for x in (q, k))
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    q, k, v = (jnp.swapaxes(x.astype(acc), 1, 2) for x in (q, k, v))
    g, beta = (jnp.swapaxes(x.astype(acc), 1, 2) for x in (g, beta))
    return q, k, v, g, beta


def recurrent(q, k, v, g, beta, state):
    """Token-by-token gated delta rule. Returns (out [B, T, Hv, Dv] in v's dtype, final
    state [B, Hv, Dk, Dv] in the accumulation dtype)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)

    def step(s, xs):
        qt, kt, vt, gt, bt = xs  # [B, H, D] / [B, H]
        s = s * jnp.exp(gt)[..., None, None]
        u = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", s, kt))
        s = s + kt[..., :, None] * u[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, qt)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state.astype(q.dtype), xs)
    return jnp.swapaxes(jnp.moveaxis(out, 0, 2), 1, 2).astype(out_dtype), state


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same as ``recurrent`` in chunks of ``chunk`` tokens (T is padded up to a
    multiple with beta = g = 0 tokens, which leave the state alone). Static: chunk."""
    out_dtype = v.dtype
    t = q.shape[1]
    q, k, cum, decay, u_v, u_k = chunk_factors(q, k, v, g, beta, chunk)
    b, h, n, _, dv = u_v.shape
    attn = jnp.einsum("...td,...sd->...ts", q, k) * decay  # includes s == t
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    end_decay = jnp.exp(cum[..., -1])

    def step(s, xs):  # s [B, H, Dk, Dv]; one chunk of every row
        u_v, u_k, attn, q_dec, k_dec, end_decay = xs
        u = u_v - jnp.einsum("bhtk,bhkv->bhtv", u_k, s)
        o = jnp.einsum("bhtk,bhkv->bhtv", q_dec, s) + jnp.einsum("bhts,bhsv->bhtv", attn, u)
        s = s * end_decay[..., None, None] + jnp.einsum("bhtk,bhtv->bhkv", k_dec, u)
        return s, o

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u_v, u_k, attn, q_dec, k_dec, end_decay))
    state, out = jax.lax.scan(step, state.astype(q.dtype), xs)  # out [n, B, H, C, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.swapaxes(out, 1, 2).astype(out_dtype), state


def chunk_factors(q, k, v, g, beta, chunk: int = 64):
    """The chunk-parallel part of ``chunked`` (everything before its scan over chunks), also
    the input of ``delta_chunk_triton``'s kernel. Returns, head-major with T padded to N
    chunks of ``chunk`` tokens, in the accumulation dtype: q (normalized, times Dk**-0.5) and
    k (normalized) [B, H, N, C, Dk], the chunk-local cumulative decays G [B, H, N, C], the
    masked decay exp(G_t - G_s) (s <= t, else 0) [B, H, N, C, C], and the corrections'
    parts u_v [B, H, N, C, Dv], u_k [B, H, N, C, Dk] (u = u_v - u_k S0)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, chunk) for x in (g, beta))
    cum = jnp.cumsum(g, axis=-1)  # G_t
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    # exp(G_t - G_s) for s <= t, 0 above the diagonal (masked before exp: no overflow)
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    kk = jnp.einsum("...td,...sd->...ts", k, k)
    lower = jnp.where(jnp.tril(causal, -1), beta[..., :, None] * kk * decay, 0.0)
    system = lower + jnp.eye(chunk, dtype=k.dtype)
    solve = jax.vmap(_unit_lower_solve)
    flat = (-1, chunk, chunk)
    rhs_v = (beta[..., None] * v).reshape(-1, chunk, dv)
    rhs_k = (beta[..., None] * jnp.exp(cum)[..., None] * k).reshape(-1, chunk, dk)
    u_v = solve(system.reshape(flat), rhs_v).reshape(b, h, n, chunk, dv)
    u_k = solve(system.reshape(flat), rhs_k).reshape(b, h, n, chunk, dk)
    return q, k, cum, decay, u_v, u_k


def _unit_lower_solve(a, rhs):
    """x with a x = rhs, a [C, C] unit lower triangular, rhs [C, D]. The triangular solve,
    except when tracing for a CPU backend: there forward substitution in a loop, because
    jaxlib's LAPACK solve splits a batch over the thread pool its callers run on, and two
    at once can wait on each other forever (seen under pytest-xdist on 2 cores, 2026-12-06).
    Decided in Python, so a GPU's program is exactly the solve it always was."""
    if jax.default_backend() != "cpu":
        return jax.scipy.linalg.solve_triangular(a, rhs, lower=True, unit_diagonal=True)
    # row i once rows < i are known (the later rows are still 0)
    return jax.lax.fori_loop(0, a.shape[0], lambda i, x: x.at[i].set(rhs[i] - a[i] @ x),
                             jnp.zeros_like(rhs))


def causal_conv(x, conv_state, weight, n_valid):
    """Depthwise causal conv with SiLU over a chunk, continuing from ``conv_state``.

    x [B, T, C] (compute dtype); conv_state [B, K-1, C] (the K-1 inputs before the chunk);
    weight [C, K] (transformers' conv1d weight [C, 1, K] squeezed); n_valid int32[B]: the
    row's real tokens (the rest is padding). Returns (silu(conv) [B, T, C] in x's dtype,
    new conv_state [B, K-1, C]: the K-1 inputs before token n_valid, in conv_state's dtype).
    """
    acc = _acc(x.dtype)
    kk = weight.shape[-1]
    ext = jnp.concatenate([conv_state.astype(acc), x.astype(acc)], axis=1)  # [B, K-1+T, C]
    t = x.shape[1]
    out = sum(ext[:, j:j + t] * weight[:, j].astype(acc) for j in range(kk))
    idx = n_valid[:, None] + jnp.arange(kk - 1)[None, :]  # [B, K-1]
    new_state = jnp.take_along_axis(ext, idx[..., None], axis=1)
    return jax.nn.silu(out).astype(x.dtype), new_state.astype(conv_state.dtype)
