"""DeepSeek-V4's non-attention pieces as pure jnp: interleaved partial RoPE, manifold-
constrained hyper-connections (mHC), the grouped low-rank output projection and the MoE
(score-routed or hash-routed experts with clamped SwiGLU, plus the shared expert).

Everything computes in the accumulation dtype (float32, or float64 in the float64 check
mode) and returns the input's dtype. Weights are stored [in, out]; the layer params are
documented in ``jfp8kv.models.deepseek_v4``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jfp8kv.config import ModelConfig
from jfp8kv.kernels.prologue import acc_dtype, rms_norm
from jfp8kv.models import mla
from jfp8kv.models.moe import grouped_experts


def unweighted_rms_norm(x, eps: float):
    """x / rms(x) over the last axis (no weight)."""
    acc = acc_dtype(x.dtype)
    x32 = x.astype(acc)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


def linear(x, w):
    """x [..., i] @ w [i, o], accumulated in the accumulation dtype, rounded to x's dtype."""
    return jnp.einsum("...i,io->...o", x, w,
                      preferred_element_type=acc_dtype(x.dtype)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, kind: str) -> np.ndarray:
    """float64 inverse frequencies of the qk_rope_head_dim rotation: ``kind`` "main" (the
    window-only layers: rope_theta, no scaling) or "compress" (CSA / HCA layers, their
    compressed entries and the indexer: compress_rope_theta with the checkpoint's YaRN)."""
    v4 = cfg.v4
    if kind == "main":
        sub = dataclasses.replace(cfg, rope_scaling=None)
    else:
        sub = dataclasses.replace(cfg, rope_theta=v4.compress_rope_theta,
                                  rope_scaling=v4.compress_rope)
    return mla.rope_inv_freq(sub, dtype=np.float64)


def rope(x, positions, inv_freq, inverse: bool = False):
    """Rotate the trailing ``2 * len(inv_freq)`` channels of x [B, T, ..., d] in adjacent
    (even, odd) pairs by angle positions [B, T] * inv_freq (``inverse``: by minus the
    angle); the leading channels pass through. V4 rotates keys, queries and (inverse) the
    attention output this way."""
    acc = acc_dtype(x.dtype)
    rd = 2 * inv_freq.shape[0]
    ang = positions.astype(acc)[..., None] * jnp.asarray(inv_freq, acc)  # [B, T, rd/2]
    ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
    cos, sin = jnp.cos(ang), jnp.sin(ang) * (-1.0 if inverse else 1.0)
    r = x[..., -rd:].astype(acc)
    even, odd = r[..., 0::2], r[..., 1::2]
    out = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], -1).reshape(r.shape)
    return jnp.concatenate([x[..., :-rd], out.astype(x.dtype)], -1)


