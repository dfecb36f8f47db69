"""Random weights with a real architecture's shapes (benchmarks, tests): the generator the
families share, given a family's layer shapes (``families.random_params`` picks them)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jfp8kv.config import ModelConfig


def init_random_params(cfg: ModelConfig, key, layer_shapes: Callable, dtype=jnp.bfloat16,
                       scale: float = 0.02, sharding_of: Callable | None = None):
    """Random weights with ``layer_shapes(cfg, i)`` per layer plus the embedding, final norm
    and (untied) LM head; norms are ones, the rest normal(0, ``scale``).

    ``sharding_of(name, ndim)``: a ``jax.sharding.Sharding`` per leaf name; each leaf is
    then generated in place by a jitted generator (the same random bits: JAX's partitionable
    threefry; the jitted transform may round a last bit differently). None: eager, on the
    default device."""
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
        where = sharding_of(name, len(shape))
        if (shape, ones, where) not in generators:
            generators[shape, ones, where] = jax.jit(
                lambda k, shape=shape, ones=ones: generate(k, shape, ones), out_shardings=where)
        return generators[shape, ones, where](k)

    layers = [{n: make(n, s) for n, s in sh.items()} for sh in per_layer]
    params = {"embed": make("embed", (cfg.vocab_size, d)), "final_norm": make("final_norm", (d,)),
              "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = make("lm_head", (d, cfg.vocab_size))
    return params
