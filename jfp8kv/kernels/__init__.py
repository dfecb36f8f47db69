"""Attention and KV-store kernels behind one contract (see ``reference`` for it).

``backend`` is one of:
* ``"reference"``: the pure-jnp twins (any device, any dtype; XLA emulates fp8 on CPU);
* ``"pallas"``: Pallas kernels on an NVIDIA GPU: on Hopper (sm_90) the Mosaic GPU prefill
  kernel where it runs (``mosaic_prefill_runs``: 16-bit pages, fp8 pages with token or
  static scales; faster than Triton in each, docs/lab/kernels-notes.md), with fp8 q.K^T products
  where ``cfg.attention_compute`` is "fp8" (``fp8_products``), Triton for the rest;
* ``"pallas_triton"``: the Pallas Triton kernels only (Ada, or to compare);
* ``"pallas_interpret"``: the same Pallas kernels in interpret mode (CPU tests).

MLA latent caches: ``store_latent`` and ``latent_attention`` (``mla_reference``'s contract;
Pallas backends run ``pallas_mla`` for attention, and ``pallas`` on Hopper the Mosaic GPU
decode kernel where it runs (``mosaic_mla_runs``); the jnp store for the rows).

MoE experts: ``grouped_matmul`` (``jax.lax.ragged_dot``'s meaning; Pallas backends run
``pallas_gmm``, which does only the routed rows' work where XLA's GPU ragged_dot is dense).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jfp8kv.config import CacheConfig
from jfp8kv.kernels import mla_reference, prologue, reference
from jfp8kv.kernels.mla_reference import LatentPages, LatentQueries, LatentRows
from jfp8kv.kernels.prologue import QKPrologue
from jfp8kv.kernels.reference import (NewRows, PageTables, Positions, Queries, SeqLens, Slots,
                                      StatRows, StatsRow)
from jfp8kv.kvcache import k_transform
from jfp8kv.kvcache.cache import LayerKV

log = logging.getLogger(__name__)
BACKENDS = ("reference", "pallas", "pallas_triton", "pallas_interpret")
LatentOut = Float[Array, "b t heads value_dim"]


def _check_pool(cfg: CacheConfig, backend: str) -> None:
    if cfg.bitcast_pool and backend != "reference":
        raise ValueError(f"backend {backend!r} needs float page arrays: build the cache with "
                         "bitcast_pool=False (integer pools are for the reference backend)")


def store_kv(layer: LayerKV, k_new: NewRows, v_new: NewRows, slots: Slots, cfg: CacheConfig,
             backend: str = "reference", stat_rows: bool = False
             ) -> tuple[LayerKV, StatsRow | StatRows]:
    """Store post-RoPE rows; K goes through ``cfg.kv_rotation`` first (``k_transform``).
    ``stat_rows``: the stats as partial rows [R, 6] (``cache.reduce_stat_rows`` gives the
    row), so that a model reduces every layer's at once."""
    k_new = k_transform.store_rows(k_new, layer.k_shift, cfg)
    if backend == "reference":
        layer, st = reference.store_kv(layer, k_new, v_new, slots, cfg)
        return layer, st[None] if stat_rows else st
    _check_pool(cfg, backend)
    from jfp8kv.kernels import pallas_store

    return pallas_store.store_kv(layer, k_new, v_new, slots, cfg, stat_rows=stat_rows,
                                 interpret=backend == "pallas_interpret")


def prologue_store_kv(q, k_new: NewRows, v_new: NewRows, pro: QKPrologue, layer: LayerKV,
                      slots: Slots, cfg: CacheConfig, backend: str = "reference"):
    """The new rows' q/k norm and RoPE (``prologue.apply``), then ``store_kv``: q [N, H, D]
    and raw k, v [N, Hkv, D] -> (q', layer, stats rows [R, 6]). The rows are partial
    (``cache.reduce_stat_rows`` gives ``store_kv``'s stats row), so that a model reduces
    every layer's at once. Pallas backends fuse the prologue into the store kernel
    (``pallas_store.prologue_store``) when K is stored as computed (``kv_rotation ==
    "none"``); otherwise, and on "reference", the steps run one by one."""
    if backend != "reference" and cfg.kv_rotation == "none":
        _check_pool(cfg, backend)
        from jfp8kv.kernels import pallas_store

        qkv = jnp.concatenate([q, k_new, v_new], axis=1)  # XLA's merged QKV output, unsliced
        return pallas_store.prologue_store(qkv, pro, layer, slots, cfg, stat_rows=True,
                                           interpret=backend == "pallas_interpret")
    q, k_new = prologue.apply(pro, q, k_new)
    layer, rows = store_kv(layer, k_new, v_new, slots, cfg, backend, stat_rows=True)
    return q, layer, rows


