"""The MLA latent cache: what one cached row is, which fp8 modes apply, what it costs.

DeepSeek-V2/V3 attention caches one row per token per layer, ``[c | k_rope]``: the
RMS-normalized compressed KV latent (``kv_lora_rank`` values) followed by the RoPE'd shared
key tail (``qk_rope_head_dim`` values). The pool is the dense layout with one KV head of
head_dim R = kv_lora_rank + qk_rope_head_dim and no V array (``CacheConfig.layout ==
"latent"``; ``cache.KVCache`` keeps the rows in ``k``/``k_scale``). Quantization is the dense
policy applied to that one head (``scale_modes`` / ``fp8``), nothing of its own:

* ``block`` (the default fp8 mode for latents): one fp16 scale per 32 values. Both parts
  must be multiples of 32, so no block straddles the latent/RoPE boundary and the tail is
  quantized with its own blocks (its range differs from the normalized latent's; a block
  scale follows it). DeepSeek-V2-Lite: 576 + 18 x 2 = 612 bytes per token per layer.
* ``token``: one float32 scale per row (latent and tail share it): 576 + 4 bytes.
* ``tensor``/``channel`` (static, calibrated): not supported for latents (ValueError).
* bf16/f16/f32 storage: R x itemsize.

``latent_layout`` declares the MLA families' cache: one ``cache.KVPool`` named "latent".
No K transform (the rows are not per-head keys), no static scales. Under tensor parallelism
the pool is replicated (every query head reads the whole latent row, so each device keeps
every row, as vLLM does per rank; ``models/sharding.py`` splits the query heads): its bytes
per device are one device's.
"""

from __future__ import annotations

from jfp8kv.config import CacheConfig, ModelConfig
from jfp8kv.kvcache import scale_modes
from jfp8kv.kvcache.cache import KVPool
from jfp8kv.kvcache.layout import CacheLayout, CacheRequest, Supports, resolve_scale_mode

LATENT_SCALE_MODES = ("block", "token")
DEFAULT_LATENT_SCALE_MODE = "block"
LATENT_SUPPORTS = Supports(scale_modes=LATENT_SCALE_MODES,
                           default_scale_mode=DEFAULT_LATENT_SCALE_MODE, tensor_parallel=True,
                           prefix_caching=True)


def check_latent_mode(cfg: ModelConfig, storage_dtype: str, scale_mode: str | None,
                      scale_block: int = 32) -> None:
    """Raise a ValueError naming the modes that work when ``scale_mode`` does not apply to
    ``cfg``'s latent rows (static modes; block with a part not a multiple of the block)."""
    mode = scale_modes.get(scale_mode, storage_dtype)
    if mode.is_static:
        raise ValueError(
            f"kv_scale_mode={scale_mode!r} (static, calibrated scales) is not supported for "
            f"the MLA latent cache of {cfg.family}; use one of {list(LATENT_SCALE_MODES)}")
    if mode.per_block:
        parts = {"kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim}
        bad = {k: v for k, v in parts.items() if v % scale_block}
        if bad:
            raise ValueError(
                f"kv_scale_mode='block' needs kv_lora_rank and qk_rope_head_dim divisible by "
                f"{scale_block} (so no scale block straddles the latent and its RoPE tail); "
                f"this model has {bad}; use 'token'")


def cache_shape(cfg: ModelConfig) -> dict[str, int]:
    """``num_layers``, ``num_kv_heads``, ``head_dim`` of the latent pool (for ``CacheConfig``
    and ``bytes_per_token`` with ``layout="latent"``)."""
    return dict(num_layers=cfg.num_layers, num_kv_heads=1, head_dim=cfg.latent_dim)


def latent_layout(cfg: ModelConfig, req: CacheRequest) -> CacheLayout:
    """An MLA family's cache: one latent row per token per layer (ValueError naming what
    works for a scale mode the rows cannot take)."""
    mode = resolve_scale_mode(cfg.family, LATENT_SUPPORTS, req)
    check_latent_mode(cfg, req.storage_dtype, mode)
    ccfg = CacheConfig(**cache_shape(cfg), num_pages=0, page_size=0,
                       storage_dtype=req.storage_dtype, scale_mode=mode,
                       bitcast_pool=req.bitcast_pool, layout="latent",
                       attention_compute=req.attention_compute)
    return CacheLayout(cfg.family, "latent", (KVPool(ccfg, 1, name="latent"),),
                       storage_dtype=req.storage_dtype, scale_mode=mode,
                       supports=LATENT_SUPPORTS)
