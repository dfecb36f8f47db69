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
``v4_layout`` declares them as the family's cache layout (``layout``): ``CompressedPool``
and ``IndexerPool`` paged, ``WindowPool`` and ``CompressorPool`` in slots.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import jax.numpy as jnp

from jfp8kv.config import ModelConfig
from jfp8kv.config_v4 import V4_FAMILY
from jfp8kv.kvcache import fp8, scale_modes
from jfp8kv.kvcache.layout import (CacheLayout, CacheRequest, PagedPool, SlotPool, Supports,
                                   resolve_scale_mode)

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


def _rows(lead: tuple[int, ...], spec: V4PoolSpec) -> tuple:
    """Zeroed rows [*lead, hd] in the pools' storage: (values, float16 scales) under fp8."""
    v = jnp.zeros(lead + (spec.head_dim,), spec.storage_dtype)
    return (v, jnp.ones(lead + (spec.head_dim // 32,), "float16")) if spec.is_fp8 else (v,)


@dataclasses.dataclass(frozen=True)
class WindowPool(SlotPool):
    """Every layer's window ring: [slots, W, hd] rows (fp8 with block scales, or bf16)."""

    spec: V4PoolSpec
    name = "window"

    def bytes_per_slot(self) -> int:
        return self.spec.window_bytes_per_slot()

    def init(self, num_slots: int) -> list:
        return [_rows((num_slots, self.spec.sliding_window), self.spec)
                for _ in range(self.spec.window_layers)]

    def info(self) -> dict:
        return dict(dtype=self.spec.storage_dtype, layers=self.spec.window_layers)


@dataclasses.dataclass(frozen=True)
class CompressorPool(SlotPool):
    """The compressors' open-window buffers and overlap halves, float32 (``state_layout``:
    CSA layers 8 arrays, main then indexer compressor; HCA layers 2)."""

    spec: V4PoolSpec
    name = "compressor"

    def bytes_per_slot(self) -> int:
        return self.spec.state_bytes_per_slot()

    def init(self, num_slots: int) -> list:
        hd, d_i, f32 = self.spec.head_dim, self.spec.index_head_dim, STATE_DTYPE
        state = []
        for m in self.spec.compressed_ratios:
            if m in self.spec.indexer_ratios:
                for d in (hd, d_i):
                    state += [(jnp.zeros((num_slots, m, 2 * d), f32),) for _ in range(2)]
                    state += [(jnp.zeros((num_slots, m, d), f32),) for _ in range(2)]
            else:
                state += [(jnp.zeros((num_slots, m, hd), f32),) for _ in range(2)]
        return state

    def info(self) -> dict:
        return dict(dtype=STATE_DTYPE)


@dataclasses.dataclass(frozen=True)
class CompressedPool(PagedPool):
    """Each CSA / HCA layer's compressed entries: [pages, page/m, hd] rows."""

    spec: V4PoolSpec
    name = "compressed"

    def bytes_per_page(self, page_size: int) -> int:
        return dataclasses.replace(self.spec, page_size=page_size).compressed_bytes_per_page()

    def init(self, num_pages: int, page_size: int) -> list:
        return [_rows((num_pages, page_size // m), self.spec)
                for m in self.spec.compressed_ratios]

    def info(self) -> dict:
        return dict(dtype=self.spec.storage_dtype, layers=len(self.spec.compressed_ratios))


@dataclasses.dataclass(frozen=True)
class IndexerPool(PagedPool):
    """Each CSA layer's lightning-indexer keys: [pages, page/m, dI], bf16 always."""

    spec: V4PoolSpec
    name = "indexer"

    def bytes_per_page(self, page_size: int) -> int:
        return dataclasses.replace(self.spec, page_size=page_size).indexer_bytes_per_page()

    def init(self, num_pages: int, page_size: int) -> list:
        return [(jnp.zeros((num_pages, page_size // m, self.spec.index_head_dim),
                           INDEXER_DTYPE),) for m in self.spec.indexer_ratios]

    def info(self) -> dict:
        return dict(dtype=INDEXER_DTYPE, layers=len(self.spec.indexer_ratios))


# Block scales only (computed at store time), e4m3 only, no K transform. Under tensor
# parallelism every pool is replicated (one KV head that all query heads read; the indexer
# and compressors run whole on every device): bytes per device are one device's. Prefix
# caching: a page boundary is a window boundary for every compress ratio (``page_multiple``),
# so the pages before it hold every entry a window closed there; the window ring and the
# compressor state after it come from a state snapshot (``snapshots.py``).
V4_SUPPORTS = Supports(
    scale_modes=("block",), default_scale_mode="block", fp8_dtypes=("float8_e4m3fn",),
    tensor_parallel=True, prefix_caching=True)


def v4_layout(cfg: ModelConfig, req: CacheRequest) -> CacheLayout:
    """DeepSeek-V4's cache: compressed and indexer entries in pages, the window ring and
    compressor state in sequence slots. A page holds whole compressed windows of every
    ratio (``page_multiple``); with fp8 the window and compressed rows are e4m3 with block
    scales, else bf16."""
    mode = resolve_scale_mode(cfg.family, V4_SUPPORTS, req)
    ratios = [r for r in cfg.v4.compress_ratios if r]
    multiple = max(ratios, default=1)
    if any(multiple % r for r in ratios):
        raise ValueError(f"DeepSeek-V4 needs power-of-two compress ratios; got "
                         f"{sorted(set(ratios))}")
    spec = V4PoolSpec.from_model(cfg, "fp8_e4m3" if req.is_fp8 else "auto", multiple)
    return CacheLayout(cfg.family, "v4", (CompressedPool(spec), IndexerPool(spec)),
                       (WindowPool(spec), CompressorPool(spec)),
                       storage_dtype=spec.storage_dtype, scale_mode=mode,
                       page_multiple=multiple, supports=V4_SUPPORTS)


def state_layout(spec: V4PoolSpec, kinds: tuple[str, ...]) -> list[dict]:
    """Per layer, where its pools sit in the cache's lists: "compressed" / "indexer"
    indices and the "compressor" state offset (CSA: 8 arrays, main then indexer
    compressor, each buf_kv, buf_gate, prev_kv, prev_gate; HCA: buf_kv, buf_gate)."""
    out, c, i, s = [], 0, 0, 0
    for kind in kinds:
        ent: dict = {}
        if kind != "window":
            ent.update(compressed=c, state=s)
            c += 1
            s += 8 if kind == "csa" else 2
        if kind == "csa":
            ent["indexer"] = i
            i += 1
        out.append(ent)
    assert c == len(spec.compressed_ratios) and i == len(spec.indexer_ratios)
    return out


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