def paged_attention(q: Queries, layer: LayerKV, page_tables: PageTables, seq_lens: SeqLens,
                    q_positions: Positions, cfg: CacheConfig, sm_scale: float,
                    backend: str = "reference") -> Queries:
    """q [B, T, H, D]; T == 1 routes to the decode kernel on Pallas backends. The queries
    are taken into the basis K is stored in (``k_transform.query_rows``): by the Pallas
    kernels themselves (no extra pass over q), before ``reference`` otherwise."""
    if backend == "reference":
        return reference.paged_attention(k_transform.query_rows(q, cfg), layer, page_tables,
                                         seq_lens, q_positions, cfg, sm_scale)
    _check_pool(cfg, backend)
    interpret = backend == "pallas_interpret"
    if q.shape[1] == 1:
        from jfp8kv.kernels import pallas_decode

        out = pallas_decode.decode_attention(q[:, 0], layer, page_tables, seq_lens, cfg,
                                             sm_scale, interpret=interpret)
        return out[:, None]
    if backend == "pallas" and mosaic_prefill_runs(cfg, q.shape[2]):
        from jfp8kv.kernels import mosaic_prefill

        tuning = (mosaic_prefill.MosaicPrefillTuning(compute="fp8")
                  if cfg.attention_compute == "fp8" else None)
        return mosaic_prefill.prefill_attention(q, layer, page_tables, seq_lens, q_positions,
                                                cfg, sm_scale, tuning=tuning)
    from jfp8kv.kernels import pallas_prefill

    return pallas_prefill.prefill_attention(q, layer, page_tables, seq_lens, q_positions, cfg,
                                            sm_scale, interpret=interpret)


def attention_compute(storage_dtype: str, requested: str) -> str:
    """The prefill products a cache of ``storage_dtype`` runs for ``requested``
    (``CacheOptions.fp8_attention_compute``): as asked on fp8 pages; 16-bit pages keep
    "dequant" (an fp8-only option, ignored with a warning, as the builder does for the
    others)."""
    if requested == "fp8" and not str(storage_dtype).startswith("float8"):
        log.warning("fp8_attention_compute='fp8' ignored: the KV cache stores %s", storage_dtype)
        return "dequant"
    return requested


def check_kv_cache(cfg: CacheConfig) -> None:
    """At engine build: ValueError where ``cfg.attention_compute`` "fp8" products cannot run
    on its pages (``fp8_products.check_config``)."""
    if cfg.attention_compute == "fp8":
        from jfp8kv.kernels import fp8_products

        fp8_products.check_config(cfg)


def mosaic_prefill_runs(cfg: CacheConfig, num_heads: int) -> bool:
    """The Mosaic GPU prefill kernel takes this call on the ``pallas`` backend: a Hopper GPU
    (sm_90: wgmma, TMA), jax's Mosaic GPU module importable (it needs absl-py) and a
    configuration ``mosaic_prefill`` runs (bf16/f16 pages; fp8 with token, tensor or channel
    scales). On the H200 it measured faster than the Triton kernel at 8k x 8k and 2k after
    4k (bench/results/kernels-mosaic-h200.json): bf16 1.5-1.6x, fp8 tensor 1.1-1.2x, fp8
    token 0.95-1.06x (two runs; parity within their noise at 2k after 4k)."""
    if not is_hopper():
        return False
    from jfp8kv.kernels import mosaic_prefill

    try:
        mosaic_prefill.load_plgpu()
        mosaic_prefill.check_supported(cfg, num_heads)
    except (ImportError, ValueError):
        return False
    return True


