"""Tensor parallelism over a 1-D device mesh (axis ``"tp"``), applied from outside the model.

The models know nothing of devices. This module says where each weight and each cache
array lives, and runs the sections of a family's step that hold kernels (attention, the
DeltaNet rule, the MoE's grouped matmuls) in ``jax.shard_map``, so the kernels (reference
twins and Pallas alike) see one device's heads and run unchanged. Everything else is XLA's
SPMD partitioner working from the weights' shardings. Weights, by the name of the leaf
(``param_spec``; a weight whose split axis does not divide by the mesh size stays
replicated)::

    wq, bq, wq_b, wkv_b       columns (query heads)    each device computes its heads
    wk, wv, bk, bv            columns (KV heads)       ... its KV heads (replicated if KV
                                                        heads are)
    w_qkv, conv_w             DeltaNet channels,       arranged device by device (below)
    w_z, w_b, w_a, dt_bias,   DeltaNet value heads
    A_log
    sinks, wo_a               query heads / o_groups   (DeepSeek-V4)
    wo, wo_b, w_out           rows                     partial sums: one all-reduce per layer
    w_gate, w_up, shared_*    columns (intermediate)   each device computes a slice of the
    experts_gate, experts_up  [E, D, I] on I           MLP or of every expert ...
    w_down, shared_down,      rows (intermediate)      ... and one all-reduce per layer
    experts_down
    embed, lm_head            vocab                    masked local gather + all-reduce;
                                                        logits sharded on vocab
    everything else           replicated               norms, routers, MLA's wq_a / wkv_a,
                                                        V4's wq_a / wkv, compressors, indexer

MoE experts are split by tensor parallelism (each device holds every expert's 1/N slice of
the intermediate axis), not expert parallelism: the hidden states are replicated, so every
device runs the same routing and the same grouped matmul over all assignments at 1/N width,
with no load imbalance and no all-to-all; the expert sums are one all-reduce, as an MLP's.

Cache: every pool says how it splits (``PagedPool.partition``): dense K/V pages and scales on
the KV-head axis, DeltaNet states on channels / value heads; the MLA latent and DeepSeek-V4's
single-head pools are replicated (every query head reads every row). Page tables, lengths,
slots, the allocator and the scheduler are host-side: the same numbers go to every device.

KV-head replication rule. The mesh size ``n`` must divide ``num_heads`` ``H``. When it does
not divide ``num_kv_heads`` ``G``, every KV head is stored ``r = lcm(G, n) / G`` times, so the
cache holds ``G' = lcm(G, n)`` heads, ``G' / n`` on each device (``G / gcd(G, n)`` instead of
the ideal ``G / n``). The copies are made from the projected K/V rows (``wk``/``wv``
replicated), and query head ``h`` reads cache head ``h // (H / G')``, a copy of its own KV
head ``h // (H / G)``, so the numbers are those of the unsharded model. DeltaNet q/k heads
follow the same rule against the value heads (``state_pool.stored_key_heads``): their
columns of ``w_qkv`` and ``conv_w`` are gathered device by device (``arrange``: device d's
q heads, k heads, then v heads), copies included, so the conv and its state split by
channel and each device runs the model's DeltaNet on whole heads.

Every ``shard_map`` here runs with ``check_vma=False``: a Pallas kernel's outputs carry no
varying-axes type (with the check on, ``pallas_call`` refuses to trace), and the outputs
declared replicated are so by construction (computed from replicated inputs, or summed).

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
from jfp8kv.kvcache.cache_tree import Cache, fit_shardings
from jfp8kv.kvcache.layout import CacheLayout
from jfp8kv.kvcache.state_pool import stored_key_heads
from jfp8kv.models import families
from jfp8kv.models.layers import map_named, store_and_attend

AXIS = "tp"
# leaf name -> the axis split over the mesh (negative: from the end)
_SPLIT = {**dict.fromkeys(("wq", "bq", "wq_b", "wkv_b", "w_qkv", "w_z", "w_b", "w_a",
                           "w_gate", "w_up", "shared_gate", "shared_up", "lm_head"), -1),
          **dict.fromkeys(("wo", "wo_b", "w_out", "w_down", "shared_down", "embed", "conv_w",
                           "dt_bias", "A_log", "sinks", "wo_a"), 0),
          "experts_gate": 2, "experts_up": 2, "experts_down": 1}
_KV = ("wk", "wv", "bk", "bv")  # split by KV heads unless those are replicated
_MLP = ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down",
        "experts_gate", "experts_up", "experts_down")  # an MLP block's split weights
_ARRANGED = {"w_qkv": -1, "conv_w": 0}  # DeltaNet channels, gathered device by device


def valid_sizes(cfg: ModelConfig, num_devices: int) -> list[int]:
    """Mesh sizes that fit ``num_devices`` and divide every count the family splits
    (``Family.tp_counts``: attention heads, and DeltaNet value heads / V4 output groups)."""
    counts = families.of(cfg).tp_counts(cfg).values()
    return [n for n in range(1, num_devices + 1) if all(c % n == 0 for c in counts)]


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
    Raises ValueError naming the valid sizes when ``size`` does not divide the counts the
    family splits."""
    fam = families.of(cfg)
    if size > 1 and not fam.supports.tensor_parallel:
        raise ValueError(f"tensor_parallel_size={size} is not supported for {cfg.family} yet "
                         "(its heads and pools are not sharded); use tensor_parallel_size=1")
    check_device_count(size)
    if size == 1:
        return None
    bad = [f"{c} {what}" for what, c in fam.tp_counts(cfg).items() if c % size]
    if bad:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {' and '.join(bad)}; "
            f"valid sizes on {len(jax.devices())} device(s): "
            f"{valid_sizes(cfg, len(jax.devices()))}")
    mesh = Mesh(np.asarray(jax.devices()[:size]), (AXIS,))
    return TensorParallel(mesh, cfg, math.lcm(cfg.num_kv_heads, size) // cfg.num_kv_heads)


def delta_columns(cfg: ModelConfig, size: int) -> np.ndarray:
    """The model's DeltaNet channel (``w_qkv`` column, ``conv_w`` row) at each stored channel
    over ``size`` devices: device by device its stored q heads, k heads (copies included,
    ``state_pool.stored_key_heads``), then its v heads. The identity for one device."""
    hy = cfg.hybrid
    hk, dk, dv = hy.linear_num_key_heads, hy.linear_key_head_dim, hy.linear_value_head_dim
    stored = stored_key_heads(hy, size)
    kpd, vpd = stored // size, hy.linear_num_value_heads // size
    cols = []
    for d in range(size):
        heads = np.arange(d * kpd, (d + 1) * kpd) // (stored // hk)
        q = (heads[:, None] * dk + np.arange(dk)).ravel()
        v = (np.arange(d * vpd, (d + 1) * vpd)[:, None] * dv + np.arange(dv)).ravel()
        cols += [q, hk * dk + q, 2 * hk * dk + v]
    return np.concatenate(cols)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """One model's layout over a 1-D mesh. Hashable: the runner's jitted steps take it as a
    static argument. ``kv_repeat`` is ``r`` of the replication rule (1: none). The models'
    per-device hooks (``layers.OneDevice`` is their one-device form): ``attend``,
    ``split`` and ``mlp``."""

    mesh: Mesh
    cfg: ModelConfig
    kv_repeat: int

    @property
    def size(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def num_kv_heads(self) -> int:  # the model's
        return self.cfg.num_kv_heads

    @property
    def cache_kv_heads(self) -> int:
        """KV heads in the (global) cache: the model's, times ``kv_repeat``."""
        return self.num_kv_heads * self.kv_repeat

    @property
    def kv_heads_per_device(self) -> int:
        return self.cache_kv_heads // self.size

    # -- weights ------------------------------------------------------------------------
    def param_spec(self, key: str, shape: tuple[int, ...]) -> P:
        """Where the params leaf named ``key`` (its layer dict's key; nested dicts join
        theirs with "/") of ``shape`` (as stored: ``arrange``d) lives."""
        axis = _SPLIT.get(key, -1 if key in _KV and self.kv_repeat == 1 else None)
        if axis is None or shape[axis] % self.size:
            return P()
        axis %= len(shape)
        return P(*([None] * axis), AXIS, *([None] * (len(shape) - axis - 1)))

    def sharding(self, key: str, shape: tuple[int, ...]) -> NamedSharding:
        """The placement of leaf ``key`` whose model shape is ``shape`` (``arrange``d)."""
        return NamedSharding(self.mesh, self.param_spec(key, self.arranged_shape(key, shape)))

    def arranged_shape(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if key not in _ARRANGED or self.cfg.hybrid is None:
            return tuple(shape)
        axis = _ARRANGED[key] % len(shape)
        cols = len(delta_columns(self.cfg, self.size))
        return tuple(cols if i == axis else s for i, s in enumerate(shape))

    def arrange(self, key: str, x, size: int | None = None):
        """``x`` (leaf ``key`` in the model's order, numpy or jax) in the stored order of
        ``size`` devices (default: this mesh's; ``delta_columns``)."""
        if key not in _ARRANGED or self.cfg.hybrid is None:
            return x
        cols = delta_columns(self.cfg, size or self.size)
        return x[..., cols] if _ARRANGED[key] == -1 else x[cols]

    def unarrange(self, key: str, x, size: int):
        """``x`` stored for ``size`` devices, back in the model's order."""
        if key not in _ARRANGED or self.cfg.hybrid is None or size == 1:
            return x
        first = np.unique(delta_columns(self.cfg, size), return_index=True)[1]
        return x[..., first] if _ARRANGED[key] == -1 else x[first]

    def replicate(self, x):
        """``x`` on every device of the mesh (a committed, replicated array): host inputs that
        meet device-made ones at the same argument (decode tokens under overlap scheduling)
        then share one executable instead of compiling a second for an uncommitted input."""
        return jax.device_put(x, NamedSharding(self.mesh, P()))

    def put(self, key: str, host: np.ndarray) -> jax.Array:
        """A host array (the model's order) straight onto its shards: each device receives
        only its slice."""
        host = self.arrange(key, host)
        where = NamedSharding(self.mesh, self.param_spec(key, host.shape))
        return jax.make_array_from_callback(host.shape, where, lambda index: host[index])

    def place_params(self, params: dict, arranged_for: int = 1) -> dict:
        """Move an already loaded params pytree onto the mesh (no-op for placed leaves);
        ``arranged_for``: the mesh size its leaves are stored for (``arrange``)."""
        def place(key, v):
            if arranged_for != self.size:
                v = self.arrange(key, self.unarrange(key, v, arranged_for))
            return jax.device_put(v, NamedSharding(self.mesh, self.param_spec(key, v.shape)))

        return map_named(place, params)

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

    # -- per-device sections --------------------------------------------------------------
    def split(self, fn: Callable, in_axes, out_axes) -> Callable:
        """``fn`` per device (``jax.shard_map``): each argument split on its axis of
        ``in_axes`` (a pytree prefix of the arguments: an int, or None for replicated), each
        output likewise by ``out_axes``, where "sum" marks an output summed over the
        devices (partial sums: one all-reduce). The one-device form returns ``fn``."""
        def spec(a):
            return P() if a is None or a == "sum" else P(*([None] * a), AXIS)

        def specs(axes):
            return jax.tree.map(spec, axes, is_leaf=lambda a: a is None or isinstance(a, str))

        def per_device(*args):
            out = fn(*args)
            return jax.tree.map(
                lambda a, sub: jax.tree.map(lambda x: jax.lax.psum(x, AXIS), sub)
                if a == "sum" else sub, out_axes, out,
                is_leaf=lambda a: a is None or isinstance(a, (int, str)))

        return jax.shard_map(per_device, mesh=self.mesh, in_specs=specs(tuple(in_axes)),
                             out_specs=specs(out_axes), check_vma=False)

    def mlp(self, fn: Callable, h, lp: dict, *rest):
        """``fn(h, lp, *rest)``, an MLP or MoE block (linear in its intermediate axis), per
        device over its slice of the block's weights (``_MLP`` names, as placed), summed over
        the devices. ``h`` and ``rest`` replicated. When a block weight does not divide, the
        block runs whole on every device (nothing summed)."""
        specs = map_named(lambda k, v: self.param_spec(k, v.shape), lp)
        names = [k for k in lp if k in _MLP]
        if not names or any(specs[k] == P() for k in names):
            specs, out = jax.tree.map(lambda s: P(), specs), P()
            body = fn
        else:
            out = P()

            def body(*args):
                return jax.lax.psum(fn(*args), AXIS)

        n = len(rest)
        return jax.shard_map(body, mesh=self.mesh, in_specs=(P(), specs, *([P()] * n)),
                             out_specs=out, check_vma=False)(h, lp, *rest)

    def attend(self, q, k, v, pro, layer: LayerKV, slots, page_tables, seq_lens, positions,
               ccfg: CacheConfig, sm_scale: float, backend: str):
        """``layers.store_and_attend`` per device over its KV heads (shard_map).

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
                            out_specs=(heads_q, layer_spec, P()), check_vma=False)
        return run(q, k, v, pro, layer, slots, page_tables, seq_lens, positions)


def weight_placer(cfg: ModelConfig, size: int) -> Callable[[str, np.ndarray], jax.Array]:
    """``put(key, host_array)`` for the loaders: onto the default device for one device,
    else straight onto the shards of ``plan(cfg, size)`` (in its stored order)."""
    tp = plan(cfg, size)
    return (lambda key, host: jnp.asarray(host)) if tp is None else tp.put
