"""Tensor parallelism over a 1-D device mesh (axis ``"tp"``), applied from outside the model.

The transformer knows nothing of devices. This module says where each weight and each
cache array lives, and wraps the model's attention step (``transformer.store_and_attend``:
store the chunk's K/V, attend over the pages) in ``jax.shard_map`` over the KV-head axis, so
the kernels (reference twins and Pallas alike) see one device's heads and run unchanged.
Everything else is XLA's SPMD partitioner working from the weights' shardings::

    wq, bq            columns (query heads)   each device computes its heads' queries
    wk, wv, bk, bv    columns (KV heads)      ... its KV heads (replicated if KV heads are)
    wo                rows                    partial sums: one all-reduce per layer
    w_gate, w_up      columns                 each device computes a slice of the MLP ...
    w_down            rows                    ... and one all-reduce per layer
    embed, lm_head    vocab                   masked local gather + all-reduce; logits
                                              sharded on vocab (the sampler reduces across)
    norms, MoE router and experts             replicated

(``w_gate``/``w_up``/``w_down`` and the vocab stay replicated when their size does not
divide by the mesh size.)

Cache: every pool says how it splits (``PagedPool.partition``): pages and dynamic scales
``[kv_heads, pages, ...]`` and static scales ``[kv_heads, head_dim]`` are sharded on the head
axis, so a device holds its heads' pages; the stats and the (empty) scales of unscaled pools
are replicated. Page tables, lengths,
the allocator and the scheduler are host-side: the same numbers go to every device.

KV-head replication rule. The mesh size ``n`` must divide ``num_heads`` ``H``. When it does
not divide ``num_kv_heads`` ``G``, every KV head is stored ``r = lcm(G, n) / G`` times, so the
cache holds ``G' = lcm(G, n)`` heads, ``G' / n`` on each device (``G / gcd(G, n)`` instead of
the ideal ``G / n``). The copies are made from the projected K/V rows (``wk``/``wv``
replicated), and query head ``h`` reads cache head ``h // (H / G')``, a copy of its own KV
head ``h // (H / G)``, so the numbers are those of the unsharded model.

Multi-host: the mesh takes ``jax.devices()[:n]``, which is this process's devices in one
process and spans hosts after ``jax.distributed.initialize()`` (see docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jfp8kv.config import CacheConfig, ModelConfig
from jfp8kv.kvcache import scale_modes
from jfp8kv.kvcache.cache import LayerKV, reduce_stat_rows
from jfp8kv.kvcache.layout import Cache, CacheLayout, fit_shardings
from jfp8kv.models import families
from jfp8kv.models.layers import store_and_attend

AXIS = "tp"
_HEAD_COLUMNS = ("wq", "bq")  # [.., H*hd]: always sharded by query heads
_KV_COLUMNS = ("wk", "wv", "bk", "bv")  # [.., G*hd]: sharded by KV heads unless replicated
_MLP_COLUMNS = ("w_gate", "w_up")


def valid_sizes(cfg: ModelConfig, num_devices: int) -> list[int]:
    """Mesh sizes that fit ``num_devices`` and divide ``num_heads``."""
    return [n for n in range(1, num_devices + 1) if cfg.num_heads % n == 0]


def check_device_count(size: int) -> None:
    """Raise unless JAX sees at least ``size`` devices (checked before any weight loads)."""
    devices = jax.devices()
    if size > len(devices):
        hint = (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX "
                "starts gives N virtual devices)" if devices[0].platform == "cpu" else "")
        raise ValueError(f"tensor_parallel_size={size} needs {size} devices, but JAX sees "
                         f"{len(devices)} {devices[0].platform} device(s); use a size in "
                         f"1..{len(devices)}{hint}")


def plan(cfg: ModelConfig, size: int) -> "TensorParallel | None":
    """The layout of ``cfg`` over ``size`` devices; None for one device (the unsharded path).
    Raises ValueError naming the valid sizes when ``size`` does not divide ``num_heads``."""
    if size > 1 and not families.of(cfg).supports.tensor_parallel:
        raise ValueError(f"tensor_parallel_size={size} is not supported for {cfg.family} yet "
                         "(its heads and pools are not sharded); use tensor_parallel_size=1")
    check_device_count(size)
    if size == 1:
        return None
    if cfg.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {cfg.num_heads} "
            f"attention heads; valid sizes on {len(jax.devices())} device(s): "
            f"{valid_sizes(cfg, len(jax.devices()))}")
    mesh = Mesh(np.asarray(jax.devices()[:size]), (AXIS,))
    repeat = math.lcm(cfg.num_kv_heads, size) // cfg.num_kv_heads
    return TensorParallel(mesh, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size, repeat)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """One model's layout over a 1-D mesh. Hashable: the runner's jitted steps take it as a
    static argument. ``kv_repeat`` is ``r`` of the replication rule (1: none)."""

    mesh: Mesh
    num_kv_heads: int  # the model's
    intermediate_size: int
    vocab_size: int
    kv_repeat: int

    @property
    def size(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def cache_kv_heads(self) -> int:
        """KV heads in the (global) cache: the model's, times ``kv_repeat``."""
        return self.num_kv_heads * self.kv_repeat

    @property
    def kv_heads_per_device(self) -> int:
        return self.cache_kv_heads // self.size

    # -- weights ------------------------------------------------------------------------
    def param_spec(self, key: str, ndim: int) -> P:
        """Where the params leaf named ``key`` (``transformer``'s names) lives."""
        n = self.size
        last = P(*([None] * (ndim - 1)), AXIS)
        if key in _HEAD_COLUMNS or (key in _KV_COLUMNS and self.kv_repeat == 1):
            return last
        if key in _MLP_COLUMNS and self.intermediate_size % n == 0:
            return last
        if key == "wo" or (key == "w_down" and self.intermediate_size % n == 0):
            return P(AXIS, None)
        if self.vocab_size % n == 0 and key in ("embed", "lm_head"):
            return P(AXIS, None) if key == "embed" else P(None, AXIS)
        return P()

    def sharding(self, key: str, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, self.param_spec(key, ndim))

    def replicate(self, x):
        """``x`` on every device of the mesh (a committed, replicated array): host inputs that
        meet device-made ones at the same argument (decode tokens under overlap scheduling)
        then share one executable instead of compiling a second for an uncommitted input."""
        return jax.device_put(x, NamedSharding(self.mesh, P()))

    def put(self, key: str, host: np.ndarray) -> jax.Array:
        """A host array straight onto its shards: each device receives only its slice."""
        return jax.make_array_from_callback(host.shape, self.sharding(key, host.ndim),
                                            lambda index: host[index])

    def place_params(self, params: dict) -> dict:
        """Move an already loaded params pytree onto the mesh (no-op for placed leaves)."""
        def place(tree: dict) -> dict:
            return {k: jax.device_put(v, self.sharding(k, v.ndim)) for k, v in tree.items()}

        out = place({k: v for k, v in params.items() if k != "layers"})
        out["layers"] = [place(lp) for lp in params["layers"]]
        return out

    # -- cache --------------------------------------------------------------------------
    def cache_shardings(self, layout: CacheLayout) -> dict:
        """Each pool's placement (its ``partition``: a pytree prefix of NamedShardings),
        for ``Cache.init`` / ``abstract_cache`` to allocate every device's share in place."""
        def named(spec):
            return jax.tree.map(lambda s: NamedSharding(self.mesh, s), spec,
                                is_leaf=lambda x: isinstance(x, P))

        return {p.name: named(p.partition(AXIS)) for p in layout.pools}

    def constrain_cache(self, cache: Cache) -> Cache:
        """Pin a jitted step's output cache to the pools' layout (so donation reuses it)."""
        where = self.cache_shardings(cache.plan.layout)
        return cache.replace(**{name: jax.lax.with_sharding_constraint(
            pool, fit_shardings(where[name], pool)) for name, pool in cache.pools.items()})

    def expand_kv_heads(self, x: np.ndarray, axis: int = 1) -> np.ndarray:
        """Per-head host arrays (static scales [layers, G, ...]) to the cache's G' heads."""
        return x if self.kv_repeat == 1 else np.repeat(x, self.kv_repeat, axis=axis)

    # -- attention ----------------------------------------------------------------------
    def attend(self, q, k, v, pro, layer: LayerKV, slots, page_tables, seq_lens, positions,
               ccfg: CacheConfig, sm_scale: float, backend: str):
        """``transformer.store_and_attend`` per device over its KV heads (shard_map).

        q [N, H, hd] and k, v [N, G, hd] as the model computes them (``pro``, the RoPE
        tables and norm weights, replicated); ``layer`` holds G' heads. The stats row is
        reduced over devices (counts summed, each element counted once; amax maximized)."""
        r = self.kv_repeat
        if r > 1:  # G -> G' heads: head g's copies are g*r .. g*r + r-1
            k, v = jnp.repeat(k, r, axis=1), jnp.repeat(v, r, axis=1)
        local = dataclasses.replace(ccfg, num_kv_heads=ccfg.num_kv_heads // self.size)
        scaled = scale_modes.of(ccfg).name is not None
        layer_spec = LayerKV(P(AXIS), P(AXIS), *(2 * [P(AXIS) if scaled else P()]))
        heads_q, heads_kv = P(None, None, AXIS), P(None, AXIS)

        def per_device(q, k, v, pro, layer, slots, page_tables, seq_lens, positions):
            out, layer, st = store_and_attend(q, k, v, pro, layer, slots, page_tables,
                                              seq_lens, positions, local, sm_scale, backend)
            st = reduce_stat_rows(st)
            st = jnp.concatenate([jax.lax.psum(st[:4], AXIS) / r, jax.lax.pmax(st[4:], AXIS)])
            return out, layer, st[None]

        run = jax.shard_map(per_device, mesh=self.mesh,
                            in_specs=(heads_kv, heads_kv, heads_kv, P(), layer_spec, P(), P(),
                                      P(), P()),
                            out_specs=(heads_q, layer_spec, P()))
        return run(q, k, v, pro, layer, slots, page_tables, seq_lens, positions)


def weight_placer(cfg: ModelConfig, size: int) -> Callable[[str, np.ndarray], jax.Array]:
    """``put(key, host_array)`` for the loaders: onto the default device for one device,
    else straight onto the shards of ``plan(cfg, size)``."""
    tp = plan(cfg, size)
    return (lambda key, host: jnp.asarray(host)) if tp is None else tp.put
