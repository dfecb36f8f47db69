"""Paged decode attention on the Pallas Triton backend: split-K, GQA-grouped, fp8-aware.

One program per (batch row, KV head, split). All ``G = num_heads // num_kv_heads`` query
heads of a KV head share the program, so every K/V byte is read once per step. The q block
is padded to ``Gp = max(16, next_pow2(G))`` rows (Triton's ``dot`` needs M >= 16); padded
rows are masked on load and never stored.

Each loop iteration gathers ``block_k`` consecutive *tokens* (not pages): token ``t`` lives
in page ``page_table[b, t // S]`` at row ``t % S``, so the tile is one [block_k, D] gather
whatever the page size, and a tile may span several pages. Tokens at or past ``seq_len``
are masked (no bytes read, logits -inf, V rows zero), so whatever an unused page holds
(NaN included) never reaches the output. A split whose range starts past ``seq_len`` runs
no iteration; an empty batch slot (seq_len 0) returns zeros.

Dequantization happens in registers (the numerics contract of ``reference.py``):
* fp8 tiles are upcast to float16 (exact for e4m3 and e5m2) and the dots run in f16 with
  f32 accumulation. q is cast to f16 too; |q * k_scale| must stay below 65504 (q is
  post-RoPE, and static scales are ~amax/fmax, so this is not a practical limit);
* "tensor"/"channel": the K scale [D] multiplies q per channel, the V scale the output;
* "token": K scales multiply the logits, V scales the probabilities (per key); with the
  "rowscale" variant they multiply the upcast tile's rows instead (in f32, rounded to f16:
  the dequantized values must stay below 65504, as the unquantized K/V did in bf16 models
  in practice; prepared for the GPU sweep, not a default);
* "block": the [block_k, D] tile is multiplied by its fp16 scales (gathered per element)
  before the dot;
* bf16/f16 pages: dots in the storage dtype; f32 pages: IEEE f32 dots.

Softmax runs in base 2 (``sm_scale * log2(e)`` folded into the logits). With more than one
split, each split writes (unnormalized acc [Gp, D], running max m, sum l) and a log-sum-exp
merge in plain jnp combines them; with one split the kernel writes the final output.

Performance notes (H200, docs/kernels-notes.md): the page indices of tile i+1 are loaded
while tile i is computed ("pagepf"), otherwise Triton's pipeliner, seeing the K/V
addresses depend on a load in the same iteration, waits on every outstanding copy at the
top of each iteration and the memory latency is exposed per tile. fp8 is upcast with
inline PTX ("asm"); the fp8 kernel is then bound by instructions per byte (the P.V
operand needs the fp8 V tile transposed, which Triton does byte by byte), not by HBM.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache.cache import STATIC_MODES, LayerKV

LOG2E = 1.4426950408889634
NUM_SMS_H200 = 132


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Static launch knobs. ``num_splits=0`` picks splits so the grid fills the GPU."""

    block_k: int = 64
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 3
    target_programs: int = 4 * NUM_SMS_H200
    # Code-generation variants, "+"-joined (swept on the GPU, docs/kernels-notes.md).
    # Upcast: "asm" converts fp8 with inline PTX (cvt.rn.f16x2.e4m3x2, 4 per instance);
    # "vmask" selects on the upcast V tile (f16 transpose instead of byte gathers).
    # "rowscale" applies token scales to the tile rows (see the module docstring).
    # Loop: "pagepf" loads page indices one tile ahead, so Triton's pipeliner double-buffers
    # K/V (without it, the indirect page-table load made it wait on every copy).
    variant: str = ""


def default_tuning(cfg: CacheConfig) -> DecodeTuning:
    """The measured best per storage family (see docs/kernels-notes.md)."""
    if cfg.is_fp8:  # head_dim 256: half the tile keeps registers and shared memory in bounds
        bk = 128 if cfg.head_dim <= 128 else 64
        return DecodeTuning(block_k=bk, num_warps=4, num_stages=3, target_programs=528,
                            variant="pagepf+asm")
    return DecodeTuning(block_k=64, num_warps=4, num_stages=3, target_programs=528,
                        variant="pagepf")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def compute_dtype_for(cfg: CacheConfig):
    """Operand dtype of the in-kernel dots: fp8 upcasts exactly to f16."""
    return jnp.dtype(jnp.float16) if cfg.is_fp8 else jnp.dtype(cfg.storage_dtype)