def mosaic_mla_runs(cfg: CacheConfig, num_heads: int, value_dim: int) -> bool:
    """The Mosaic GPU MLA decode kernel takes a decode call (T == 1) on the ``pallas``
    backend: a Hopper GPU, jax's Mosaic GPU module importable, and a configuration
    ``mosaic_mla`` runs (latent rows of 128, 256 or 512 + 64; bf16/f16 pages, fp8 with token or
    block scales). On the H200 it read 1.3x (bf16), 1.6x (fp8 token) and 2.0x (fp8 block)
    as fast as the Triton kernel at DeepSeek-V2-Lite's decode shapes
    (bench/results/mla-kernels-mosaic-h200.json)."""
    if not is_hopper():
        return False
    from jfp8kv.kernels import mosaic_mla

    try:
        mosaic_mla.load_plgpu()
        mosaic_mla.check_supported(cfg, num_heads, value_dim)
    except (ImportError, ValueError):
        return False
    return True


def is_hopper() -> bool:
    """The default GPU is an sm_90 (Hopper) part (False without a GPU)."""
    from jfp8kv.kernels.pallas_store import device_capability

    return str(device_capability(interpret=False)).split(".")[0] == "9"


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {list(BACKENDS)}")


def check_latent_cache(cfg: CacheConfig, value_dim: int, backend: str) -> None:
    """At engine build: ValueError now, not at the first trace, when ``backend`` cannot run
    this latent cache (``pallas_mla.check_shapes``: power-of-two widths, block/token scales)."""
    check_backend(backend)
    if backend != "reference":
        from jfp8kv.kernels import pallas_mla

        pallas_mla.check_shapes(cfg, cfg.head_dim, value_dim)


def store_latent(pages: LatentPages, scale, rows: LatentRows, slots: Slots, cfg: CacheConfig,
                 backend: str = "reference") -> tuple[LatentPages, object, StatsRow]:
    """MLA latent rows [N, R] into one layer's latent pool (``mla_reference.store_latent``'s
    contract). Every backend runs the jnp store (a Pallas latent store is open)."""
    check_backend(backend)
    return mla_reference.store_latent(pages, scale, rows, slots, cfg)


def latent_attention(q: LatentQueries, pages: LatentPages, scale, page_tables: PageTables,
                     seq_lens: SeqLens, q_positions: Positions, cfg: CacheConfig,
                     sm_scale: float, value_dim: int, backend: str = "reference"
                     ) -> LatentOut:
    """MLA attention over latent rows (``mla_reference.latent_attention``'s contract): q
    [B, T, H, R] absorbed -> [B, T, H, value_dim]. Pallas backends run ``pallas_mla`` for
    prefill/extend, and for decode (T == 1) where ``mosaic_mla_runs`` does not send it to
    the Mosaic GPU kernel."""
    check_backend(backend)
    if backend == "reference":
        return mla_reference.latent_attention(q, pages, scale, page_tables, seq_lens,
                                              q_positions, cfg, sm_scale, value_dim)
    _check_pool(cfg, backend)
    if backend == "pallas" and q.shape[1] == 1 and mosaic_mla_runs(cfg, q.shape[2], value_dim):
        from jfp8kv.kernels import mosaic_mla

        return mosaic_mla.latent_attention(q, pages, scale, page_tables, seq_lens,
                                           q_positions, cfg, sm_scale, value_dim)
    from jfp8kv.kernels import pallas_mla

    return pallas_mla.latent_attention(q, pages, scale, page_tables, seq_lens, q_positions,
                                       cfg, sm_scale, value_dim,
                                       interpret=backend == "pallas_interpret")


def grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=None,
                   backend: str = "reference"):
    """lhs [M, K] x rhs [E, K, N] by row groups ``group_sizes`` int32[E] -> [M, N]:
    ``jax.lax.ragged_dot`` on "reference", ``pallas_gmm.gmm`` on the Pallas backends."""
    check_backend(backend)
    if backend == "reference":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                                  preferred_element_type=preferred_element_type)
    from jfp8kv.kernels import pallas_gmm

    return pallas_gmm.gmm(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                          interpret=backend == "pallas_interpret")
