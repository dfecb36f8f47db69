"""fp8 products for prefill attention over e4m3 pages: the queries quantized to e4m3, P's
scales, and the jnp reference twin of ``mosaic_prefill``'s ``compute="fp8"`` path (tests
compare the kernel with it; it computes the same quantized products tile by tile).

Numerics contract (what is rounded where), per query row r (one token, one query head) and
key tile of ``block_k`` keys, in the order the kernel does it:

1. q' = q in f32, static K scales (tensor / channel) multiplied in per channel; its scale
   s_q = ``fp8.dynamic_scale(amax_r(q'))`` (f32, rounded up so nothing saturates) and
   q8 = ``fp8.quantize(q', s_q, e4m3)``: the same policy as a token-mode K row.
2. S = q8 . K8^T: e4m3 x e4m3 products (exact in f32), f32 accumulation.
3. Token mode: S *= k_tok * (sm_scale * log2 e) per key; the row factor is f = s_q. Static
   modes: f = s_q * sm_scale * log2 e. Masked keys -> -inf.
4. The online softmax in log2 units: m' = max(m, max_j S * f), p = exp2(S * f - m'), l =
   l * 2^(m - m') + sum p (f32).
5. P's scale c: token mode ``p_scales`` (a power of two per batch row and KV head, from the
   row's largest V token scale), else ``P_MAX``; p *= v_tok * c per key (token; 0 on masked
   keys) or p *= c (static), then P8 = e4m3(p) (<= P_MAX: no saturation).
6. acc = acc * 2^(m - m') + P8 . V8 (e4m3 x e4m3, f32 accumulation; V rows past the
   sequence 0); static V scales multiply acc's channels at the end; out = acc / (l * c)
   (0 where l = 0).

In the kernel V is transposed exactly into shared memory first (an 8-bit wgmma reads its B
operand K-major only) and P is quantized into shared memory (docs/lab/kernels-notes.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jfp8kv.config import CacheConfig
from jfp8kv.kernels.mosaic_ops import grouped_queries
from jfp8kv.kernels.tiles import LOG2E, KVLayout
from jfp8kv.kvcache import fp8
from jfp8kv.kvcache.cache import LayerKV

Q_DTYPE = jnp.float8_e4m3fn  # q's and P's format
P_MAX = 256.0  # P's quantized values stay <= P_MAX (e4m3 holds 448), a power of two: exact


def check_config(cfg: CacheConfig) -> None:
    """ValueError unless fp8 products can run on ``cfg``'s pages: e4m3 (an 8-bit wgmma
    multiplies two operands of one format, and q needs e4m3's precision) with token,
    tensor or channel scales (block scales vary inside q.K^T's reduction)."""
    mode = cfg.scale_mode if cfg.is_fp8 else None
    if (cfg.storage_dtype != "float8_e4m3fn" or cfg.layout != "kv"
            or mode not in ("token", "tensor", "channel")):
        raise ValueError(f"fp8_attention_compute='fp8' needs fp8_e4m3 K/V pages with token, "
                         f"tensor or channel scales, got {cfg.storage_dtype} ({cfg.layout}) "
                         f"with {mode} scales; use fp8_attention_compute='dequant' for these")


def quantize_queries(q, kv: KVLayout, k_scales, num_kv_heads: int):
    """q [B, T, H, D] -> (q8 e4m3 [B, T, H, D], its f32 scales [B, T, H]): step 1 of the
    contract (static K scales folded in per channel first, then one scale per row)."""
    qg = grouped_queries(q, kv, k_scales, num_kv_heads).reshape(q.shape)
    scale = fp8.dynamic_scale(fp8.amax_ignoring_nan(qg, -1), Q_DTYPE)
    return fp8.quantize(qg, scale[..., None], Q_DTYPE), scale


def p_scales(v_scales, page_tables, seq_lens, page_size: int):
    """Token mode: per (batch row, KV head), the power of two c with max_j v_tok_j * c <=
    ``P_MAX`` over the row's keys (1 where it has none), f32 [B, Hkv]: P's columns are
    multiplied by v_tok * c before P is quantized, and the output divided by c. v_scales:
    [Hkv, P*S] (the kernel layout)."""
    keys = page_tables.shape[1] * page_size
    tok = jnp.arange(keys, dtype=jnp.int32)
    rows = page_tables[:, tok // page_size] * page_size + tok % page_size  # [B, keys]
    v = jnp.take(v_scales.astype(jnp.float32), rows, axis=1)  # [Hkv, B, keys]
    v = jnp.where(tok[None, None, :] < seq_lens[None, :, None], v, 0.0)
    vmax = v.max(-1).T
    _, e = jnp.frexp(vmax)  # vmax = m * 2^e, m in [0.5, 1): vmax * 2^(8 - e) <= 256
    c = jnp.ldexp(jnp.float32(1.0), int(np.log2(P_MAX)) - e)
    return jnp.where((vmax > 0) & jnp.isfinite(vmax), c, 1.0)


def _slicer(start, size: int):
    """(x, axis) -> x[start:start + size] along ``axis`` (a traced start)."""
    return lambda x, axis: lax.dynamic_slice_in_dim(x, start, size, axis)


def _gather(pages, page_tables, page_size: int, keys: int):
    """[Hkv, P*S, ...] -> [B, Hkv, keys, ...]: each batch row's keys in order."""
    tok = jnp.arange(keys, dtype=jnp.int32)
    rows = page_tables[:, tok // page_size] * page_size + tok % page_size  # [B, keys]
    return jnp.moveaxis(jnp.take(pages, rows, axis=1), 0, 1)


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale", "block_k"))
def prefill_attention(q, layer: LayerKV, page_tables, seq_lens, q_positions, cfg: CacheConfig,
                      sm_scale: float, block_k: int = 64):
    """q [B, T, H, D] -> [B, T, H, D] (q's dtype), ``reference.paged_attention``'s masking
    contract, computed with the contract's fp8 products tile by tile (``block_k`` keys, as
    the kernel walks them). e4m3 pages with token, tensor or channel scales. Static: cfg,
    sm_scale, block_k."""
    b, t, nh, d = q.shape
    hkv, ps = cfg.num_kv_heads, cfg.page_size
    kv = KVLayout.of(cfg)
    token = kv.groups == 1
    k_pages, v_pages, k_sc, v_sc = kv.operands(layer, hkv)
    q8, qs = quantize_queries(q, kv, k_sc, hkv)
    g = nh // hkv
    q8 = q8.reshape(b, t, hkv, g, d)
    c_row = qs.reshape(b, t, hkv, g) * (1.0 if token else float(sm_scale) * LOG2E)
    n_tiles = -(-page_tables.shape[1] * ps // block_k)
    keys = n_tiles * block_k
    width = -(-keys // ps)  # whole tiles of entries; those past a sequence are masked
    pt = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, width - page_tables.shape[1])))
    k8, v8 = (_gather(x, pt, ps, keys) for x in (k_pages, v_pages))  # [B, Hkv, N, D]
    key = jnp.arange(keys, dtype=jnp.int32)
    real = key[None, :] < seq_lens[:, None]  # [B, N]
    v8 = jnp.where(real[:, None, :, None], v8, jnp.zeros((), v8.dtype))
    p_c = p_scales(v_sc, page_tables, seq_lens, ps) if token else jnp.full((b, hkv), P_MAX)
    if token:
        k_tok, v_tok = (_gather(x.astype(jnp.float32), pt, ps, keys) for x in (k_sc, v_sc))
    pos = q_positions.astype(jnp.int32)

    def tile(carry, i):
        acc, m_i, l_i = carry  # [B, T, Hkv, G, D], [B, T, Hkv, G] x 2
        sl = _slicer(i * block_k, block_k)
        s = jnp.einsum("bthgd,bhkd->bthgk", q8, sl(k8, 2), preferred_element_type=jnp.float32)
        kk = sl(key, 0)
        if token:
            kc = sl(k_tok, 2) * (float(sm_scale) * LOG2E)  # [B, Hkv, bk]
            s = s * kc[:, None, :, None, :]
        visible = ((kk[None, None, :] < seq_lens[:, None, None])
                   & (kk[None, None, :] <= pos[:, :, None]))[:, :, None, None, :]
        s = jnp.where(visible, s, -jnp.inf)
        c = c_row[..., None]
        m_new = jnp.maximum(m_i, s.max(-1) * c_row)
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s * c - m_use[..., None])
        l_new = l_i * alpha + p.sum(-1)
        if token:
            vc = sl(v_tok, 2) * p_c[:, :, None]
            p = jnp.where(visible, p * vc[:, None, :, None, :], 0.0)
        else:
            p = p * P_MAX
        pv = jnp.einsum("bthgk,bhkd->bthgd", p.astype(Q_DTYPE), sl(v8, 2),
                        preferred_element_type=jnp.float32)
        return (acc * alpha[..., None] + pv, m_new, l_new), None

    rows = (b, t, hkv, g)
    init = (jnp.zeros((*rows, d), jnp.float32), jnp.full(rows, -jnp.inf, jnp.float32),
            jnp.zeros(rows, jnp.float32))
    (acc, _, l_i), _ = lax.scan(tile, init, jnp.arange(n_tiles))
    if not token:
        acc = acc * v_sc.astype(jnp.float32)[None, None, :, None, :]
    out = acc / (jnp.where(l_i > 0, l_i, 1.0) * p_c[:, None, :, None])[..., None]
    return out.reshape(b, t, nh, d).astype(q.dtype)