def scale_kind(cfg: CacheConfig) -> str | None:
    if not cfg.is_fp8:
        return None
    return "static" if cfg.scale_mode in STATIC_MODES else cfg.scale_mode


def dot_nt(a, b):
    """a [M, K] . b [N, K]^T -> [M, N] f32 (IEEE for f32 operands)."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [M, K] . b [K, N] -> [M, N] f32."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def flat_scales(scale, cfg: CacheConfig):
    """Scale arrays in the layout the kernels index: token [Hkv, P*S], block [Hkv, P*S*nb]."""
    kind = scale_kind(cfg)
    if kind in ("token", "block"):
        return scale.reshape(cfg.num_kv_heads, -1)
    return scale


def load_kv_raw(pages_ref, scale_ref, h, rows, valid, kind, block: int):
    """Gather a [BK, D] K or V tile (storage dtype) and its scales; masked rows read nothing.

    pages_ref [Hkv, P*S, D]; rows int32[BK] flat token rows; valid bool[BK]. Returns (tile,
    scales): token [BK] f32, block [BK, nb] f16, else None. Masked rows (and their scales)
    are zero. Every index is an integer array (the interpret mode discharges only
    all-array or all-slice indexers).
    """
    bk = rows.shape[0]
    d = pages_ref.shape[-1]
    x = plgpu.load(pages_ref.at[h, rows[:, None], cols(d)],
                   mask=jnp.broadcast_to(valid[:, None], (bk, d)), other=0.0)  # [BK, D]
    sc = None
    if kind == "block":
        nb = d // block
        idx = rows[:, None] * nb + cols(nb)  # [BK, nb] into [P*S*nb]
        sc = plgpu.load(scale_ref.at[h, idx], mask=jnp.broadcast_to(valid[:, None], (bk, nb)),
                        other=0.0)
    elif kind == "token":
        sc = plgpu.load(scale_ref.at[h, rows], mask=valid, other=0.0)
    return x, sc


def dequant_kv(x, sc, valid, kind, cdt, block: int, variant=""):
    """(raw tile, scales) -> (tile [BK, D] in ``cdt`` with block scales applied, per-token
    scale [BK] f32 or None)."""
    bk, d = x.shape
    if kind == "block":  # one fp16 scale per `block` channels, broadcast along the block
        nb = d // block
        sc = jnp.broadcast_to(sc[:, :, None], (bk, nb, block)).reshape(bk, d)
        x = (x.astype(jnp.float32) * sc.astype(jnp.float32)).astype(cdt)
    elif "asm" in variant and jnp.dtype(x.dtype).name in ("float8_e4m3fn", "float8_e5m2"):
        x = fp8_to_f16_asm(x)
    else:
        x = x.astype(cdt)
    if kind == "token" and "rowscale" in variant:
        # Per-token scales applied to the tile's rows in its load layout (each thread holds a
        # few rows, so a few scale loads) instead of to the logits / probabilities columns.
        x = (x.astype(jnp.float32) * sc[:, None]).astype(cdt)
        sc = None
    if "vmask" in variant:
        # A select on the upcast tile keeps the fp8->f16 conversion in the load layout, so
        # Triton transposes f16 (ldmatrix.trans) instead of gathering single bytes for the
        # P.V operand.
        x = jnp.where(jnp.broadcast_to(valid[:, None], (bk, d)), x, jnp.zeros((), cdt))
    return x, (sc if kind == "token" else None)


def load_kv_tile(pages_ref, scale_ref, h, rows, valid, kind, cdt, block: int, variant=""):
    """``load_kv_raw`` then ``dequant_kv``."""
    x, sc = load_kv_raw(pages_ref, scale_ref, h, rows, valid, kind, block)
    return dequant_kv(x, sc, valid, kind, cdt, block, variant)


def fp8_to_f16_asm(x):
    """fp8 -> f16 with Hopper's packed cvt, 4 elements per instance (GPU only)."""
    fmt = "e4m3" if jnp.dtype(x.dtype).name == "float8_e4m3fn" else "e5m2"
    xb = jax.lax.bitcast_convert_type(x, jnp.int8)
    asm = ("{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, $2;\n"
           f" cvt.rn.f16x2.{fmt}x2 $0, lo;\n cvt.rn.f16x2.{fmt}x2 $1, hi;\n}}")
    (y,) = plgpu.elementwise_inline_asm(
        asm, args=[xb], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])
    return y


