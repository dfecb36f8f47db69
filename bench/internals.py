"""The one place where benchmarks reach past jfp8kv's public API (``LLM``, ``SamplingParams``).

Everything else in bench/ goes through these helpers, so an engine refactor has one file
to follow. What each needs and why:

* ``step_stats``: the engine's per-step recorder (``LLMEngine.stats``, off by default);
* ``decode_dispatch``: one jitted multi-step decode on hand-made rows, to time the step
  alone against its memory floor (``bench.decode_floor``);
* ``prefill_dispatch``: the prefill of hand-made chunks (``bench.prefill_profile``);
* ``fill_cache_random``: random K/V pages and dynamic scales (or, for a cache without a
  dense "kv" pool, DeepSeek-V4's say, every pool's rows, scales and state), so that timed
  attention reads realistic data;
* ``default_fp8_scale_mode``: the scale mode ``kv_cache_dtype="fp8"`` gets when none is
  named (records and server command lines name it explicitly);
* ``weight_bytes``: the parameters' bytes on the device;
* ``kv_bytes_per_token``: the pool's bytes per token for a KV dtype and scale mode (to size
  a pool to what a benchmark needs); ``pool_sizes``: the family's layout's page size, bytes
  per page and per state slot (any family: DeepSeek-V4's slots and raised page size);
* ``eos_after``: requests that end early as if EOS were sampled (random weights never sample
  it), for workloads such as chat where outputs stop far below max_tokens
  (``bench.offline --eos-after``);
* ``admission_state``: the admission policy's learned ratio and floor;
* ``engine``: the ``LLMEngine`` itself, to add requests as a conversation needs them and
  step it (``bench.agent``: each turn is submitted when the last one ends);
* ``without_prefix_cache``: the same engine (compiled steps, pools) on a fresh scheduler
  with prefix caching off, for a cache-off replay of the same prompts;
* ``reusable_tokens``: how many tokens of a conversation the cache would serve now (its
  cached pages, cut to end at a state snapshot where the family needs one), read on the
  host without admitting anything.

(Nothing here changes an engine's settings at run time: knobs such as the minimum prefill
chunk are ``EngineConfig`` fields, given when the ``LLM`` is built. ``eos_after`` changes
sampled tokens, inside its block only.)
"""

from __future__ import annotations

import contextlib


def default_fp8_scale_mode() -> str:
    from jfp8kv.kvcache.cache import DEFAULT_FP8_SCALE_MODE

    return DEFAULT_FP8_SCALE_MODE


def step_stats(llm):
    """The engine's ``jfp8kv.engine.stats.StepStats``."""
    return llm.engine.stats


def decode_dispatch(llm, rows, num_steps: int, greedy: bool = True, logprobs: bool = False):
    """One decode dispatch of ``num_steps`` steps. rows: (last_token, position, pages, limit);
    ``logprobs``: every row asks for log-probs (the engine's feature_executables policy picks
    the switched or the per-mix executable). Returns the device array of tokens
    [B_bucket, num_steps] (with log-probs: (tokens, log-probs)), not waited for."""
    from jfp8kv.engine.sampler import SamplingArrays, SamplingExtras

    sampling = SamplingArrays.empty(len(rows))
    sampling.extras = SamplingExtras(logprobs=True) if logprobs else None
    return llm.engine.runner.decode(rows, sampling, greedy, num_steps)


def prefill_dispatch(llm, chunks):
    """The prefill dispatches of ``chunks`` ((token_ids, start, pages) each, as the engine
    makes them). Returns the device outputs (not waited for)."""
    from jfp8kv.engine.sampler import SamplingArrays

    parts = llm.engine.runner.prefill(chunks, SamplingArrays.empty(len(chunks)))
    return [out for _, out in parts]


def fill_cache_random(llm, key) -> None:
    """Overwrite every layer's K/V pages and dynamic scales with random values (static
    scales stay), one layer at a time, freeing the old buffers as it goes, so the pool never
    exists twice on the device and no timing runs on zeros."""
    import jax

    from jfp8kv.kvcache.cache import as_pool

    if "kv" not in llm.engine.runner.cache.pools:
        return _fill_pools_random(llm, key)
    cache = llm.engine.runner.cache["kv"]

    @jax.jit
    def rnd(x, k):  # values of the storage dtype, in the pool's representation
        return as_pool(jax.random.normal(k, x.shape, "float32") * 2, cache.config)

    @jax.jit
    def rnd_scale(x, k):
        return (jax.random.uniform(k, x.shape) * 0.02 + 0.001).astype(x.dtype)

    for i in range(len(cache.k)):
        for j, (arrs, fn) in enumerate(((cache.k, rnd), (cache.v, rnd),
                                        (cache.k_scale, rnd_scale), (cache.v_scale, rnd_scale))):
            if arrs[i].ndim >= 3:  # pages and dynamic scales; static scales stay
                old = arrs[i]
                arrs[i] = fn(old, jax.random.fold_in(key, 4 * i + j))
                old.delete()


def _fill_pools_random(llm, key) -> None:
    """Every leaf of every pool replaced, one at a time (the old buffer freed before the
    next): float16 leaves (fp8 block scales) uniform in [0.001, 0.021], the others
    (rows of any storage dtype, float32 state) N(0, 2) in their dtype."""
    import jax

    runner = llm.engine.runner

    @jax.jit
    def rnd(x, k):
        if x.dtype == jax.numpy.float16:
            return (jax.random.uniform(k, x.shape) * 0.02 + 0.001).astype(x.dtype)
        return (jax.random.normal(k, x.shape, "float32") * 2).astype(x.dtype)

    leaves, tree = jax.tree.flatten(runner.cache)
    for i, old in enumerate(leaves):
        leaves[i] = rnd(old, jax.random.fold_in(key, i))
        old.delete()
    runner.cache = jax.tree.unflatten(tree, leaves)


