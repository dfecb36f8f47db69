"""DeepSeek-V4's cache as the engine carries it: ``v4_pools``' pools in one pytree, addressed
by the engine's page tables (compressed and indexer entries) and sequence slots (window
rows and compressor state).

Addressing (ps = page_size, m = a layer's compress ratio, ps a multiple of every m):

    compressed / indexer entry w of a sequence   page table[w*m // ps], row w % (ps/m)
    window row of position p                     slot's ring row p % W
    compressor buffers and overlap halves        the slot's rows

Page 0 and slot 0 are the padding sinks (never a sequence's); nothing is written to them
either: writes of padding tokens are dropped. A slot needs no clearing when it is handed
to a new sequence: a chunk that starts at position 0 reads a fresh compressor state, and
window rows and entries before a sequence's first write are never visible to it.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp

from jfp8kv.kvcache import fp8
from jfp8kv.kvcache.cache import STAT_FIELDS
from jfp8kv.kvcache.v4_pools import V4PoolSpec, init_pools


@dataclasses.dataclass(frozen=True)
class V4CacheConfig:
    """Static shape of the engine's V4 cache (hashable). The properties mirror the paged
    cache's ``CacheConfig`` where the engine reads them (page_size, num_pages including
    page 0, max_tokens, storage_dtype, scale_mode, layout, kv_rotation)."""

    spec: V4PoolSpec
    num_pages: int  # including the sink page 0
    num_slots: int  # including the sink slot 0

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def max_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def storage_dtype(self) -> str:
        return self.spec.storage_dtype

    @property
    def is_fp8(self) -> bool:
        return fp8.is_fp8(self.storage_dtype)

    @property
    def scale_mode(self) -> str | None:
        return "block" if self.is_fp8 else None

    layout = "v4"
    kv_rotation = "none"
    bitcast_pool = False

    @property
    def num_layers(self) -> int:
        return self.spec.window_layers

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim


@typing.no_type_check
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class V4Cache:
    """The pools (``v4_pools.init_pools``' lists of (values[, float16 scales]) tuples) and
    a stats array of the paged cache's shape (``cache.STAT_FIELDS`` per layer), zeros: V4
    does not count saturation or NaN yet (``LLM.kv_stats()`` reads zeros)."""

    window: list
    compressed: list
    indexer: list
    state: list
    stats: jax.Array
    config: V4CacheConfig = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def init(cls, cfg: V4CacheConfig) -> "V4Cache":
        pools = init_pools(cfg.spec, cfg.num_pages, cfg.num_slots)
        return cls(pools["window"], pools["compressed"], pools["indexer"], pools["state"],
                   jnp.zeros((cfg.num_layers, len(STAT_FIELDS)), jnp.float32), cfg)

    def pool_nbytes(self) -> dict[str, int]:
        """Bytes allocated per pool (equal to ``V4PoolSpec.cache_info``'s)."""
        return {k: sum(a.nbytes for layer in getattr(self, k) for a in layer)
                for k in ("window", "compressed", "indexer", "state")}

    def nbytes(self) -> int:
        return sum(self.pool_nbytes().values())


def layer_slots(spec: V4PoolSpec, kinds: tuple[str, ...]) -> list[dict]:
    """Per layer, where its pools sit in ``V4Cache``'s lists: "compressed" / "indexer"
    indices and the "state" offset (CSA: 8 arrays, main then indexer compressor, each
    buf_kv, buf_gate, prev_kv, prev_gate; HCA: buf_kv, buf_gate)."""
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
