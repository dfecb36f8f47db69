"""No XLA compile after /health on the CPU (issue 38): a server with the CPU's default shape
policy (only --max-model-len and the tiny model given) compiles every bucket before /health,
then serves a matrix of prompt lengths (each side of every chunk bucket, past a page-table
width, chunked prefill), batch sizes (each decode bucket), greedy and sampled, streamed and
not, completions and chat, with and without log-probs, penalties, min_tokens and prompt
scoring (``echo``, as lm-evaluation-harness's loglikelihood asks), alone and mixed in one
batch, while its ``jfp8kv_xla_compiles`` counter stays flat."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from .conftest import ServerProcess, metric_values, wait_idle

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """A compilation cache of this module's own: the first server starts cold (compiles,
    stores the step executables), the second warm (loads them without tracing)."""
    return tmp_path_factory.mktemp("ready-compiles-jax-cache")


@pytest.fixture(scope="module", params=["cold", "warm"])
def default_policy_server(tiny_model_dir, tmp_path_factory, jax_cache, request):
    log = tmp_path_factory.mktemp("ready-compiles") / "server.log"
    srv = ServerProcess(tiny_model_dir, log, jax_cache, "--max-model-len", str(MAX_MODEL_LEN),
                        "--log-level", "info")  # the precompile line says what loaded
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()
    loaded = re.search(r"\((\d+) executables loaded from", log.read_text())
    assert loaded, "no precompile line in the server log"
    assert (int(loaded.group(1)) > 0) == (request.param == "warm")


def post(url: str, path: str, body: dict) -> httpx.Response:
    r = httpx.post(url + path, json={"model": "tiny", **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r


def test_nothing_compiles_after_health(default_policy_server, tiny_tokenizer):
    url = default_policy_server.url
    rng = np.random.default_rng()
    vocab = len(tiny_tokenizer)
    before = metric_values(url)["jfp8kv_xla_compiles_total"]
    # (prompt tokens, max_tokens): chunk buckets 16/64/256 and one past each, chunked
    # prefill (> 256 tokens), decode crossing the 256-token page-table width.
    lengths = [(1, 4), (15, 3), (16, 3), (17, 3), (63, 2), (64, 2), (65, 2), (255, 8),
               (256, 3), (257, 3), (600, 5), (1000, 24)]

    # request i asks for FEATURES[i % 5]; concurrent batches mix them
    features = [{}, {"logprobs": 3}, {"presence_penalty": 0.5, "frequency_penalty": 0.2},
                {"repetition_penalty": 1.3, "min_tokens": 2}, {"echo": True, "logprobs": 2}]

    def completion(i: int, plen: int, max_tokens: int, stream: bool = False) -> None:
        ids = rng.integers(3, vocab, plen).tolist()
        r = post(url, "/v1/completions", dict(
            prompt=ids, max_tokens=max_tokens, ignore_eos=True, stream=stream,
            temperature=0 if i % 2 else 0.8, seed=i, **features[i % len(features)]))
        if not stream:
            assert r.json()["usage"]["completion_tokens"] == max_tokens

    for i, (plen, n) in enumerate(lengths):  # one at a time: decode batch 1
        completion(i, plen, n)
    for width in (5, len(lengths)):  # concurrent: decode batches of 8 and 64 rows
        with ThreadPoolExecutor(width) as ex:
            list(ex.map(lambda a: completion(a[0], *a[1], stream=a[0] % 3 == 0),
                        enumerate(lengths[-width:])))
    for extra in ({}, {"logprobs": True, "top_logprobs": 2}):
        post(url, "/v1/chat/completions", dict(
            messages=[{"role": "user", "content": "Say something about pages."}], max_tokens=6,
            **extra))
    for plen in (5, 70, 600):  # prompt scoring alone: one chunk, and chunked past 256 tokens
        scored = post(url, "/v1/completions", dict(
            prompt=rng.integers(3, vocab, plen).tolist(), max_tokens=0, echo=True, logprobs=1))
        assert len(scored.json()["choices"][0]["logprobs"]["token_logprobs"]) == plen
    wait_idle(url)
    assert metric_values(url)["jfp8kv_xla_compiles_total"] == before
