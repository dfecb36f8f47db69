"""What the paged attention kernels share: K/V tile loads, in-register dequantization, the
online-softmax update, the key loop over the page table, and the code-generation variants.

Decode (``pallas_decode``) and prefill (``pallas_prefill``) differ only in which query rows
a program holds and which keys each row may see; everything from the page table to the
(acc, m, l) state is here, once. Scale layouts come from the fp8 policy
(``jfp8kv.kvcache.scale_modes``): these helpers branch on its properties (static scales,
one scale per token, one per group of channels), not on mode names.

Conventions: a tile is ``block_k`` consecutive *tokens*; token t of a sequence is row
``page_table[t // S] * S + t % S`` of the flattened [Hkv, P*S, D] pages, so one 2-D gather
reads a tile spanning any number of pages. Masked tokens read nothing (values and scales
0), get logit -inf and never reach the output. Softmax runs in base 2 (``sm_scale *
log2(e)`` folded into the logits); the state is (acc [M, D] unnormalized, m [M], l [M]) f32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache import fp8, k_transform, rotation, scale_modes

LOG2E = 1.4426950408889634
_VARIANT_NAMES = {"pagepf": "page_prefetch", "asm": "asm", "vmask": "vmask",
                  "rowscale": "rowscale", "nomma": "nomma", "split": "split_loop"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """Code-generation flags of the attention kernels: the numbers do not depend on them,
    the speed does (measured in docs/lab/kernels-notes.md)."""

    page_prefetch: bool = False  # page indices of tile i+1 loaded during tile i ("pagepf")
    asm: bool = False  # fp8 -> f16 by inline PTX, 4 per instruction (GPU only)
    vmask: bool = False  # select on the upcast V tile (f16 transpose, not byte gathers)
    rowscale: bool = False  # per-token scales on the tile rows, not on logits/probabilities
    nomma: bool = False  # decode: q.K and P.V as f32 multiply-reduce over next_pow2(G) rows
    split_loop: bool = False  # full tiles first, in a loop without masks ("split")

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """From the short '+'-joined spelling of bench records, e.g. ``"pagepf+asm"``."""
        parts = set(filter(None, text.split("+")))
        unknown = parts - set(_VARIANT_NAMES)
        if unknown:
            raise ValueError(f"unknown kernel variant {sorted(unknown)}; choose from "
                             f"{list(_VARIANT_NAMES)}")
        return cls(**{_VARIANT_NAMES[p]: True for p in parts})

    def __str__(self) -> str:
        return "+".join(k for k, f in _VARIANT_NAMES.items() if getattr(self, f))

    def resolve(self, cfg: CacheConfig, interpret: bool) -> "Variant":
        """Drop what does not apply: upcast variants on 16/32-bit pages, PTX in interpret."""
        fp8_pages = cfg.is_fp8
        return dataclasses.replace(self, asm=self.asm and fp8_pages and not interpret,
                                   vmask=self.vmask and fp8_pages,
                                   rowscale=self.rowscale and fp8_pages)


def as_variant(v) -> Variant:
    """A ``Variant``, or its short spelling (``Variant.parse``)."""
    return Variant.parse(v) if isinstance(v, str) else v


@dataclasses.dataclass(frozen=True)
class Launch:
    """The Triton launch knobs every kernel on this backend takes: warps per program and
    software-pipeline stages. Each kernel's tuning extends it with its tile sizes."""

    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """How the attention kernels read one layer's K/V, decided by the fp8 policy."""

    mode: scale_modes.ScaleMode
    groups: int  # dynamic scales per (token, head) row: 0 none/static, 1 per token, or D/blk
    cdt: jnp.dtype  # dot operand dtype: f16 for fp8 pages (an exact upcast), else storage
    page_size: int

    @classmethod
    def of(cls, cfg: CacheConfig) -> "KVLayout":
        mode = scale_modes.of(cfg)
        cdt = jnp.dtype(jnp.float16) if cfg.is_fp8 else jnp.dtype(cfg.storage_dtype)
        return cls(mode, mode.groups(cfg.head_dim, cfg.scale_block), cdt, cfg.page_size)

    def operands(self, layer, num_kv_heads: int):
        """(k pages, v pages [Hkv, P*S, D], k scales, v scales in the kernel layout)."""
        d = layer.k.shape[-1]
        return (layer.k.reshape(num_kv_heads, -1, d), layer.v.reshape(num_kv_heads, -1, d),
                self.mode.kernel_scales(layer.k_scale, num_kv_heads),
                self.mode.kernel_scales(layer.v_scale, num_kv_heads))


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cols(n: int):
    """int32 [1, n] column index."""
    return jnp.arange(n, dtype=jnp.int32)[None, :]


def check_dot_tile(name: str, v: int) -> None:
    """ValueError unless ``v`` can be a block dimension of a Triton dot: a power of two
    >= 16."""
    if v < 16 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {v}")


def check_head_dim(d: int) -> None:
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the Pallas kernels, got {d}")


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


