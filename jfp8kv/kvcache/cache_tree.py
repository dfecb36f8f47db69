"""The one cache pytree every family's forward takes (``Cache``: a dict of pool pytrees, each
pool's own arrays, and the ``layout.CachePlan`` they were sized by, static), made from a plan
(``Cache.init``) or traced from one (``abstract_cache``: shapes and dtypes, what the steps
compile against before a pool is allocated)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jfp8kv.kvcache.layout import CachePlan, array_bytes

STAT_COLUMNS = 6  # ``cache.STAT_FIELDS``: the fp8 statistics row of one layer


def abstract_cache(plan: CachePlan, pool_args: dict[str, dict] | None = None,
                   shardings: dict | None = None) -> "Cache":
    """The cache of ``plan`` as shapes and dtypes (``jax.ShapeDtypeStruct`` leaves; with
    their shardings where ``shardings`` gives them, as ``Cache.init``): what the steps
    compile against before a pool is allocated."""
    args = {p.name: {**p.placeholder_args(), **(pool_args or {}).get(p.name, {})}
            for p in plan.layout.paged}
    return jax.eval_shape(lambda: Cache.init(plan, args, shardings))


def fit_shardings(where, tree):
    """``where`` (one sharding for a whole pool, or a pytree with one per array, as a pool's
    ``partition`` builds it) in the structure of the pool pytree ``tree`` (whose static
    parts, e.g. a sized config, may differ from those ``where`` was built with)."""
    leaves = jax.tree.leaves(where, is_leaf=lambda x: isinstance(x, P))
    if len(leaves) == 1:
        return leaves[0]
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    """The engine's cache for every family: ``pools`` maps each pool's name to its pytree
    (a ``KVCache``, a ``DeltaState``, lists of V4 row arrays, ...), ``plan`` (static) says
    what was sized. A family's forward reads the pools it declared and returns
    ``replace``'s copy with the ones it wrote."""

    pools: dict
    plan: CachePlan = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def init(cls, plan: CachePlan, pool_args: dict[str, dict] | None = None,
             shardings: dict | None = None) -> "Cache":
        """Every pool zeroed; ``pool_args[name]``: extra arguments of that pool's ``init``
        (a dense pool's static scales and K shift). ``shardings[name]``: a pytree prefix of
        ``jax.sharding.Sharding`` for that pool's arrays (tensor parallelism: each device
        allocates its share in place); a pool it does not name is made on the default
        device."""
        args, shardings = pool_args or {}, shardings or {}

        def make(pool, *sizes):
            def init(extra):
                return pool.init(*sizes, **extra)

            extra = args.get(pool.name, {})
            if pool.name not in shardings:
                return init(extra)
            where = fit_shardings(shardings[pool.name], jax.eval_shape(init, extra))
            return jax.jit(init, out_shardings=where)(extra)

        pools = {p.name: make(p, plan.num_pages, plan.page_size) for p in plan.layout.paged}
        pools.update({p.name: make(p, plan.num_slots) for p in plan.layout.slots})
        return cls(pools, plan)

    def __getitem__(self, name: str):
        return self.pools[name]

    def copy_slots(self, src, dst, n) -> "Cache":
        """Every slot pool's row ``src[k]`` copied to row ``dst[k]``, for k < ``n`` (traced
        int32[K], int32[K] and a scalar: one dynamic slice per pair and array, in place
        under donation, nothing gathered for the pairs past ``n``). Pairs are copied in
        order, so a pair may read what an earlier one wrote."""
        names = [p.name for p in self.plan.layout.slots]

        def one(k, pools):
            def row(x):
                got = jax.lax.dynamic_slice_in_dim(x, src[k], 1, 0)
                return jax.lax.dynamic_update_slice_in_dim(x, got, dst[k], 0)
            return {name: jax.tree.map(row, pool) for name, pool in pools.items()}

        pools = jax.lax.fori_loop(0, n, one, {name: self.pools[name] for name in names})
        return self.replace(**pools)

    def replace(self, **pools) -> "Cache":
        return Cache({**self.pools, **pools}, self.plan)

    @property
    def page_size(self) -> int:
        return self.plan.page_size

    @property
    def stats(self):
        """The fp8 statistics rows [layers, 6] of the pool that counts them (``KVCache``),
        or an empty [0, 6] array when no pool does."""
        for pool in self.pools.values():
            if hasattr(pool, "stats"):
                return pool.stats
        return jnp.zeros((0, STAT_COLUMNS), jnp.float32)

    def pool_nbytes(self, per_device: bool = False) -> dict[str, int]:
        """Bytes allocated per pool: a pool pytree's own ``nbytes()`` where it has one (a
        ``KVCache`` leaves out its statistics rows and K shift, bookkeeping beside the
        storage), else every leaf. ``per_device``: what one device holds (a split pool's
        share, a replicated pool whole): equal to ``plan.pool_bytes()``, whose byte model
        is per device; without it, every device's share together."""
        return {name: pool.nbytes(per_device) if callable(getattr(pool, "nbytes", None))
                else sum(array_bytes(x, per_device) for x in jax.tree.leaves(pool))
                for name, pool in self.pools.items()}

    def nbytes(self, per_device: bool = False) -> int:
        return sum(self.pool_nbytes(per_device).values())
