"""Prefix caching end to end through jfp8kv.LLM (CPU): the tiny qwen3 and llama checkpoints
and SmolLM2 (the default model), bf16 pages and every fp8 scale mode.

float64 compute (the check mode), so a page computed in another request's prefill holds
exactly the numbers this request's own prefill would store: greedy tokens and ``LLM.nll``
must then be identical with and without caching, for bf16 and fp8 pages alike.

The poisoned-page test fills every page the allocator hands out or frees to the clean list
with NaN (K, V and per-page scales, directly in the cache arrays) and forces evictions: a
request that read a page it did not compute itself, or a freed or evicted page's stale
contents, would turn NaN or diverge from the (unpoisoned) run without caching.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv import SamplingParams
from jfp8kv.engine.llm import LLM
from jfp8kv.engine.scheduler import Scheduler
from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.models.loader import load_model
from tests.tiny_checkpoints import first_layers
from tests.x64 import x64

pytestmark = pytest.mark.timeout(900)

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
E4M3_MODES = [("fp8_e4m3", m) for m in ("tensor", "channel", "token", "block")]
KV = [("bfloat16", None), *E4M3_MODES, ("fp8_e5m2", "channel")]


@pytest.fixture(scope="module")
def tiny_f64(tiny_hf_checkpoint):
    """``tiny_f64(family)``: the tiny checkpoint loaded in float64, once per family."""
    loaded = {}

    def get(family):
        if family not in loaded:
            with x64():
                loaded[family] = load_model(str(tiny_hf_checkpoint(family)), "float64")
        return loaded[family]

    return get


def make(loaded, kv, mode, caching, *, kv_cache_memory=1 << 20, static_scale=0.05,
         max_model_len=128):
    llm = LLM(loaded=loaded, dtype="float64", kv_cache_dtype=kv, kv_scale_mode=mode,
              kv_scales=static_scale if mode in ("tensor", "channel") else None,
              max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
              max_num_batched_tokens=64, page_size=16)
    if not caching:  # the same engine on a scheduler without a prefix cache
        old = llm.engine.scheduler
        llm.engine.scheduler = Scheduler(
            PageAllocator(old.allocator.num_pages), old.page_size, old.max_model_len,
            old.max_num_seqs, old.max_num_batched_tokens, old.decode_steps,
            enable_prefix_caching=False)
    return llm


def run_in_turn(llm, prompts, params=GREEDY):
    """Each request alone, after the previous one finished (the multi-turn pattern); returns
    the generated tokens and each request's prompt tokens served from the cache (as its
    RequestOutput reports them)."""
    tokens, cached = [], []
    for p in prompts(tokens):
        out = llm.generate(p, params)[0]
        tokens.append(out.token_ids)
        cached.append(out.num_cached_tokens)
    return tokens, cached


def shared_prefix_prompts(rng, vocab, head_len=40):
    head = rng.integers(3, vocab, head_len).tolist()
    a = head + rng.integers(3, vocab, 5).tolist()
    b = head + rng.integers(3, vocab, 9).tolist()

    def prompts(done):
        yield a  # cold
        yield b  # shares 2 full pages (32 tokens) of a's prompt
        yield a  # the same prompt again: the page holding the last token is recomputed
        yield a + done[0] + [5, 6, 7]  # a follow-up turn: a's prompt and answer pages

    return a, prompts


# tiny llama's head_dim (16) does not fit 32-wide scale blocks
@pytest.mark.parametrize("family,kv,mode", [("qwen3", *x) for x in KV] + [
    ("llama", *x) for x in KV if x[1] != "block"])
def test_greedy_and_nll_identical_with_and_without_prefix_caching(tiny_f64, family, kv, mode):
    loaded = tiny_f64(family)
    a, prompts = shared_prefix_prompts(np.random.default_rng(0), loaded.config.vocab_size)
    with x64():
        llm = make(loaded, kv, mode, True)
        cached_run, hits = run_in_turn(llm, prompts)
        plain = make(loaded, kv, mode, False)
        plain_run, no_hits = run_in_turn(plain, prompts)
        # Scoring after the cached run takes pages that held other requests' K/V.
        scored = a + cached_run[0]
        nll_cached, nll_plain = llm.nll(scored), plain.nll(scored)
    assert cached_run == plain_run
    assert hits == [0, 32, 32, 48] and no_hits == [0, 0, 0, 0]
    np.testing.assert_array_equal(nll_cached, nll_plain)
    assert np.isfinite(nll_cached).all()
    sched = llm.engine.scheduler
    stats = sched.prefix_cache_stats()
    assert stats.hit_tokens == 112 and stats.queried_tokens == 45 + 49 + 45 + 60
    assert sched.allocator.num_used == 0 and stats.cached_pages > 0
    assert llm.cache_info()["prefix_cache"]["hit_tokens"] == 112


# ---------------------------------------------------------------------- poisoned pages


def poison_pages(llm, pages) -> None:
    """Overwrite ``pages``' K, V and per-page scales with NaN in the engine's cache arrays."""
    pages = [p for p in pages]
    if not pages:
        return
    runner = llm.engine.runner
    c = runner.cache["kv"]
    idx = jnp.asarray(pages, jnp.int32)

    def nan(x):  # [heads, pages, ...] leaves only: static scales are not per page
        return x.at[:, idx].set(jnp.nan) if x.ndim >= 3 else x

    runner.cache = runner.cache.replace(kv=dataclasses.replace(
        c, k=[nan(x) for x in c.k], v=[nan(x) for x in c.v],
        k_scale=[nan(x) for x in c.k_scale], v_scale=[nan(x) for x in c.v_scale]))


def poison_on_reuse(llm) -> list[int]:
    """From now on, pages handed out (clean or evicted) and pages freed clean are NaN.
    Returns a list that collects every page poisoned."""
    alloc = llm.engine.scheduler.allocator
    allocate, free = alloc.allocate, alloc.free
    seen: list[int] = []

    def poisoned_allocate(n):
        pages = allocate(n)
        poison_pages(llm, pages)
        seen.extend(pages)
        return pages

    def poisoned_free(pages):
        pages = list(pages)
        free(pages)
        clean = [p for p in set(pages) if alloc.refcount(p) == 0 and not alloc.is_cached(p)]
        poison_pages(llm, clean)
        seen.extend(clean)

    alloc.allocate, alloc.free = poisoned_allocate, poisoned_free
    return seen


@pytest.mark.parametrize("kv,mode", [("bfloat16", None), ("fp8_e4m3", "tensor"),
                                     ("fp8_e4m3", "token"), ("fp8_e4m3", "block")])
def test_poisoned_freed_and_evicted_pages_never_reach_a_request(tiny_f64, kv, mode):
    loaded = tiny_f64("qwen3")
    rng = np.random.default_rng(1)
    vocab = loaded.config.vocab_size
    heads = [rng.integers(3, vocab, 48).tolist() for _ in range(3)]
    tails = [rng.integers(3, vocab, 7).tolist() for _ in range(4)]
    # Three 48-token system prompts, asked in turn, then again: a 12-page pool holds one
    # request (4 pages) and a few cached pages, so later requests evict earlier prefixes.
    order = [(0, 0), (0, 1), (1, 0), (2, 0), (1, 1), (0, 2), (2, 1), (0, 3), (1, 2)]

    def prompts(done):
        for h, t in order:
            yield heads[h] + tails[t]

    with x64():
        probe = make(loaded, kv, mode, True)
        page_bytes = probe.cache_info()["pool_bytes"] // probe.cache_info()["num_pages"]
        llm = make(loaded, kv, mode, True, kv_cache_memory=12 * page_bytes)
        assert llm.cache_info()["num_pages"] <= 13
        poison_pages(llm, range(1, llm.engine.scheduler.allocator.num_pages))  # not the sink
        seen = poison_on_reuse(llm)
        tokens, hits = run_in_turn(llm, prompts)
        # Concurrent requests sharing a cached prefix, on the poisoned caching engine.
        batch = [heads[0] + tails[t] for t in range(3)]
        together = [o.token_ids for o in llm.generate(batch, GREEDY)]
        plain = make(loaded, kv, mode, False)  # clean pages, no prefix cache
        plain_tokens, _ = run_in_turn(plain, prompts)
        alone = [plain.generate(p, GREEDY)[0].token_ids for p in batch]
    assert tokens == plain_tokens and together == alone
    stats = llm.engine.scheduler.prefix_cache_stats()
    assert stats.evictions > 0 and stats.hit_tokens > 0 and sum(hits) > 0, stats
    assert len(seen) > llm.engine.scheduler.allocator.num_pages  # pages were reused
    # No NaN was ever stored: none reached a hidden state.
    assert llm.kv_stats()["nan_total"] == 0 and plain.kv_stats()["nan_total"] == 0


# ---------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_f64(smollm2_gguf_path):
    with x64():
        return first_layers(load_model(str(smollm2_gguf_path), "float64"), SMOLLM2_LAYERS)


# The real model's first layers (real tokenizer, chat template and head layout; whether a
# cached prefix changes anything does not depend on the depth: all 30 layers in float64 took
# ~100 s of CI's two cores), the default fp8 mode and bf16; every mode is covered on the tiny
# models above.
SMOLLM2_LAYERS = 4
@pytest.mark.parametrize("kv,mode", [("bfloat16", None), ("fp8_e4m3", "token")])
def test_smollm2_identical_with_and_without_prefix_caching(smollm2_f64, kv, mode):
    tok = smollm2_f64.tokenizer
    system = ("You are a careful assistant. Answer in one short sentence, plainly, without "
              "lists, and say so when you do not know.")
    questions = ["What is the capital of France?", "Name a prime number above ten.",
                 "What colour is the sky?"]
    chats = [tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}],
        tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for q in questions]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def prompts(done):
        yield from chats
        yield chats[0]  # asked again

    with x64():
        runs = {}
        for caching in (True, False):
            llm = make(smollm2_f64, kv, mode, caching, kv_cache_memory=8 << 20,
                       static_scale=0.1, max_model_len=256)
            runs[caching] = run_in_turn(llm, prompts, params) + (llm,)
        scored = chats[1] + runs[True][0][1]
        nll = {c: runs[c][2].nll(scored) for c in runs}
    (tokens, hits, llm), (plain_tokens, no_hits, _) = runs[True], runs[False]
    assert tokens == plain_tokens
    np.testing.assert_array_equal(nll[True], nll[False])
    assert np.isfinite(nll[True]).all()
    shared = min(len(c) for c in chats) // 16 * 16  # at least the system prompt's pages
    assert hits[0] == 0 and all(h >= 16 for h in hits[1:]) and no_hits == [0] * 4
    assert hits[3] == (len(chats[0]) - 1) // 16 * 16 and max(hits[1:3]) <= shared
    assert llm.kv_stats()["nan_total"] == 0