def fma_nt(a, b):
    """``dot_nt`` without a matrix unit: f32 products [M, N, K] summed over K (small M)."""
    return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :], axis=2)


def fma_nn(a, b):
    """``dot_nn`` without a matrix unit: f32 products [M, K, N] summed over K (small M)."""
    return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :], axis=1)


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


def load_kv_raw(pages_ref, scale_ref, h, rows, valid, kv: KVLayout, col0: int = 0,
                width: int | None = None):
    """Gather a [BK, D] K or V tile (storage dtype) and its dynamic scales: [BK] f32 (one per
    token), [BK, G] (one per group), else None. Masked rows (and their scales) read as 0.

    pages_ref [Hkv, P*S, D]; rows int32[BK] flat token rows; valid bool[BK], or None for
    a tile of real tokens only (unmasked loads). Every index is
    an integer array (the interpret mode discharges only all-array or all-slice indexers).
    ``col0``/``width`` (static) gather the column chunk [col0, col0 + width) of the rows
    instead (MLA's latent and RoPE parts); with group scales the chunk must be group-aligned
    and gets its own groups' scales [BK, width / group width].
    """
    bk = rows.shape[0]
    full = pages_ref.shape[-1]
    d = full if width is None else width

    def mask(n):  # valid None: every row is a real token (``key_loop``'s full tiles)
        return None if valid is None else jnp.broadcast_to(valid[:, None], (bk, n))

    other = None if valid is None else 0.0
    x = plgpu.load(pages_ref.at[h, rows[:, None], col0 + cols(d)], mask=mask(d), other=other)
    if kv.groups > 1:
        gw = full // kv.groups
        assert col0 % gw == 0 and d % gw == 0, "column chunk not aligned to scale groups"
        ng = d // gw
        idx = rows[:, None] * kv.groups + col0 // gw + cols(ng)  # [BK, ng] into [P*S*G]
        return x, plgpu.load(scale_ref.at[h, idx], mask=mask(ng), other=other)
    if kv.groups == 1:
        return x, plgpu.load(scale_ref.at[h, rows], mask=valid, other=other)
    return x, None


def dequant_kv(x, sc, valid, kv: KVLayout, variant: Variant):
    """(raw tile, scales) -> (tile [BK, D] in ``kv.cdt`` with group scales applied, per-token
    scale [BK] f32 still to apply to logits / probabilities, or None)."""
    if kv.groups > 1:
        x = kv.mode.dequantize(x, sc).astype(kv.cdt)
    elif variant.asm and fp8.is_fp8(x.dtype):
        x = fp8_to_f16_asm(x)
    else:
        x = x.astype(kv.cdt)
    per_token = sc if kv.groups == 1 else None
    if per_token is not None and variant.rowscale:
        # On the tile's rows in its load layout (each thread holds a few rows, so a few scale
        # loads) instead of on columns of the logits / probabilities.
        x, per_token = kv.mode.dequantize(x, per_token).astype(kv.cdt), None
    if variant.vmask and valid is not None:
        # A select on the upcast tile keeps the fp8->f16 conversion in the load layout, so
        # Triton transposes f16 (ldmatrix.trans) instead of gathering single bytes for P.V.
        x = jnp.where(jnp.broadcast_to(valid[:, None], x.shape), x, jnp.zeros((), kv.cdt))
    return x, per_token


def load_kv_tile(pages_ref, scale_ref, h, rows, valid, kv: KVLayout, variant: Variant):
    """``load_kv_raw`` then ``dequant_kv``."""
    x, sc = load_kv_raw(pages_ref, scale_ref, h, rows, valid, kv)
    return dequant_kv(x, sc, valid, kv, variant)


def k_variant(variant: Variant) -> Variant:
    """The variant for K tiles: ``vmask`` concerns the V operand only."""
    return dataclasses.replace(variant, vmask=False)


@dataclasses.dataclass(frozen=True)
class QueryRotation:
    """The queries' side of ``kv_rotation`` inside a kernel: q R, R = diag(s) H / sqrt(d)
    (``kvcache.rotation``: one full Hadamard block, the kernels' head_dim being a power of
    two), rounded to q's dtype as ``k_transform.query_rows`` does. The kernel gets the +-1
    matrix diag(s) H as a bfloat16 [D, D] operand (``matrix``; exact) and multiplies the
    query tile it loads by it, so no separate pass over the queries runs."""

    scale: float  # ``rotation.scale``, rounded to f32 and applied after the product

    @classmethod
    def of(cls, cfg: CacheConfig) -> "QueryRotation | None":
        if not k_transform.rotates(cfg.kv_rotation):
            return None
        check_head_dim(cfg.head_dim)
        return cls(rotation.scale(cfg.head_dim))

    @staticmethod
    def matrix(cfg: CacheConfig):
        """The kernel operand diag(s) H: bfloat16 [head_dim, head_dim] of +-1."""
        return jnp.asarray(rotation.signed_blocks(cfg.head_dim), jnp.bfloat16)

    def apply(self, q, m_ref, q_dtype):
        """q [M, D] f32 (values of ``q_dtype``) -> q R as f32 values of ``q_dtype``: the +-1
        products are exact in q's dtype and summed in f32 (``rotation.rotate_dense``; only
        the order of the f32 sums may differ)."""
        d = q.shape[-1]
        low = jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        cdt = q_dtype if low else jnp.float32
        m = plgpu.load(m_ref.at[jnp.arange(d, dtype=jnp.int32)[:, None], cols(d)])
        y = dot_nn(q.astype(cdt), m.astype(cdt)) * jnp.float32(self.scale)
        return y.astype(q_dtype).astype(jnp.float32)