def pool_sizes(cfg, kv_cache_dtype: str, mode: str | None, page_size: int,
               dtype: str = "bfloat16") -> tuple[int, int, int]:
    """(page size, bytes per page, bytes per state slot) of ``cfg``'s family's cache layout
    for a user KV dtype name and scale mode: the page size as the engine raises it (a V4
    page holds whole windows of every compress ratio), 0 bytes per slot without slot
    pools."""
    from jfp8kv.kvcache.fp8 import storage_dtype_name
    from jfp8kv.kvcache.layout import CacheRequest
    from jfp8kv.models import families

    storage = storage_dtype_name(kv_cache_dtype, dtype)
    req = CacheRequest(storage, mode if storage.startswith("float8") else None)
    layout = families.of(cfg).cache_layout(cfg, req, "reference")
    ps = layout.page_size(page_size)
    return ps, layout.bytes_per_page(ps), layout.bytes_per_slot() if layout.slots else 0


def weight_bytes(llm) -> int:
    """Bytes of the model's parameters on the device."""
    import jax

    leaves = jax.tree_util.tree_leaves(llm.engine.runner.params)
    return int(sum(x.size * x.dtype.itemsize for x in leaves))


def kv_bytes_per_token(cfg, kv_cache_dtype: str, mode: str | None, dtype: str = "bfloat16") -> int:
    """Bytes per token of every layer's K, V and scales (``kvcache.cache.bytes_per_token``)
    for a user KV dtype name (``bfloat16``, ``fp8_e4m3``, ...) and scale mode."""
    from jfp8kv.kvcache.cache import bytes_per_token
    from jfp8kv.kvcache.fp8 import storage_dtype_name

    storage = storage_dtype_name(kv_cache_dtype, dtype)
    return bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, storage,
                           mode if storage.startswith("float8") else None)


@contextlib.contextmanager
def eos_after(llm, counts):
    """Within the block, the i-th request added to ``llm``'s engine gets the engine's EOS id
    in place of its ``counts[i]``-th sampled token (if it is still running then), so the
    engine's own stop rule ends it there: finish reason "stop", the EOS kept in token_ids
    and left out of the text, pages freed, the admission policy told of the finish, exactly
    as for a sampled EOS. Nothing else learns the count: scheduling and admission see only
    the request's SamplingParams (max_tokens). Requests must not set ignore_eos. Yields
    {request_id: count}. Wraps the engine's ``add_request`` and ``_take`` (the post-processing
    of a row's sampled tokens) for the block only."""
    import numpy as np

    engine = llm.engine
    if not engine.eos_token_ids:
        raise ValueError(f"{engine.model_name} has no EOS token id to end requests with")
    eos = min(engine.eos_token_ids)
    todo, stop_at = iter(counts), {}
    add, take = engine.add_request, engine._take

    def add_request(request_id, prompt, params=None):
        if params is None or params.ignore_eos:
            raise ValueError("eos_after needs SamplingParams with ignore_eos=False")
        add(request_id, prompt, params)
        stop_at[request_id] = int(next(todo))

    def take_until_eos(seq, toks, *rest):
        j = stop_at.get(seq.request_id, 0) - 1 - len(seq.output_ids)  # index of token N
        if 0 <= j < len(toks):
            toks = np.array(toks)
            toks[j] = eos
        return take(seq, toks, *rest)

    engine.add_request, engine._take = add_request, take_until_eos
    try:
        yield stop_at
    finally:
        del engine.add_request, engine._take  # the class's methods again


def admission_state(llm) -> dict:
    """The admission policy and its learned state (``jfp8kv.engine.admission``): the ratio
    of each request's output budget it reserves now and the learned floor (None: no finish
    seen yet)."""
    a = llm.engine.scheduler.admission
    return dict(policy=a.policy, ratio=a.ratio, used=a.used)


def engine(llm):
    """The ``LLMEngine`` of ``llm`` (``add_request``, ``step``, ``has_unfinished``,
    ``metrics``)."""
    return llm.engine


def without_prefix_cache(llm) -> None:
    """Give ``llm``'s engine a fresh scheduler like its own (pages, slots, limits) with
    prefix caching off: what it had cached is forgotten (the pool's arrays stay)."""
    from jfp8kv.engine.scheduler import Scheduler
    from jfp8kv.kvcache.allocator import PageAllocator

    old = llm.engine.scheduler
    if old.has_work():
        raise RuntimeError("without_prefix_cache needs an idle engine")
    states = old.scratch_state_slot - 1 if old.scratch_state_slot else 0
    llm.engine.scheduler = Scheduler(
        PageAllocator(old.allocator.num_pages), old.page_size, old.max_model_len,
        old.max_num_seqs, old.max_num_batched_tokens, old.decode_steps,
        enable_prefix_caching=False, state_slots=states, admission=old.admission.policy)


def reusable_tokens(llm, tokens) -> int:
    """Tokens of ``tokens`` (a conversation so far) that an admission would take from the
    cache now: its longest run of cached pages, cut to end at a state snapshot where the
    family keeps a state (``PrefixCache.restore_point``), in tokens."""
    cache = llm.engine.scheduler.prefix_cache
    if cache is None:
        return 0
    keys: list[bytes] = []
    hit = cache.match(list(tokens), keys)
    pages = cache.restore_point(keys, len(hit))[0] if cache.snapshots else len(hit)
    return pages * cache.page_size
