"""On-device sampling: greedy, temperature, top-k, top-p, seeded per request.

Each row's key is ``fold_in(PRNGKey(seed), counter)`` where ``counter`` is the index of
the token being sampled, so a request's samples do not depend on which other requests
share its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits, temperature, top_k, top_p, seeds, counters, *, all_greedy: bool):
    """logits float32[B, V]; temperature/top_p float32[B]; top_k int32[B] (<=0: off);
    seeds uint32[B]; counters int32[B]. Static: all_greedy. Returns int32[B]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        return greedy
    v = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / t[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    srt = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    k = jnp.where(top_k > 0, top_k, v)
    srt = jnp.where(rank < k[:, None], srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # Keep a token if the mass before it is < top_p (the first token is always kept).
    srt = jnp.where((cum - probs) < top_p[:, None], srt, -jnp.inf)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    pick = jax.vmap(jax.random.categorical)(keys, srt)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