def prepare_q(q, ks_ref, h, kv: KVLayout):
    """q [M, D] f32 -> dot operand: static K scales [D] folded in per channel."""
    if kv.mode.is_static:
        q = q * plgpu.load(ks_ref.at[h, cols(q.shape[-1])]).astype(jnp.float32)
    return q.astype(kv.cdt)


def scale_output(acc, vs_ref, h, kv: KVLayout):
    """acc [M, D] f32 times static V scales [D] (other modes applied them per tile)."""
    if kv.mode.is_static:
        acc = acc * plgpu.load(vs_ref.at[h, cols(acc.shape[-1])]).astype(jnp.float32)
    return acc


def init_state(rows: int, d: int):
    return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def normalize(acc, l_i):
    """acc / l per row; rows that saw no key (l = 0) stay 0."""
    return acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]


def softmax_step(state, q, k, k_tok, visible, qk_scale, load_v, cdt, nomma: bool = False):
    """One online-softmax update with a K tile [BK, D] (per-token scales ``k_tok`` or None).

    visible: bool broadcastable to [M, BK], or None (every key visible to every row);
    ``load_v() -> (v [BK, D], v_tok or None)`` is
    called after the probabilities exist (so V is dequantized late). ``nomma``: both
    products by f32 multiply-reduce (``fma_nt`` / ``fma_nn``) instead of matrix-unit dots.
    ``q`` and ``k`` may also be equal-length tuples of column chunks of the same rows (MLA's
    latent and RoPE parts): the logits are the sum of the chunks' products.
    """
    acc, m_i, l_i = state
    qs, ks = (q, k) if isinstance(q, tuple) else ((q,), (k,))
    prods = [fma_nt(a, b) if nomma else dot_nt(a, b) for a, b in zip(qs, ks)]
    s = functools.reduce(jnp.add, prods)  # [M, BK] f32
    if k_tok is not None:
        s = s * k_tok[None, :]
    s = s * qk_scale if visible is None else jnp.where(visible, s * qk_scale, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - m_use[:, None])  # masked keys: exp2(-inf) = 0
    l_new = l_i * alpha + jnp.sum(p, axis=1)
    v, v_tok = load_v()
    if v_tok is not None:
        p = p * v_tok[None, :]
    pv = fma_nn(p, v) if nomma else dot_nn(p.astype(cdt), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_new


def key_loop(pt_ref, b, start, end, block_k: int, page_size: int, state, step,
             page_prefetch: bool, full_end=None):
    """Run ``step(tok, valid, rows, state) -> state`` over the tiles of tokens [start, end)
    of batch row b (tok int32[BK], valid tok < end, rows the flat page rows).

    ``full_end`` (<= end, or None): the tiles that lie wholly before it are ones where every
    token is valid and every query row of the program may see every key; they run first, in
    a loop of their own, with ``valid=None`` (the step then needs no masks: unmasked loads, no
    select on the logits), and the remaining tiles after them with masks.

    With ``page_prefetch`` the page indices of tile i+1 are loaded during tile i and carried,
    so the K/V addresses come from a loop-carried value and Triton's pipeliner can keep
    several tiles in flight.
    """
    max_pages = pt_ref.shape[1]
    n_iter = jnp.maximum(end - start + block_k - 1, 0) // block_k
    n_full = 0 if full_end is None else jnp.clip((full_end - start) // block_k, 0, n_iter)

    def tile(i):
        tok = start + i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
        return tok, tok < end

    def pages(i):
        tok, valid = tile(i)
        slot = jnp.minimum(tok // page_size, max_pages - 1)
        return plgpu.load(pt_ref.at[b, slot], mask=valid, other=0)  # [BK]

    def run(i, st, page, masked):
        tok, valid = tile(i)
        return step(tok, valid if masked else None, page * page_size + tok % page_size, st)

    def loops(body):
        st = state
        if full_end is not None:
            st = jax.lax.fori_loop(0, n_full, functools.partial(body, masked=False), st)
        return jax.lax.fori_loop(n_full, n_iter, functools.partial(body, masked=True), st)

    if not page_prefetch:
        return loops(lambda i, st, masked: run(i, st, pages(i), masked))

    def body(i, carry, masked):
        *st, page = carry
        return (*run(i, tuple(st), page, masked), pages(i + 1))

    state = (*state, pages(0))
    *state, _ = loops(body)
    return tuple(state)