def resolve_variant(variant: str, cfg: CacheConfig, interpret: bool) -> str:
    """Drop the parts of a "+"-joined variant that do not apply: the upcast variants on
    non-fp8 pages, inline PTX in interpret mode (it runs on the GPU only)."""
    parts = set(filter(None, variant.split("+")))
    if not cfg.is_fp8:
        parts -= {"vmask", "asm", "rowscale"}
    if interpret:
        parts -= {"asm"}
    return "+".join(sorted(parts))


def cols(n: int):
    """int32 [1, n] column index."""
    return jnp.arange(n, dtype=jnp.int32)[None, :]


def _decode_kernel(len_ref, pt_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, *out_refs,
                   sm_scale, page_size, num_splits, num_groups, kind, cdt, block_k,
                   scale_block, split, variant):
    # len_ref [B] i32; pt_ref [B, MP] i32; q_ref [B, Hkv, G, D]; k_ref/v_ref [Hkv, P*S, D]
    # ks_ref/vs_ref: static [Hkv, D] f32 | token [Hkv, P*S] f32 | block [Hkv, P*S*nb] f16
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = q_ref.shape[-1]
    max_pages = pt_ref.shape[1]
    gp = max(16, next_pow2(num_groups))
    g_idx = jnp.arange(gp, dtype=jnp.int32)
    g_ok = g_idx < num_groups

    seq_len = len_ref[b]
    # Each sequence's own length is cut into num_splits tile-aligned parts. (Cutting the page
    # table's width instead left every program past the context idle: a pool sized for 32k
    # contexts serving 8k ones kept a quarter of the grid busy and made decode latency-bound.)
    tokens_per_split = ((seq_len + num_splits - 1) // num_splits + block_k - 1) // block_k * block_k
    start = sp * tokens_per_split
    end = jnp.minimum(seq_len, start + tokens_per_split)
    n_iter = jnp.maximum(end - start + block_k - 1, 0) // block_k

    out_mask = jnp.broadcast_to(g_ok[:, None], (gp, d))
    q = plgpu.load(q_ref.at[b, h, g_idx[:, None], cols(d)], mask=out_mask,
                   other=0.0).astype(jnp.float32)  # [Gp, D]
    if kind == "static":
        q = q * plgpu.load(ks_ref.at[h, cols(d)]).astype(jnp.float32)
    q = q.astype(cdt)
    qk_scale = sm_scale * LOG2E

    k_variant = variant.replace("vmask", "")  # a V-only upcast variant

    def tile_pos(i):
        tok = start + i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
        return tok, tok < end

    def load_pages(i):
        tok, valid = tile_pos(i)
        slot = jnp.minimum(tok // page_size, max_pages - 1)
        return plgpu.load(pt_ref.at[b, slot], mask=valid, other=0)  # [BK]

    def load_tiles(i, page):
        tok, valid = tile_pos(i)
        rows = page * page_size + tok % page_size
        return (load_kv_raw(k_ref, ks_ref, h, rows, valid, kind, scale_block)
                + load_kv_raw(v_ref, vs_ref, h, rows, valid, kind, scale_block))

    def attend(i, acc, m_i, l_i, tiles):
        _, valid = tile_pos(i)
        k_raw, k_sc, v_raw, v_sc = tiles
        k, k_tok = dequant_kv(k_raw, k_sc, valid, kind, cdt, scale_block, k_variant)
        s = dot_nt(q, k)  # [Gp, BK] f32
        if k_tok is not None:
            s = s * k_tok[None, :]
        s = jnp.where(valid[None, :], s * qk_scale, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s - m_use[:, None])  # masked keys: exp2(-inf) = 0
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        v, v_tok = dequant_kv(v_raw, v_sc, valid, kind, cdt, scale_block, variant)
        if v_tok is not None:
            p = p * v_tok[None, :]
        acc = acc * alpha[:, None] + dot_nn(p.astype(cdt), v)
        return acc, m_new, l_new

    acc0 = jnp.zeros((gp, d), jnp.float32)
    m0 = jnp.full((gp,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((gp,), jnp.float32)
    if "pagepf" in variant:
        # Page indices one tile ahead (loop-carried); the K/V loads are left to Triton's
        # pipeliner, their addresses now come from a loop-carried value.
        def body(i, carry):
            acc, m_i, l_i, page = carry
            tiles = load_tiles(i, page)
            acc, m_i, l_i = attend(i, acc, m_i, l_i, tiles)
            return acc, m_i, l_i, load_pages(i + 1)

        acc, m_i, l_i, _ = jax.lax.fori_loop(0, n_iter, body, (acc0, m0, l0, load_pages(0)))
    else:
        def body(i, carry):
            acc, m_i, l_i = carry  # [Gp, D], [Gp], [Gp] f32
            return attend(i, acc, m_i, l_i, load_tiles(i, load_pages(i)))

        acc, m_i, l_i = jax.lax.fori_loop(0, n_iter, body, (acc0, m0, l0))
    if kind == "static":
        acc = acc * plgpu.load(vs_ref.at[h, cols(d)]).astype(jnp.float32)

    if not split:
        (o_ref,) = out_refs
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(o_ref.at[b, h, g_idx[:, None], cols(d)], out.astype(o_ref.dtype),
                    mask=out_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[b, h, sp, g_idx[:, None], cols(d)], acc, mask=out_mask)
        plgpu.store(m_ref.at[b, h, sp, g_idx], m_i, mask=g_ok)
        plgpu.store(l_ref.at[b, h, sp, g_idx], l_i, mask=g_ok)


def choose_splits(batch: int, num_kv_heads: int, max_tokens: int, tuning: DecodeTuning) -> int:
    """Splits so that batch * kv_heads * splits reaches ``target_programs``; each split keeps
    at least two tiles of work."""
    if tuning.num_splits:
        return tuning.num_splits
    pairs = batch * num_kv_heads
    ns = 1
    while pairs * ns < tuning.target_programs and max_tokens // (2 * ns) >= 2 * tuning.block_k:
        ns *= 2
    return ns


def combine_splits(o, m, l):
    """Log-sum-exp merge. o [B, Hkv, NS, G, D] (unnormalized), m/l [B, Hkv, NS, G] (base 2)."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    w = jnp.exp2(m - m_max)  # empty splits: m = -inf -> 0
    num = jnp.sum(o * w[..., None], axis=2)
    den = jnp.sum(l * w, axis=2)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale", "interpret", "tuning"))
def decode_attention(q, layer: LayerKV, page_tables, seq_lens, cfg: CacheConfig,
                     sm_scale: float, interpret: bool = False,
                     tuning: DecodeTuning | None = None):
    """q [B, H, D] -> [B, H, D] (q's dtype); same contract as ``reference.decode_attention``.

    Static: cfg, sm_scale, interpret, tuning. Nothing is donated.
    """
    tuning = tuning or default_tuning(cfg)
    b, nh, d = q.shape
    hkv, s = cfg.num_kv_heads, cfg.page_size
    g = nh // hkv
    max_pages = page_tables.shape[1]
    if tuning.block_k < 16 or tuning.block_k & (tuning.block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {tuning.block_k}")
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the Pallas kernel, got {d}")
    kind = scale_kind(cfg)
    variant = resolve_variant(tuning.variant, cfg, interpret)
    ns = choose_splits(b, hkv, max_pages * s, tuning)

    k_pages = layer.k.reshape(hkv, -1, d)
    v_pages = layer.v.reshape(hkv, -1, d)
    ks = flat_scales(layer.k_scale, cfg) if kind else None
    vs = flat_scales(layer.v_scale, cfg) if kind else None
    qg = q.reshape(b, hkv, g, d)
    split = ns > 1
    if split:
        out_shape = (jax.ShapeDtypeStruct((b, hkv, ns, g, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, ns, g), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, ns, g), jnp.float32))
    else:
        out_shape = (jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),)
    kernel = functools.partial(
        _decode_kernel, sm_scale=float(sm_scale), page_size=s, num_splits=ns,
        num_groups=g, kind=kind, cdt=compute_dtype_for(cfg), block_k=tuning.block_k,
        scale_block=cfg.scale_block, split=split, variant=variant)
    outs = pl.pallas_call(
        kernel,
        grid=(b, hkv, ns),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
        name="jfp8kv_paged_decode",
    )(seq_lens.astype(jnp.int32), page_tables.astype(jnp.int32), qg, k_pages, v_pages, ks, vs)
    if split:
        out = combine_splits(*outs)
    else:
        out = outs[0]
    return out.reshape(b, nh, d).astype(q.dtype)

