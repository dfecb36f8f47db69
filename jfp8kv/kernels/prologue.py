"""The attention prologue of the new rows: q/k RMS norm (Qwen3) and rotary embedding, here
as the jnp reference twin; ``pallas_store.prologue_store`` fuses it into the K/V store.

Contract: ``apply(p, q, k) -> (q', k')`` for q [N, H, D] and k [N, Hkv, D] in the compute
dtype (row n is flat token n of the chunk, biases already added). Each row is, in
``acc_dtype`` arithmetic, RMS-normalized with ``p.q_norm`` / ``p.k_norm`` when given and
rounded to the compute dtype, then rotated with HF's rotate-half convention by the row's
``p.cos`` / ``p.sin`` [N, D] and rounded again: the same roundings as the models' separate
norm and RoPE.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def acc_dtype(dtype):
    """Arithmetic dtype for ``dtype`` values: float32, or float64 for float64 compute.

    bf16/fp16/fp32 models normalize, rotate, accumulate and score in float32; the float64
    compute dtype (CPU reference checks under JAX_ENABLE_X64) keeps float64 throughout, so
    that no float32 rounding step differs between this engine and another float64 reference.
    """
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x, w, eps):
    acc = acc_dtype(x.dtype)
    x32 = x.astype(acc)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(acc)).astype(x.dtype)


@dataclasses.dataclass
class QKPrologue:
    """Per-row rotary tables and this layer's q/k norm weights (None: no norm). ``eps`` is
    static (pytree metadata), the rest are arrays."""

    cos: Float[Array, "n head_dim"]
    sin: Float[Array, "n head_dim"]
    q_norm: Float[Array, "head_dim"] | None
    k_norm: Float[Array, "head_dim"] | None
    eps: float = 1e-6

    @property
    def has_norm(self) -> bool:
        return self.q_norm is not None


jax.tree_util.register_dataclass(QKPrologue, data_fields=["cos", "sin", "q_norm", "k_norm"],
                                 meta_fields=["eps"])


def rope_tables(positions: Int[Array, "n"], inv_freq) -> tuple[Array, Array]:
    """(cos, sin) [N, D] in ``inv_freq``'s dtype: the angles position * inv_freq, each half
    repeated (rotate-half)."""
    ang = positions[:, None].astype(inv_freq.dtype) * inv_freq  # [N, D/2]
    return jnp.concatenate([jnp.cos(ang)] * 2, -1), jnp.concatenate([jnp.sin(ang)] * 2, -1)


def rotate(x, cos, sin):
    """x [N, H, D] rotated by its rows' cos/sin [N, D]; arithmetic in acc_dtype."""
    x32 = x.astype(acc_dtype(x.dtype))
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos[:, None] + rot * sin[:, None]).astype(x.dtype)


def apply(p: QKPrologue, q, k):
    """The reference prologue: (q', k') as the module docstring says."""
    if p.has_norm:
        q, k = rms_norm(q, p.q_norm, p.eps), rms_norm(k, p.k_norm, p.eps)
    return rotate(q, p.cos, p.sin), rotate(k, p.cos, p.sin)
