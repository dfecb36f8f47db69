"""Acceptance tests of ``python -m jfp8kv.serve`` (real engine, real process, 127.0.0.1)."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import struct
import time

import httpx
import openai
import pytest

from .conftest import MAX_MODEL_LEN, metric_values, wait_idle

PROMPTS = [f"Request {i}: about {w}" for i, w in
           enumerate(["cats", "the sea", "fp8", "paging", "JAX", "rivers", "tea", "clouds"] * 4)]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(server, prompt, max_tokens=10, **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_openai_client_stream_and_not(server, tiny_tokenizer):
    c = client(server)
    prompt = "The quick brown fox"
    n_prompt = len(tiny_tokenizer.encode(prompt))
    res = c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert res.object == "text_completion" and res.model == "tiny" and res.id.startswith("cmpl-")
    ch = res.choices[0]
    assert ch.finish_reason == "length" and ch.text
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == (
        n_prompt, 10, n_prompt + 10)

    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == res.choices[0].text  # greedy: streaming and not agree
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_openai_client_stream_and_not(server, tiny_tokenizer):
    c = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    templated = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n_prompt = len(tiny_tokenizer.encode(templated, add_special_tokens=False))
    res = c.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=7,
                                    temperature=0)
    assert res.object == "chat.completion" and res.choices[0].message.role == "assistant"
    assert res.choices[0].finish_reason in ("length", "stop")
    assert res.usage.prompt_tokens == n_prompt
    assert res.usage.total_tokens == n_prompt + res.usage.completion_tokens
    assert 1 <= res.usage.completion_tokens <= 7

    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=7,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == res.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == res.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_stream_without_usage_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": "abc", "max_tokens": 3, "stream": True,
                            "temperature": 0}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert all("usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_32_concurrent_requests_match_sequential(server):
    sequential = [complete(server, p)["choices"][0]["text"] for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        concurrent_res = list(pool.map(lambda p: complete(server, p), PROMPTS))
    assert [r["choices"][0]["text"] for r in concurrent_res] == sequential
    assert all(r["usage"]["completion_tokens"] == 10 for r in concurrent_res)
    wait_idle(server.url)


def test_seed_and_stop_are_forwarded(server):
    a = complete(server, "Once upon a time", max_tokens=8, temperature=0.9, seed=7)
    b = complete(server, "Once upon a time", max_tokens=8, temperature=0.9, seed=7)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    c = client(server)
    deltas = [ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)]
    full = "".join(deltas)
    # a stop string straddling two streamed pieces: its first half was streamable on its own
    i = next(i for i in range(len(deltas) - 1) if deltas[i] and deltas[i + 1])
    stop = deltas[i][-1] + deltas[i + 1][0]
    expect = full[:full.find(stop)]
    cut = complete(server, "Once upon a time", max_tokens=8, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == expect
    chunks = list(c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                       temperature=0, stop=[stop], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_token_id_prompt_and_one_element_list(server):
    ids = [5, 17, 300, 4000, 12]
    res = complete(server, ids, max_tokens=4)
    assert res["usage"]["prompt_tokens"] == len(ids)
    assert complete(server, [ids], max_tokens=4)["choices"][0]["text"] == res["choices"][0]["text"]
    assert complete(server, ["hello"], max_tokens=4)["choices"][0]["text"] == \
        complete(server, "hello", max_tokens=4)["choices"][0]["text"]


def test_client_disconnect_mid_stream_frees_pages(server):
    before = metric_values(server.url)['jfp8kv_requests_total{finish_reason=abort}']
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": "never ending story", "max_tokens": 100, "stream": True,
                            "ignore_eos": True, "temperature": 0}) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: {")
            if got >= 3:
                break  # leaving the block closes the connection mid-stream
    m = wait_idle(server.url)
    assert m['jfp8kv_requests_total{finish_reason=abort}'] == before + 1
    assert m["jfp8kv_kv_cache_pages_used"] == 0


def test_client_disconnect_while_waiting_non_streaming_aborts(server):
    before = metric_values(server.url)
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(_raw_request({"prompt": "wait for me", "max_tokens": 100, "ignore_eos": True,
                                "temperature": 0}))
        # until the engine runs it (bounded: 20 s). No sleep between polls: the tiny model
        # decodes its 100 tokens in a fraction of a second, and the client must leave first.
        deadline = time.monotonic() + 20
        while True:
            m = metric_values(server.url)
            if m["jfp8kv_num_requests_running"] > 0 or m["jfp8kv_kv_cache_pages_used"] > 0:
                break
            if time.monotonic() > deadline:
                raise AssertionError("request never started")
    m = wait_idle(server.url)
    key = 'jfp8kv_requests_total{finish_reason=%s}'
    assert m[key % "abort"] == before[key % "abort"] + 1
    assert m[key % "length"] == before[key % "length"]


def _raw_request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def _abrupt(port: int, i: int) -> None:
    req = _raw_request({"prompt": f"disconnect {i}", "max_tokens": 100, "ignore_eos": True,
                        "temperature": 0, "stream": i % 2 == 0})
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(req)
        if i % 6 == 0:
            s.recv(1)  # a stream has started: vanish mid-response
        else:
            time.sleep(0.01 * (i % 5))  # vanish while queued, prefilling or decoding
        # RST instead of FIN (SO_LINGER 0); the server may drop a request it had not read yet
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_200_abrupt_disconnects_leave_pool_whole(server):
    key = 'jfp8kv_requests_total{finish_reason=%s}'
    before = metric_values(server.url)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: _abrupt(server.port, i), range(200)))
    m = wait_idle(server.url, limit_s=120)
    assert m["jfp8kv_kv_cache_pages_used"] == 0
    # every request that reached the engine was aborted, none ran to its 100 tokens
    assert m[key % "abort"] - before[key % "abort"] >= 20
    assert m[key % "length"] == before[key % "length"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert complete(server, "still alive?", max_tokens=3)["usage"]["completion_tokens"] == 3


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, None),  # malformed JSON
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2, 3]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "word " * 400}, 400, "prompt"),  # > max_model_len
    ("/v1/completions", {"prompt": list(range(1, MAX_MODEL_LEN + 1))}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, "max_tokens"),
    ("/v1/nowhere", {"prompt": "x"}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{b[0].rsplit('/', 1)[-1]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input_is_4xx_with_error_object(server, path, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(
        body, bytes) else {"json": body}
    r = httpx.post(server.url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_models_health_and_metrics_parse(server):
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    complete(server, "count me", max_tokens=5)
    m = wait_idle(server.url)
    for name in ["jfp8kv_kv_cache_pages_total", "jfp8kv_kv_cache_saturated_total",
                 "jfp8kv_kv_cache_nan_total", "jfp8kv_preemptions_total",
                 "jfp8kv_time_to_first_token_seconds_count",
                 "jfp8kv_inter_token_latency_seconds_count", "jfp8kv_prompt_tokens_total"]:
        assert name in m, name
    assert m["jfp8kv_kv_cache_pages_total"] > 0
    assert m["jfp8kv_generated_tokens_total"] >= 5
    assert m["jfp8kv_requests_total{finish_reason=length}"] >= 1
    assert m["jfp8kv_time_to_first_token_seconds_count"] >= 1
    assert m["jfp8kv_kv_cache_nan_total"] == 0
