"""DeepSeek-V4's cache pools and their byte model: one function per pool gives its bytes,
and both the planner (``plan``) and the allocation (``init_pools``) read them.

Pools, per layer (hd = head_dim, dI = index_head_dim, m = the layer's compress ratio,
W = sliding_window; a page covers ``page_size`` source tokens, a multiple of every m):

    window      [slots, W, hd]          every layer; the last W rows of each sequence slot
    compressed  [pages, page/m, hd]     CSA and HCA layers; one entry per m source tokens
    indexer     [pages, page/m, dI]     CSA layers; the lightning indexer's keys, bf16 always
    state       per slot, float32       CSA / HCA: the compressor's open-window buffer and
                                        overlap half (and the indexer's), accumulators

With ``fp8_e4m3`` the window and compressed pools hold e4m3 rows with one float16 scale per
32 channels (``scale_modes.BLOCK``: 1 + 2/32 = 1.0625 bytes per element against bf16's 2);
the two are quantized alike because one gather reads both. The indexer stays bf16 (its
error would move top-k routing, not a value) and the state float32 (it is not storage).
The window and state pools are per sequence slot (``max_num_seqs``), the others per page.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import jax.numpy as jnp

from jfp8kv.config import ModelConfig
from jfp8kv.config_v4 import V4_FAMILY
from jfp8kv.kvcache import fp8, scale_modes

POOLED_DTYPES = ("bfloat16", "float8_e4m3fn")
_ALIASES = {"auto": "bfloat16", "bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn",
            "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}
STATE_DTYPE = "float32"
INDEXER_DTYPE = "bfloat16"


def check_fp8_device(device) -> None:
    """ValueError unless ``device`` can hold fp8 pools: the CPU (emulated, for tests) or a
    GPU of compute capability 8.9 or newer (native e4m3)."""
    if getattr(device, "platform", "cpu") != "gpu":
        return
    cc = str(getattr(device, "compute_capability", "0"))
    if tuple(int(x) for x in cc.split(".")[:2]) < (8, 9):
        raise ValueError(f"--kv-cache-dtype fp8_e4m3 for DeepSeek-V4 needs native fp8 "
                         f"(compute capability 8.9+: Ada, Hopper, Blackwell); this GPU is "
                         f"{cc}; use --kv-cache-dtype auto (bf16 pools)")


@dataclasses.dataclass(frozen=True)
class V4PoolSpec:
    """The pools' shapes of one model and storage choice. Build with ``from_model``."""

    window_layers: int  # every layer
    compressed_ratios: tuple[int, ...]  # m per CSA / HCA layer
    indexer_ratios: tuple[int, ...]  # m per CSA layer
    head_dim: int
    index_head_dim: int
    sliding_window: int
    page_size: int
    storage_dtype: str  # of the window and compressed pools

    @classmethod
    def from_model(cls, cfg: ModelConfig, kv_cache_dtype: str = "auto",
                   page_size: int = 256) -> "V4PoolSpec":
        """The spec of ``cfg``'s pools. ValueError (naming what works) for another family,
        an unknown dtype, head_dim not a multiple of 32 under fp8, or a page size that is
        not a multiple of every compress ratio."""
        if cfg.family != V4_FAMILY or cfg.v4 is None:
            raise ValueError(f"window / compressed / indexer pools are DeepSeek-V4's; "
                             f"{cfg.family} uses the paged KV cache (jfp8kv.kvcache.cache)")
        if kv_cache_dtype not in _ALIASES:
            raise ValueError(f"DeepSeek-V4 pools support --kv-cache-dtype auto / bfloat16 / "
                             f"fp8_e4m3, not {kv_cache_dtype!r}")
        storage = _ALIASES[kv_cache_dtype]
        if fp8.is_fp8(storage):
            scale_modes.BLOCK.validate(cfg.head_dim)
        v4 = cfg.v4
        ratios = tuple(r for r in v4.compress_ratios if r)
        if any(page_size % r for r in ratios):
            raise ValueError(f"page_size={page_size} must be a multiple of every compress "
                             f"ratio {sorted(set(ratios))}; use {max(ratios, default=1) * 2}")
        return cls(cfg.num_layers, ratios,
                   tuple(r for r in v4.compress_ratios if r == v4.csa_ratio), cfg.head_dim,
                   v4.index_head_dim, v4.sliding_window, page_size, storage)

    @property
    def is_fp8(self) -> bool:
        return fp8.is_fp8(self.storage_dtype)

    def row_bytes(self) -> int:
        """Bytes of one window or compressed row: hd elements plus, under fp8, hd/32 fp16
        scales (``scale_modes.BLOCK``)."""
        mode = scale_modes.get("block" if self.is_fp8 else None, self.storage_dtype)
        return (self.head_dim * jnp.dtype(self.storage_dtype).itemsize
                + mode.scale_bytes_per_token_head(self.head_dim))

    def window_bytes_per_slot(self) -> int:
        return self.window_layers * self.sliding_window * self.row_bytes()

    def compressed_bytes_per_page(self) -> int:
        return sum(self.page_size // m for m in self.compressed_ratios) * self.row_bytes()

    def indexer_bytes_per_page(self) -> int:
        item = jnp.dtype(INDEXER_DTYPE).itemsize
        return sum(self.page_size // m for m in self.indexer_ratios) * self.index_head_dim * item

    def state_bytes_per_slot(self) -> int:
        """float32 compressor state: buffer (kv, gate) and, with overlap, the previous
        window's half (kv, gate), for each compressor (CSA: main + indexer)."""
        item = jnp.dtype(STATE_DTYPE).itemsize
        csa = sum(m * (2 * 2 * d + 2 * d) for m in self.indexer_ratios
                  for d in (self.head_dim, self.index_head_dim))
        hca = sum(2 * m * self.head_dim for m in self.compressed_ratios
                  if m not in self.indexer_ratios)
        return (csa + hca) * item

    def bytes_per_page(self) -> int:
        return self.compressed_bytes_per_page() + self.indexer_bytes_per_page()

    def bytes_per_slot(self) -> int:
        return self.window_bytes_per_slot() + self.state_bytes_per_slot()

    def bytes_per_token(self) -> Fraction:
        """Exact bytes each cached source token adds (the per-page pools)."""
        return Fraction(self.bytes_per_page(), self.page_size)

    def cache_info(self, num_pages: int, slots: int) -> dict:
        """Per-pool bytes of a ``num_pages`` x ``slots`` allocation (what ``init_pools``
        allocates) and the tokens the pages hold."""
        return {"window": slots * self.window_bytes_per_slot(),
                "compressed": num_pages * self.compressed_bytes_per_page(),
                "indexer": num_pages * self.indexer_bytes_per_page(),
                "state": slots * self.state_bytes_per_slot(),
                "bytes_per_token": self.bytes_per_token(),
                "max_tokens": (num_pages - 1) * self.page_size}


def plan(spec: V4PoolSpec, budget: int, slots: int) -> int:
    """Pages that fit ``budget`` bytes after ``slots`` sequence slots' window and state
    pools (page 0 is the padding sink). ValueError when fewer than 2 pages fit."""
    left = budget - slots * spec.bytes_per_slot()
    pages = left // spec.bytes_per_page() if left > 0 else 0
    if pages < 2:
        raise ValueError(f"a {budget}-byte KV budget does not fit {slots} DeepSeek-V4 "
                         f"sequence slots ({spec.bytes_per_slot()} bytes each) and 2 pages "
                         f"({spec.bytes_per_page()} bytes each); lower max_num_seqs or raise "
                         "the KV memory")
    return int(pages)


def init_pools(spec: V4PoolSpec, num_pages: int, slots: int) -> dict:
    """Zeroed pools: {"window", "compressed", "indexer", "state"} lists of arrays (one per
    layer that has the pool; fp8 pools as (values, float16 scales) pairs), whose bytes are
    exactly ``cache_info``'s."""
    hd, d_i, s = spec.head_dim, spec.index_head_dim, spec.storage_dtype

    def rows(lead: tuple[int, ...]):
        v = jnp.zeros(lead + (hd,), s)
        return (v, jnp.ones(lead + (hd // 32,), "float16")) if spec.is_fp8 else (v,)

    f32 = STATE_DTYPE
    state = []
    for m in spec.compressed_ratios:
        if m in spec.indexer_ratios:
            for d in (hd, d_i):
                state += [jnp.zeros((slots, m, 2 * d), f32) for _ in range(2)]
                state += [jnp.zeros((slots, m, d), f32) for _ in range(2)]
        else:
            state += [jnp.zeros((slots, m, hd), f32) for _ in range(2)]
    return {"window": [rows((slots, spec.sliding_window)) for _ in range(spec.window_layers)],
            "compressed": [rows((num_pages, spec.page_size // m))
                           for m in spec.compressed_ratios],
            "indexer": [(jnp.zeros((num_pages, spec.page_size // m, d_i), INDEXER_DTYPE),)
                        for m in spec.indexer_ratios],
            "state": [(a,) for a in state]}


def pool_nbytes(pools: dict) -> dict[str, int]:
    """Bytes actually allocated per pool."""
    return {k: sum(a.nbytes for layer in v for a in layer) for k, v in pools.items()}


def store_rows(x, storage_dtype: str):
    """Rows x [..., hd] as the window / compressed pools store them: (values, float16
    scales [..., hd/32]) under fp8 (``scale_modes.BLOCK``), (values, None) otherwise."""
    if not fp8.is_fp8(storage_dtype):
        return x.astype(storage_dtype), None
    mode = scale_modes.BLOCK
    g, w = mode.group_view(x.shape[-1], 32)
    q, scales, _ = mode.quantize(x.reshape(x.shape[:-1] + (g, w)), None,
                                 jnp.dtype(storage_dtype))
    return q.reshape(x.shape), scales


def read_rows(values, scales, dtype):
    """The rows ``store_rows`` stored, in the compute ``dtype``."""
    if scales is None:
        return values.astype(dtype)
    return scale_modes.BLOCK.dequantize(values, scales).astype(dtype)
