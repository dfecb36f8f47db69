"""Random weights with a real architecture's shapes (benchmarks, tests): the generator the
families share, given a family's layer shapes (``families.random_params`` picks them)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jfp8kv.config import ModelConfig


def init_random_params(cfg: ModelConfig, key, layer_shapes: Callable, dtype=jnp.bfloat16,
                       scale: float = 0.02, sharding_of: Callable | None = None,
                       arrange: Callable | None = None):
    """Random weights with ``layer_shapes(cfg, i)`` per layer plus the embedding, final norm
    and (untied) LM head; norms are ones, the rest normal(0, ``scale``).

    ``sharding_of(name, shape)``: a ``jax.sharding.Sharding`` per leaf name and model shape;
    each leaf is then generated in place by a jitted generator (the same random bits: JAX's
    partitionable threefry; the jitted transform may round a last bit differently), stored
    as ``arrange(name, x)`` gives it (None: as generated; ``models/sharding.py`` reorders
    some columns device by device). None: eager, on the default device."""
    per_layer = [layer_shapes(cfg, i) for i in range(cfg.num_layers)]
    d = cfg.hidden_size
    keys = iter(jax.random.split(key, sum(map(len, per_layer)) + 2))
    generators = {}

    def generate(key, shape, ones: bool):
        if ones:
            return jnp.ones(shape, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)

    def make(name, shape):
        ones = name.endswith("norm")
        k = None if ones else next(keys)
        if sharding_of is None:
            return generate(k, shape, ones)
        where = sharding_of(name, shape)
        if (name, shape, ones, where) not in generators:
            def gen(k, name=name, shape=shape, ones=ones):
                x = generate(k, shape, ones)
                return x if arrange is None else arrange(name, x)

            generators[name, shape, ones, where] = jax.jit(gen, out_shardings=where)
        return generators[name, shape, ones, where](k)

    layers = [{n: make(n, s) for n, s in sh.items()} for sh in per_layer]
    params = {"embed": make("embed", (cfg.vocab_size, d)), "final_norm": make("final_norm", (d,)),
              "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = make("lm_head", (d, cfg.vocab_size))
    return params
