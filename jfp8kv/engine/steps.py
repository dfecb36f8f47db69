"""The engine's device steps: pure functions of (params, cache, batch arrays), jitted once per
static configuration with the cache donated. ``ModelRunner`` (``runner.py``) pads host
batches into their buckets and calls these.

* ``prefill``: a padded batch of new-token chunks [B, T]; one sampled token per row from
  its last real position (and, given ``Scoring``, each position's log-prob of its target:
  prompt scoring).
* ``DECODE_JITS[...]``: ``num_steps`` decode steps in one ``lax.scan``, sampling on device
  and feeding each token back; one jit per ``EngineConfig.decode_gemm_autotune`` value
  ("exhaustive" has XLA time every Triton tiling of the small-batch GEMMs:
  docs/lab/engine-notes.md).
* ``nll``: teacher-forced next-token NLL of a chunk, through the cache like ``prefill``.

``tp`` (a ``models.sharding.TensorParallel``, static; None on one device) runs the family's
kernel sections per device (``models.families``) and pins the output cache to the pools'
shardings.

State snapshots (prefix caching over slot pools, ``engine.snapshot_policy``) are copies
between state slots folded into the steps, every slot pool's rows at once
(``Cache.copy_slots``; nothing is copied through the host): ``prefill``'s ``snapshots``
restore a row's slot before the forward and capture it after; ``_decode_steps``'
``captures`` copy a row's slot after the scan step where it reaches a page boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jfp8kv.engine.sampler import branch, init_state, sample_step, token_logprobs, zero_logprobs
from jfp8kv.models import families, transformer


def _placed(cache, tp):
    return cache if tp is None else tp.constrain_cache(cache)


def copy_rows(cache, src, dst):
    """``cache`` with each row's state slot src[b] copied to dst[b] where dst[b] > 0 (slot 0,
    the padding sink, is never a destination): the rows that copy first, one slot at a time
    (``Cache.copy_slots``), so rows without a copy cost nothing."""
    want = dst > 0
    order = jnp.argsort(~want, stable=True)
    return cache.copy_slots(src[order], dst[order], want.sum())


def _forward(params, cache, tokens, positions, slots, page_tables, seq_lens, state_slots, *,
             cfg, backend, tp):
    """The model family's forward over the cache (``models.families``' contract)."""
    return families.forward(params, cache, tokens, positions, slots, page_tables, seq_lens,
                            state_slots, cfg=cfg, backend=backend, tp=tp)


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "all_greedy", "tp"),
                   donate_argnames=("cache",))
def prefill(params, cache, tokens, positions, slots, page_tables, seq_lens, last_idx,
            temperature, top_k, top_p, seeds, counters, extras=None, scoring=None, *, cfg,
            backend, all_greedy, tp=None, state_slots=None, snapshots=None):
    """Static: cfg, backend, all_greedy, tp (and the structure of extras, scoring and
    snapshots). Donated: cache. Returns (out, cache): out int32[B], or (int32[B], log-probs)
    when extras.logprobs; with ``scoring`` (a ``sampler.Scoring``) (out, (log-prob [B, T] of
    each target, top values [B, T, K], top ids [B, T, K])). ``state_slots`` int32[B]: the
    rows' state slots when the cache has slot pools (None otherwise); ``snapshots``
    (restore, capture) int32[B] each: a snapshot slot copied into the row's state slot
    before the forward, and one its state is copied into after (0: none)."""
    if snapshots is not None:
        cache = copy_rows(cache, snapshots[0], jnp.where(snapshots[0] > 0, state_slots, 0))
    hidden, cache = _forward(params, cache, tokens, positions, slots, page_tables, seq_lens,
                             state_slots, cfg=cfg, backend=backend, tp=tp)
    if snapshots is not None:
        cache = copy_rows(cache, state_slots, snapshots[1])
    last = jnp.take_along_axis(hidden, last_idx[:, None, None], axis=1)[:, 0]
    logits = transformer.logits(params, last)
    state = init_state(extras, logits.shape[-1])
    toks, _, lp = sample_step(logits, state, temperature, top_k, top_p, seeds, counters, extras,
                              all_greedy=all_greedy)
    out = toks if lp is None else (toks, lp)
    if scoring is not None:
        scores = branch(scoring.switch, functools.partial(score_positions, params),
                        lambda h, t: zero_logprobs(t, cfg.vocab_size), hidden, scoring.targets)
        out = (out, scores)
    return out, _placed(cache, tp)


# Prompt scoring's logits per block are at most SCORE_BYTES of float32 (and at most
# SCORE_BLOCK positions): XLA reserves a few such blocks in every executable that can score,
# even while its scoring branch is off (a 512-position block of a 248,320-token vocabulary
# held ~3 GiB of temporaries in Qwen3.6-35B-A3B's prefill on an H100).
SCORE_BLOCK = 512
SCORE_BYTES = 64 << 20


def score_block(vocab_size: int) -> int:
    """Positions per scoring block: a power of two of at most ``SCORE_BLOCK`` whose float32
    logits fit ``SCORE_BYTES`` (at least 8)."""
    fits = max(8, SCORE_BYTES // (4 * vocab_size))
    return min(SCORE_BLOCK, 1 << (fits.bit_length() - 1))


def score_positions(params, hidden, targets):
    """Prompt scoring: ``sampler.token_logprobs`` of each position's target, hidden
    [B, T, D] and targets int32[B, T] -> ([B, T], [B, T, K], [B, T, K]), SCORE_BLOCK positions
    at a time. All at once, the logits of a whole prefill dispatch would be [B*T, vocab]
    float32: 30 GB at 49,152 tokens of a 151,936-token vocabulary, which XLA reserves even
    while the switched structure's scoring branch is off (an H100 ran out of memory so)."""
    b, t, d = hidden.shape
    head = params.get("lm_head")
    vocab = head.shape[-1] if head is not None else params["embed"].shape[0]
    scored = jax.lax.map(lambda x: token_logprobs(transformer.logits(params, x[0]), x[1]),
                         (hidden.reshape(b * t, d), targets.reshape(b * t)),
                         batch_size=score_block(vocab))
    return tuple(a.reshape(b, t, *a.shape[1:]) for a in scored)


