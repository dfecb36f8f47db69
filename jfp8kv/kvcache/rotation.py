"""A deterministic randomized Hadamard rotation along head_dim, for K (and q) before fp8.

fp8 error in the KV cache is dominated by K, whose post-RoPE rows carry a few large
channels: a per-token or per-block scale is set by those channels and the rest lose
precision. An orthonormal rotation R spreads every row over all channels before it is
quantized. Rotating the queries by the same R leaves every score unchanged,
(q R) . (k R) = q R R^T k^T = q . k, so attention needs nothing else; V is not rotated.

Definition (row-vector convention, ``rotate(x) == x @ matrix(D)``)::

    R = diag(s) @ blockdiag(H_b, ..., H_b) / sqrt(b)

with H_b the Sylvester Hadamard matrix of order b (entries +-1, H_b H_b = b I), b the
block size (``block_size(D)``: D itself when D is a power of two, else the largest power of
two dividing D, at least ``MIN_BLOCK``), and s in {-1, +1}^D the fixed sign vector
``signs(D, seed)``. R R^T = I.

Two computations of the same R, which differ only in rounding:

* ``rotate`` (K, before it is stored): a fast Walsh-Hadamard transform (log2(b) butterfly
  passes of adds and subtracts in a fixed order), then one multiply by the float constant
  fl(1/sqrt(b)). The numpy twin (``rotate_np``) performs the same IEEE operations in the same
  order, so the jnp and numpy versions agree bit for bit in float32 and float64; that is what
  lets the float64 check mode compare the engine's stored K with the independent fake
  quantization exactly (the stored rows are what fp8 rounds, so they must be identical).
* ``rotate_dense`` (the queries, before attention): one matmul ``x @ (diag(s) H)`` by the
  [D, D] block-diagonal +-1 matrix, float32 accumulation, then the same fl(1/sqrt(b)). XLA
  runs the butterfly as log2(b) separate passes over the query tensor (on an H200, ~0.13 ms
  for 2048 queries x 32 heads x 128, a quarter of that prefill step's attention); the matmul
  is one tensor-core pass. Queries are not quantized, so a last-bit difference from the
  butterfly only moves scores by float rounding (float64 check mode: ~1e-16 relative).

Dtypes: inputs are computed in ``promote_types(x.dtype, float32)`` (bfloat16/float16 go up
to float32; float64 stays float64) and returned in that dtype; callers cast. The signs come
from SplitMix64 on the seed, defined here, so they never change with a numpy version (static
scales calibrated in the rotated basis depend on them).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_SEED = 0x6A66_7038  # "jfp8"
MIN_BLOCK = 16
_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
    """One SplitMix64 step: (new state, 64-bit output)."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def block_size(head_dim: int) -> int:
    """The Hadamard block size for ``head_dim``; ValueError naming valid sizes otherwise.

    Powers of two (16, 32, 64, 128, 256, ...) get one full-width block; other multiples of
    ``MIN_BLOCK`` (80, 96, 112, 160, 192, ...) a block-diagonal Hadamard whose block is the
    largest power of two dividing head_dim.
    """
    if not isinstance(head_dim, (int, np.integer)) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    b = head_dim & -head_dim  # largest power of two dividing head_dim
    if b < MIN_BLOCK:
        raise ValueError(
            f"kv_rotation='hadamard' needs head_dim a multiple of {MIN_BLOCK} (powers of two "
            f"such as 64, 128, 256 get one full Hadamard; 80, 96, 112, 160, 192 a "
            f"block-diagonal one); got head_dim={head_dim}. Use kv_rotation='none'.")
    return int(b)


@functools.lru_cache(maxsize=None)
def _signs_cached(head_dim: int, seed: int) -> np.ndarray:
    state, out = seed & _MASK64, np.empty(head_dim, np.int8)
    for i in range(head_dim):
        state, z = _splitmix64(state)
        out[i] = 1 if z >> 63 else -1
    out.flags.writeable = False
    return out


