"""Prefix caching as clients see it, through the openai client against the real server (tiny
checkpoint, see conftest; prefix caching on, the default): OpenAI's
``usage.prompt_tokens_details.cached_tokens`` in completions and chat, whole and streamed,
and the prefix-cache counters of /metrics."""

from __future__ import annotations

import numpy as np
import openai

from .conftest import metric_values, wait_idle

PAGE = 16  # the server's page size (the default)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_repeated_prompt_reports_cached_tokens_and_metrics_count_hits(server):
    c = client(server)
    ids = np.random.default_rng(18).integers(100, 20000, 40).tolist()  # never sent before
    wait_idle(server.url)
    before = metric_values(server.url)
    first = c.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    again = c.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 40
    # 40 tokens: 2 full pages reused; the page holding the last token is recomputed
    assert cached(first.usage) == 0 and cached(again.usage) == 2 * PAGE
    assert again.choices[0].text == first.choices[0].text  # greedy, same numbers

    chunks = list(c.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert cached(chunks[-1].usage) == 2 * PAGE
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == first.choices[0].text
    # n choices: the prompt is counted once, as request 0 (admitted first) saw it
    res = c.completions.create(model="tiny", prompt=ids, max_tokens=3, n=2, temperature=0)
    assert res.usage.prompt_tokens == 40 and cached(res.usage) == 2 * PAGE

    after = wait_idle(server.url)
    hits = after["jfp8kv_prefix_cache_hits_total"] - before["jfp8kv_prefix_cache_hits_total"]
    queries = (after["jfp8kv_prefix_cache_queries_total"]
               - before["jfp8kv_prefix_cache_queries_total"])
    assert hits >= 4 * 2 * PAGE and queries == 5 * 40
    assert (after["jfp8kv_prompt_tokens_cached_total"]
            - before["jfp8kv_prompt_tokens_cached_total"]) >= 4 * 2 * PAGE
    assert 0 < after["jfp8kv_prefix_cache_hit_rate"] <= 1
    assert after["jfp8kv_prefix_cache_pages"] >= 2
    assert "jfp8kv_prefix_cache_evictions_total" in after


def test_chat_reports_cached_tokens_of_a_repeated_conversation(server):
    c = client(server)
    messages = [{"role": "user", "content": "Describe prefix caching in a paged KV cache, "
                                            "then explain why a partial page is never shared."}]
    first = c.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                      temperature=0)
    again = c.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                      temperature=0, stream=True,
                                      stream_options={"include_usage": True})
    usage = list(again)[-1].usage
    n = first.usage.prompt_tokens
    assert usage.prompt_tokens == n and n > 2 * PAGE
    assert cached(usage) == (n - 1) // PAGE * PAGE  # all full pages but the last token's
    assert 0 <= cached(first.usage) < n and cached(first.usage) % PAGE == 0
    wait_idle(server.url)