def _decode_steps(params, cache, tokens, positions, page_tables, limits, temperature, top_k,
                  top_p, seeds, counters, extras=None, *, cfg, backend, all_greedy, num_steps,
                  tp=None, state_slots=None, captures=None):
    """``num_steps`` decode steps. Row b is active at step i iff positions[b] + i < limits[b];
    inactive rows write to the sink page and attend nothing. Static: cfg, backend,
    all_greedy, num_steps, tp (and extras' and captures' structure: the penalty token counts
    ride in the scan carry only when given). Donated: cache. Returns (int32[B, num_steps],
    cache), or ((tokens, log-probs [B, num_steps, ...]), cache) when extras.logprobs.
    ``captures`` (step, slot) int32[B] each: row b's state slot is copied to slot[b] after
    scan step step[b] (-1: never)."""
    ps = cache.page_size

    def body(carry, i):
        cache, tok, state = carry
        pos = positions + i
        active = pos < limits
        page = jnp.take_along_axis(page_tables, (pos // ps)[:, None] % page_tables.shape[1],
                                   axis=1)[:, 0]
        slot = jnp.where(active, page * ps + pos % ps, 0)
        seq_len = jnp.where(active, pos + 1, 0)
        hidden, cache = _forward(params, cache, tok[:, None], pos[:, None], slot[:, None],
                                 page_tables, seq_len, state_slots, cfg=cfg, backend=backend,
                                 tp=tp)
        if captures is not None:
            cache = copy_rows(cache, state_slots, jnp.where(captures[0] == i, captures[1], 0))
        logits = transformer.logits(params, hidden[:, 0])
        nxt, state, lp = sample_step(logits, state, temperature, top_k, top_p, seeds,
                                     counters + i, extras, all_greedy=all_greedy)
        return (cache, nxt, state), (nxt if lp is None else (nxt, lp))

    state = init_state(extras, cfg.vocab_size)
    (cache, _, _), out = jax.lax.scan(body, (cache, tokens, state), jnp.arange(num_steps))
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), out), _placed(cache, tp)


_DECODE_JIT = dict(static_argnames=("cfg", "backend", "all_greedy", "num_steps", "tp"),
                   donate_argnames=("cache",))
DECODE_JITS = {"default": jax.jit(_decode_steps, **_DECODE_JIT),
               "exhaustive": jax.jit(_decode_steps, **_DECODE_JIT, compiler_options={
                   "xla_gpu_exhaustive_tiling_search": True})}


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "tp"), donate_argnames=("cache",))
def nll(params, cache, tokens, positions, slots, page_tables, seq_lens, targets, *, cfg,
        backend, tp=None, state_slots=None):
    """Per-position NLL of ``targets`` [B, T]. Static: cfg, backend, tp. Donated: cache."""
    hidden, cache = _forward(params, cache, tokens, positions, slots, page_tables, seq_lens,
                             state_slots, cfg=cfg, backend=backend, tp=tp)
    logits = transformer.logits(params, hidden)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return nll, logits, _placed(cache, tp)
