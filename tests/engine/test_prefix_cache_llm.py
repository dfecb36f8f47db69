"""Prefix caching end to end through jfp8kv.LLM on the tiny qwen3 checkpoint (CPU).

float64 compute (the check mode), so a page computed in another request's prefill holds
exactly the numbers this request's own prefill would store: greedy tokens must then be
identical with and without caching, for bf16 and fp8 pages alike.
"""

import contextlib

import jax
import numpy as np
import pytest

from jfp8kv import SamplingParams
from jfp8kv.engine.llm import LLM
from jfp8kv.engine.scheduler import Scheduler
from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.models.loader import load_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
KV = [("bfloat16", None), ("fp8_e4m3", "token"), ("fp8_e5m2", "channel")]


@contextlib.contextmanager
def _x64():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


@pytest.fixture(scope="module")
def qwen3_f64(tiny_hf_checkpoint):
    with _x64():
        return load_model(str(tiny_hf_checkpoint("qwen3")), "float64")


def make(loaded, kv, mode, caching):
    llm = LLM(loaded=loaded, dtype="float64", kv_cache_dtype=kv, kv_scale_mode=mode,
              kv_scales=0.05 if mode == "channel" else None, max_model_len=128,
              kv_cache_memory=1 << 20, max_num_batched_tokens=64, page_size=16)
    if not caching:  # the same engine on a scheduler without a prefix cache
        old = llm.engine.scheduler
        llm.engine.scheduler = Scheduler(
            PageAllocator(old.allocator.num_pages), old.page_size, old.max_model_len,
            old.max_num_seqs, old.max_num_batched_tokens, old.decode_steps,
            enable_prefix_caching=False)
    return llm


def run_in_turn(llm, prompts):
    """Each request alone, after the previous one finished (the multi-turn pattern); returns
    the generated tokens and each request's prompt tokens served from the cache."""
    tokens, cached = [], []
    for i, p in enumerate(prompts(tokens)):
        llm.engine.add_request(f"r{i}", p, GREEDY)
        seq = llm.engine._seqs[f"r{i}"]
        while llm.engine.has_unfinished():
            llm.engine.step()
        tokens.append(seq.output_ids)
        cached.append(seq.num_cached_prompt_tokens)
    return tokens, cached


@pytest.mark.parametrize("kv,mode", KV)
def test_greedy_tokens_identical_with_and_without_prefix_caching(qwen3_f64, kv, mode):
    rng = np.random.default_rng(0)
    vocab = qwen3_f64.config.vocab_size
    head = rng.integers(3, vocab, 40).tolist()
    a = head + rng.integers(3, vocab, 5).tolist()
    b = head + rng.integers(3, vocab, 9).tolist()

    def prompts(done):
        yield a  # cold
        yield b  # shares 2 full pages (32 tokens) of a's prompt
        yield a  # the same prompt again: the page holding the last token is recomputed
        yield a + done[0] + [5, 6, 7]  # a follow-up turn: a's prompt and answer pages

    with _x64():
        llm = make(qwen3_f64, kv, mode, True)
        cached_run, hits = run_in_turn(llm, prompts)
        plain_run, no_hits = run_in_turn(make(qwen3_f64, kv, mode, False), prompts)
    assert cached_run == plain_run
    assert hits == [0, 32, 32, 48] and no_hits == [0, 0, 0, 0]
    sched = llm.engine.scheduler
    stats = sched.prefix_cache_stats()
    assert stats.hit_tokens == 112 and stats.queried_tokens == 45 + 49 + 45 + 60
    assert sched.allocator.num_used == 0 and stats.cached_pages > 0