def _sinkhorn(logits, iters: int, eps: float):
    """Approximately doubly-stochastic [.., n, n] from logits: row softmax + eps, then
    alternate column and row normalization (columns first and last)."""
    comb = jax.nn.softmax(logits, -1) + eps
    comb = comb / (jnp.sum(comb, -2, keepdims=True) + eps)

    def step(_, c):
        c = c / (jnp.sum(c, -1, keepdims=True) + eps)
        return c / (jnp.sum(c, -2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, step, comb)


@functools.partial(jax.jit, static_argnames="cfg")
def hc_pre(streams, hp, cfg: ModelConfig):
    """mHC entry on streams [B, T, n, D]: returns (collapsed [B, T, D], post [B, T, n],
    comb [B, T, n, n]). ``hp``: fn [n*D, (2+n)*n], base [(2+n)*n], scale [3]."""
    v4, n = cfg.v4, cfg.v4.hc_mult
    acc = acc_dtype(streams.dtype)
    flat = unweighted_rms_norm(streams.reshape(streams.shape[:2] + (-1,)).astype(acc),
                               cfg.rms_norm_eps)
    mix = jnp.einsum("bti,io->bto", flat, hp["fn"].astype(acc))
    base, scale = hp["base"].astype(acc), hp["scale"].astype(acc)
    pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + v4.hc_eps
    post = 2 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = (mix[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(mix.shape[:2] + (n, n))
    comb = _sinkhorn(comb_logits, v4.hc_sinkhorn_iters, v4.hc_eps)
    collapsed = jnp.sum(pre[..., None] * streams.astype(acc), 2).astype(streams.dtype)
    return collapsed, post, comb


@jax.jit
def hc_post(streams, block_out, post, comb):
    """mHC exit: new stream k = post_k * block_out + sum_j comb[j, k] * streams_j."""
    acc = post.dtype
    mixed = jnp.einsum("btjk,btjd->btkd", comb, streams.astype(acc))
    return (post[..., None] * block_out.astype(acc)[:, :, None] + mixed).astype(streams.dtype)


@functools.partial(jax.jit, static_argnames="cfg")
def hc_head(streams, hp, cfg: ModelConfig):
    """Final collapse of streams [B, T, n, D] to [B, T, D] (sigmoid mixing weights + eps).
    ``hp``: fn [n*D, n], base [n], scale [1]."""
    acc = acc_dtype(streams.dtype)
    flat = unweighted_rms_norm(streams.reshape(streams.shape[:2] + (-1,)).astype(acc),
                               cfg.rms_norm_eps)
    mix = jnp.einsum("bti,io->bto", flat, hp["fn"].astype(acc))
    pre = jax.nn.sigmoid(mix * hp["scale"].astype(acc)[0] + hp["base"].astype(acc))
    pre = pre + cfg.v4.hc_eps
    return jnp.sum(pre[..., None] * streams.astype(acc), 2).astype(streams.dtype)


def grouped_output(attn, lp, cfg: ModelConfig):
    """attn [B, T, H, hd] -> [B, T, D]: each of o_groups head groups projected alone by
    wo_a [G, H*hd/G, o_lora_rank], then wo_b [G*o_lora_rank, D] mixes the groups."""
    g = cfg.v4.o_groups
    b, t = attn.shape[:2]
    x = attn.reshape(b, t, g, -1)
    y = jnp.einsum("btgi,gio->btgo", x, lp["wo_a"],
                   preferred_element_type=acc_dtype(x.dtype)).astype(x.dtype)
    return linear(y.reshape(b, t, -1), lp["wo_b"])


def _score(logits, func: str):
    if func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if func == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, -1)


def _clamped_swiglu(gate, up, limit: float):
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


@functools.partial(jax.jit, static_argnames=("cfg", "is_hash", "backend"))
def moe(h, token_ids, lp, cfg: ModelConfig, is_hash: bool, backend: str | None = None):
    """V4 MoE block on h [B, T, D] (normalized): routed experts chosen by score top-k over
    scores + router_bias, or (``is_hash``) by the frozen table tid2eid [V, k] at the token
    ids [B, T]; weights = the chosen scores renormalized, times routed_scaling_factor; plus
    the shared expert. Expert pre-activations are clamped at swiglu_limit (gate above only,
    up both sides). ``backend`` None: every chosen expert's weights are gathered per token
    (the reference: fine at test widths, not at Flash's); else the assignments are grouped
    by expert (``moe.grouped_experts`` with this ``kernels.grouped_matmul`` backend, gate
    and up rounded to h's dtype as there)."""
    acc = acc_dtype(h.dtype)
    x = h.reshape(-1, h.shape[-1]).astype(acc)
    scores = _score(jnp.einsum("nd,de->ne", x, lp["router"].astype(acc)), cfg.v4.scoring_func)
    if is_hash:
        ids = lp["tid2eid"][token_ids.reshape(-1)]
    else:
        _, ids = jax.lax.top_k(scores + lp["router_bias"].astype(acc), cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, ids, -1)
    w = w / (jnp.sum(w, -1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    limit = cfg.v4.swiglu_limit
    if backend is None:
        gate = jnp.einsum("nd,nkdi->nki", x, lp["experts_gate"][ids].astype(acc))
        up = jnp.einsum("nd,nkdi->nki", x, lp["experts_up"][ids].astype(acc))
        routed = jnp.einsum("nki,nkid,nk->nd", _clamped_swiglu(gate, up, limit),
                            lp["experts_down"][ids].astype(acc), w)
    else:
        routed = grouped_experts(h.reshape(x.shape), ids.astype(jnp.int32), w,
                                 lp["experts_gate"], lp["experts_up"], lp["experts_down"],
                                 backend, lambda g, u: _clamped_swiglu(g, u, limit))
        routed = routed.astype(acc)
    shared = jnp.einsum("ni,id->nd", _clamped_swiglu(x @ lp["shared_gate"].astype(acc),
                                                     x @ lp["shared_up"].astype(acc), limit),
                        lp["shared_down"].astype(acc))
    return (routed + shared).reshape(h.shape).astype(h.dtype)


__all__ = ["rms_norm", "unweighted_rms_norm", "linear", "rope_inv_freq", "rope", "hc_pre",
           "hc_post", "hc_head", "grouped_output", "moe"]