def signs(head_dim: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """The fixed sign vector s: int8[head_dim] of +-1 (top bit of SplitMix64 outputs)."""
    block_size(head_dim)
    return _signs_cached(int(head_dim), int(seed))


def scale(head_dim: int) -> float:
    """1 / sqrt(b), b = ``block_size(head_dim)``: R = ``signed_blocks`` times this."""
    return 1.0 / math.sqrt(block_size(head_dim))


def hadamard(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix H_n (n a power of two), int64 entries +-1; H_n H_n = n I."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1), np.int64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.lru_cache(maxsize=None)
def signed_blocks(head_dim: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """diag(s) @ blockdiag(H_b, ...): int64 [head_dim, head_dim] of 0 and +-1, so R is this
    times 1/sqrt(b) (exact in every float dtype, bfloat16 included). Read-only."""
    b = block_size(head_dim)
    blocks = np.kron(np.eye(head_dim // b, dtype=np.int64), hadamard(b))
    out = signs(head_dim, seed)[:, None] * blocks
    out.flags.writeable = False
    return out


def matrix(head_dim: int, seed: int = DEFAULT_SEED, dtype=np.float64) -> np.ndarray:
    """R [head_dim, head_dim] with ``rotate(x) == x @ R`` up to rounding; R R^T = I."""
    return (signed_blocks(head_dim, seed) / math.sqrt(block_size(head_dim))).astype(dtype)


def _fwht(x, xp, b: int):
    """Unnormalized Walsh-Hadamard transform of each length-b block of the last axis."""
    shape = x.shape
    h = 1
    while h < b:
        y = x.reshape(*shape[:-1], -1, 2, h)
        lo, hi = y[..., 0, :], y[..., 1, :]
        x = xp.stack([lo + hi, lo - hi], axis=-2).reshape(shape)
        h *= 2
    return x


def _compute_dtype(dtype):
    return np.promote_types(np.dtype(dtype), np.float32)


@functools.partial(jax.jit, static_argnames="seed")
def rotate(x, seed: int = DEFAULT_SEED):
    """x [..., D] (jnp or array-like) -> x @ R, computed as documented, in
    ``promote_types(x.dtype, float32)``. Rotate K rows before they are quantized and stored
    and the queries before attention, with the same seed. Jitted; ``seed`` is static."""
    d = x.shape[-1]
    ct = _compute_dtype(x.dtype)
    s = jnp.asarray(signs(d, seed), ct)
    y = _fwht(x.astype(ct) * s, jnp, block_size(d))
    return y * jnp.asarray(scale(d), ct)


@functools.partial(jax.jit, static_argnames="seed")
def unrotate(y, seed: int = DEFAULT_SEED):
    """Inverse of ``rotate``: y [..., D] -> y @ R^T (same dtype rule). Jitted."""
    d = y.shape[-1]
    ct = _compute_dtype(y.dtype)
    x = _fwht(y.astype(ct), jnp, block_size(d)) * jnp.asarray(scale(d), ct)
    return x * jnp.asarray(signs(d, seed), ct)


@functools.partial(jax.jit, static_argnames="seed")
def rotate_dense(x, seed: int = DEFAULT_SEED):
    """x [..., D] -> x @ R as ONE matmul, ``(x @ (diag(s) H)) * fl(1/sqrt(b))``, returned in
    ``promote_types(x.dtype, float32)`` like ``rotate`` (the same R; only rounding differs).

    bfloat16/float16 x: the operands stay in x's dtype (the +-1 entries are exact, and
    x_i * (s_i H_ij) == (x_i s_i) H_ij exactly) and the products are accumulated in float32
    (``preferred_element_type``), so it runs on tensor cores. float32/float64 x: computed in
    that dtype with ``precision=HIGHEST`` (no TF32 truncation of x). Used for the queries;
    K keeps the bit-exact butterfly (module docstring). Jitted; ``seed`` is static."""
    d = x.shape[-1]
    ct = _compute_dtype(x.dtype)
    x = jnp.asarray(x)
    low = x.dtype in (jnp.bfloat16, jnp.float16)
    m = jnp.asarray(signed_blocks(d, seed), x.dtype if low else ct)
    y = jnp.matmul(x if low else x.astype(ct), m, preferred_element_type=ct,
                   precision=None if low else jax.lax.Precision.HIGHEST)
    return y * jnp.asarray(scale(d), ct)


def rotate_np(x: np.ndarray, seed: int = DEFAULT_SEED) -> np.ndarray:
    """numpy twin of ``rotate``: the same operations in the same order (bitwise equal)."""
    x = np.asarray(x)
    d = x.shape[-1]
    ct = _compute_dtype(x.dtype)
    y = _fwht(x.astype(ct) * signs(d, seed).astype(ct), np, block_size(d))
    return y * ct.type(scale(d))


def unrotate_np(y: np.ndarray, seed: int = DEFAULT_SEED) -> np.ndarray:
    """numpy twin of ``unrotate``."""
    y = np.asarray(y)
    d = y.shape[-1]
    ct = _compute_dtype(y.dtype)
    x = _fwht(y.astype(ct), np, block_size(d)) * ct.type(scale(d))
    return x * signs(d, seed).astype(ct)
