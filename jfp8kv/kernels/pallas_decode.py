"""Paged decode attention on the Pallas Triton backend: split-K, GQA-grouped, fp8-aware.

One program per (batch row, KV head, split). All ``G = num_heads // num_kv_heads`` query
heads of a KV head share the program, so every K/V byte is read once per step. The q block
is padded to ``Gp = max(16, next_pow2(G))`` rows (Triton's ``dot`` needs M >= 16); padded
rows are masked on load and never stored. With ``Variant.nomma`` (prepared, not a default)
q.K and P.V are f32 multiply-reduce products over ``next_pow2(G)`` rows, no matrix unit.

The key loop, tile gathers, masking and online softmax are ``tiles``' (shared with
prefill): tokens at or past ``seq_len`` are masked, so whatever an unused page holds (NaN
included) never reaches the output. Each sequence's own length is cut into ``num_splits``
tile-aligned parts; a split whose range starts past ``seq_len`` runs no iteration; an
empty batch slot (seq_len 0) returns zeros.

Dequantization happens in registers (the numerics contract of ``reference.py``):
* fp8 tiles are upcast to float16 (exact for e4m3 and e5m2) and the dots run in f16 with
  f32 accumulation. q is cast to f16 too; |q * k_scale| must stay below 65504 (q is
  post-RoPE, and static scales are ~amax/fmax, so this is not a practical limit);
* static scales (tensor/channel): the K scale [D] multiplies q per channel, the V scale
  the output;
* one scale per token: K scales multiply the logits, V scales the probabilities (per key);
  with ``Variant.rowscale`` they multiply the upcast tile's rows instead (in f32, rounded
  to f16: the dequantized values must stay below 65504);
* one scale per group of channels (block): the tile is multiplied by its fp16 scales
  before the dot;
* bf16/f16 pages: dots in the storage dtype; f32 pages: IEEE f32 dots.

With more than one split, each split writes (unnormalized acc [Gp, D], running max m,
sum l) and a log-sum-exp merge in plain jnp combines them; with one split the kernel
writes the final output. Measurements and history: docs/lab/kernels-notes.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.config import CacheConfig
from jfp8kv.kernels import device
from jfp8kv.kernels.tiles import (LOG2E, KVLayout, Launch, QueryRotation, Variant, as_variant,
                                  check_dot_tile, check_head_dim, cols, dequant_kv, init_state,
                                  k_variant, key_loop, load_kv_raw, next_pow2, normalize,
                                  prepare_q, scale_output, softmax_step)
from jfp8kv.kvcache.cache import LayerKV

@dataclasses.dataclass(frozen=True)
class SplitTuning(Launch):
    """Knobs of a split-key attention launch (dense decode here, MLA in ``pallas_mla``):
    ``block_k`` keys per tile; ``num_splits=0`` picks splits so the grid reaches
    ``target_programs`` (``choose_splits``); ``variant``: a ``tiles.Variant`` (its short
    spelling, e.g. "pagepf+asm", is accepted)."""

    block_k: int = 64
    num_splits: int = 0
    target_programs: int = dataclasses.field(default_factory=lambda: 4 * device.num_sms())
    variant: Variant = Variant()

    def __post_init__(self):
        object.__setattr__(self, "variant", as_variant(self.variant))


@dataclasses.dataclass(frozen=True)
class DecodeTuning(SplitTuning):
    """``unsplit_programs=(lo, hi)``: no split when the unsplit grid's batch * kv_heads
    programs lie in [lo, hi] (one resident wave that already holds at least ``lo``
    programs: the combine pass would cost more than it balances); (0, 0): off."""

    unsplit_programs: tuple[int, int] = (0, 0)


def one_wave() -> tuple[int, int]:
    """One wave without splits: from 1.5 programs per SM up to the three CTAs an SM holds at
    three stages (72-76 KB of shared memory each); measured in docs/lab/kernels-notes.md."""
    sms = device.num_sms()
    return (3 * sms // 2, 3 * sms)


def default_tuning(cfg: CacheConfig) -> DecodeTuning:
    """The measured best per storage family (see docs/lab/kernels-notes.md); program
    counts per SM of the card it runs on (``kernels.device``)."""
    if cfg.is_fp8:  # head_dim 256: half the tile keeps registers and shared memory in bounds
        bk = 128 if cfg.head_dim <= 128 else 64
        return DecodeTuning(block_k=bk, num_warps=4, num_stages=3,
                            variant=Variant(page_prefetch=True, asm=True),
                            unsplit_programs=one_wave())
    return DecodeTuning(block_k=64, num_warps=4, num_stages=3,
                        variant=Variant(page_prefetch=True), unsplit_programs=one_wave())


def _decode_kernel(len_ref, pt_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, *out_refs,
                   sm_scale, num_splits, num_groups, kv, block_k, split, variant, rot):
    # len_ref [B] i32; pt_ref [B, MP] i32; q_ref [B, Hkv, G, D]; k_ref/v_ref [Hkv, P*S, D]
    # ks_ref/vs_ref: the policy's kernel layout (static [Hkv, D] | dynamic [Hkv, P*S*G]);
    # with ``rot`` (kv_rotation rotates K) its matrix [D, D] comes first among out_refs
    if rot is not None:
        rot_ref, *out_refs = out_refs
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = q_ref.shape[-1]
    # Triton's dot needs M >= 16; the multiply-reduce products need only a power of two.
    gp = next_pow2(num_groups) if variant.nomma else max(16, next_pow2(num_groups))
    g_idx = jnp.arange(gp, dtype=jnp.int32)
    g_ok = g_idx < num_groups

    seq_len = len_ref[b]
    tokens_per_split = ((seq_len + num_splits - 1) // num_splits + block_k - 1) // block_k * block_k
    start = sp * tokens_per_split
    end = jnp.minimum(seq_len, start + tokens_per_split)

    out_mask = jnp.broadcast_to(g_ok[:, None], (gp, d))
    q = plgpu.load(q_ref.at[b, h, g_idx[:, None], cols(d)], mask=out_mask,
                   other=0.0).astype(jnp.float32)  # [Gp, D]
    if rot is not None:
        q = rot.apply(q, rot_ref, q_ref.dtype)
    q = prepare_q(q, ks_ref, h, kv)
    if variant.nomma:
        q = q.astype(jnp.float32)  # f16 (exact for fp8 pages) -> the f32 products
    qk_scale = sm_scale * LOG2E
    kvar = k_variant(variant)

    def step(tok, valid, rows, state):
        k_raw = load_kv_raw(k_ref, ks_ref, h, rows, valid, kv)
        v_raw = load_kv_raw(v_ref, vs_ref, h, rows, valid, kv)
        k, k_tok = dequant_kv(*k_raw, valid, kv, kvar)
        return softmax_step(state, q, k, k_tok, None if valid is None else valid[None, :],
                            qk_scale, lambda: dequant_kv(*v_raw, valid, kv, variant), kv.cdt,
                            variant.nomma)

    acc, m_i, l_i = key_loop(pt_ref, b, start, end, block_k, kv.page_size, init_state(gp, d),
                             step, variant.page_prefetch, end if variant.split_loop else None)
    acc = scale_output(acc, vs_ref, h, kv)
    if not split:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[b, h, g_idx[:, None], cols(d)],
                    normalize(acc, l_i).astype(o_ref.dtype), mask=out_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[b, h, sp, g_idx[:, None], cols(d)], acc, mask=out_mask)
        plgpu.store(m_ref.at[b, h, sp, g_idx], m_i, mask=g_ok)
        plgpu.store(l_ref.at[b, h, sp, g_idx], l_i, mask=g_ok)


def choose_splits(batch: int, num_kv_heads: int, max_tokens: int, tuning: DecodeTuning) -> int:
    """Splits so that batch * kv_heads * splits reaches ``target_programs``; each split keeps
    at least two tiles of work. One split when the pairs fall in ``tuning.unsplit_programs``."""
    if tuning.num_splits:
        return tuning.num_splits
    pairs = batch * num_kv_heads
    lo, hi = tuning.unsplit_programs
    if lo and lo <= pairs <= hi:
        return 1
    ns = 1
    while pairs * ns < tuning.target_programs and max_tokens // (2 * ns) >= 2 * tuning.block_k:
        ns *= 2
    return ns


def split_state_shapes(lead: tuple, rows: int, width: int):
    """``out_shape`` of a split kernel's partial state, merged by ``combine_splits``: the
    unnormalized output [*lead, rows, width] and the running max and sum [*lead, rows], f32."""
    return (jax.ShapeDtypeStruct((*lead, rows, width), jnp.float32),
            jax.ShapeDtypeStruct((*lead, rows), jnp.float32),
            jax.ShapeDtypeStruct((*lead, rows), jnp.float32))


def triton_call(kernel, *, grid, out_shape, tuning, interpret: bool, name: str):
    """``pl.pallas_call`` of a Triton kernel with ``tuning``'s warps and pipeline stages."""
    return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                          compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                                               num_stages=tuning.num_stages))


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
    """q [B, H, D] -> [B, H, D] (q's dtype); the contract of ``reference.decode_attention``
    on ``k_transform.query_rows(q)``: when ``cfg.kv_rotation`` rotates K, the kernel rotates
    the queries itself (``tiles.QueryRotation``), so q is given in the model's basis.

    Static: cfg, sm_scale, interpret, tuning. Nothing is donated.
    """
    tuning = tuning or default_tuning(cfg)
    b, nh, d = q.shape
    hkv, s = cfg.num_kv_heads, cfg.page_size
    g = nh // hkv
    max_pages = page_tables.shape[1]
    check_dot_tile("block_k", tuning.block_k)
    check_head_dim(d)
    kv = KVLayout.of(cfg)
    rot = QueryRotation.of(cfg)
    ns = choose_splits(b, hkv, max_pages * s, tuning)
    qg = q.reshape(b, hkv, g, d)
    split = ns > 1
    out_shape = (split_state_shapes((b, hkv, ns), g, d) if split
                 else (jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),))
    kernel = functools.partial(
        _decode_kernel, sm_scale=float(sm_scale), num_splits=ns, num_groups=g, kv=kv,
        block_k=tuning.block_k, split=split, variant=tuning.variant.resolve(cfg, interpret),
        rot=rot)
    outs = triton_call(kernel, grid=(b, hkv, ns), out_shape=out_shape, tuning=tuning,
                       interpret=interpret, name="jfp8kv_paged_decode")(seq_lens.astype(jnp.int32), page_tables.astype(jnp.int32), qg,
      *kv.operands(layer, hkv), *([] if rot is None else [QueryRotation.matrix(cfg)]))
    if split:
        out = combine_splits(*outs)
    else:
        out = outs[0]
    return out.reshape(b, nh, d).astype(q.dtype)

