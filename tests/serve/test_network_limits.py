"""A server facing a network (issue 39), in-process with the fake engine: the API key, body
size, per-request work bounds, the queue bound and its metrics, the request deadline, and the
flags that set them. Real-process start-up failures: ``test_server_startup_errors.py``."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest

from jfp8kv.engine.types import RequestOutput
from jfp8kv.serve.app import build_app
from jfp8kv.serve.async_engine import AsyncEngine
from jfp8kv.serve.limits import MAX_LOGPROB_ENTRIES, ServerLimits
from jfp8kv.serve.protocol import MAX_STOP_STRINGS

from .fake_engine import FakeEngine

KEY = "sk-test-" + "9f3a" * 6


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 500 for c in text]

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


class SlowEngine(FakeEngine):
    """FakeEngine whose steps take ``step_s`` (a request of n tokens lasts n steps)."""

    step_s = 0.02

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        return super().step()


async def _run(body, limits: ServerLimits | None = None, engine: FakeEngine | None = None):
    fake = engine or FakeEngine()
    ae = AsyncEngine(fake, idle_wait_s=0.05)
    app = build_app(ae, served_model_name="fake", tokenizer=_Tokenizer(),
                    chat_prompt=lambda msgs: "".join(m["content"] for m in msgs),
                    max_model_len=fake.max_model_len, vocab_size=1000, limits=limits)
    ae.start()  # ASGITransport does not run the lifespan
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            return await asyncio.wait_for(body(client, fake, ae), 30)
    finally:
        await asyncio.to_thread(ae.shutdown)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if name + "{" not in line or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _completion(**kw) -> dict:
    return {"prompt": [1, 2], "max_tokens": 3, **kw}


def test_api_key_guards_every_route_but_health_and_metrics(caplog):
    caplog.set_level(logging.DEBUG)

    async def body(client, fake, ae):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": "Bearer " + KEY + "x"}):
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models"), ("GET", "/docs")):
                r = await client.request(method, path, headers=headers, json=_completion())
                assert r.status_code == 401, (headers, path, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and "Bearer" in err["message"]
                assert KEY not in r.text and r.headers["www-authenticate"] == "Bearer"
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        good = {"Authorization": "Bearer " + KEY}
        r = await client.post("/v1/completions", headers=good, json=_completion())
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "<3><4><5>"
        assert (await client.get("/v1/models", headers=good)).status_code == 200

        # The openai client sends the key as a bearer token; a wrong one is its AuthError.
        http = httpx.AsyncClient(transport=client._transport, base_url="http://fake/v1")
        ok = openai.AsyncOpenAI(base_url="http://fake/v1", api_key=KEY, http_client=http,
                                max_retries=0)
        out = await ok.completions.create(model="fake", prompt=[1, 2], max_tokens=2)
        assert out.choices[0].text == "<3><4>"
        bad = openai.AsyncOpenAI(base_url="http://fake/v1", api_key="nope", http_client=http,
                                 max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="fake", max_tokens=2,
                                              messages=[{"role": "user", "content": "hi"}])

    limits = ServerLimits(api_key=KEY)
    asyncio.run(_run(body, limits))
    assert KEY not in caplog.text and KEY not in repr(limits)


def test_body_size_limit_is_413_for_declared_and_chunked_bodies():
    async def body(client, fake, ae):
        big = _completion(prompt="x" * 2000)
        r = await client.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "1000 bytes" in r.json()["error"]["message"]

        async def chunks():  # no Content-Length: counted while read
            data = json.dumps(big).encode()
            for i in range(0, len(data), 100):
                yield data[i:i + 100]

        r = await client.post("/v1/completions", content=chunks(),
                              headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        r = await client.post("/v1/completions", json=_completion())  # under the limit
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    asyncio.run(_run(body, ServerLimits(max_body_bytes=1000)))


def test_work_bounds_are_400_naming_the_limit():
    async def body(client, fake, ae):
        # 4 choices x (2 + 40) = 168 tokens > the 100-token pool
        r = await client.post("/v1/completions", json=_completion(n=4, max_tokens=40))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens", r.text
        assert "168" in err["message"] and "100 tokens" in err["message"]
        assert "--kv-cache-memory" in err["message"]
        r = await client.post("/v1/completions", json=_completion(n=2, max_tokens=40))
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        # Defaulted chat max_tokens (the context's remainder) is not held to the pool.
        r = await client.post("/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi"}], "n": 2})
        assert r.status_code == 200, r.text
        stops = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
        r = await client.post("/v1/completions", json=_completion(stop=stops))
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
        assert str(MAX_STOP_STRINGS) in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json=_completion(stop=stops[:-1]))
        assert r.status_code == 200
        r = await client.post("/v1/completions", json=_completion(stop=["y" * 300]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"

    asyncio.run(_run(body, ServerLimits(pool_tokens=100)))


def test_logprob_work_bound(monkeypatch):
    import jfp8kv.serve.limits as limits_mod

    monkeypatch.setattr(limits_mod, "MAX_LOGPROB_ENTRIES", 200)

    async def body(client, fake, ae):
        # 2 choices x 10 tokens x (20 + 1) = 420 entries > 200
        r = await client.post("/v1/completions", json=_completion(n=2, max_tokens=10,
                                                                 logprobs=20))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "logprobs" and "200" in err["message"]

    asyncio.run(_run(body))
    assert MAX_LOGPROB_ENTRIES >= 32768 * 21  # a full 32k choice with 20 alternatives fits


def test_request_timeout_aborts_and_frees_pages():
    """Past --request-timeout a request is 408 (non-streaming) or ends with an error event
    (streaming); its engine requests are aborted, so the fake pool is empty again."""
    async def body(client, fake, ae):
        r = await client.post("/v1/completions", json=_completion(max_tokens=60, n=2))
        err = r.json()["error"]
        assert r.status_code == 408 and err["code"] == "request_timeout", r.text
        assert "0.3 s" in err["message"]
        async with client.stream("POST", "/v1/completions",
                                 json=_completion(max_tokens=60, stream=True)) as s:
            lines = [ln async for ln in s.aiter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "request_timeout"
        assert len(lines) >= 3  # some tokens streamed before the deadline
        for _ in range(100):
            await asyncio.sleep(0.05)
            m = (await client.get("/metrics")).text
            if _metric(m, "jfp8kv_kv_cache_pages_used") == 0:
                break
        assert not fake.running and not fake.waiting
        assert _metric(m, "jfp8kv_kv_cache_pages_used") == 0
        assert _metric(m, "jfp8kv_requests_timed_out_total") == 2
        r = await client.post("/v1/completions", json=_completion(max_tokens=3))
        assert r.status_code == 200  # short requests still fit in the deadline

    asyncio.run(_run(body, ServerLimits(request_timeout_s=0.3), SlowEngine()))


def test_queue_bound_is_503_at_once_and_counted():
    async def body(client, fake, ae):
        # Two fit the queue (one may start running, letting a third in); the rest are
        # refused while those last (~3 s each).
        rs = await asyncio.gather(*(client.post("/v1/completions",
                                                json=_completion(max_tokens=60, prompt=[i + 1]))
                                    for i in range(5)))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and codes.count(503) >= 2, codes
        for r in rs:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "server_overloaded"
        m = (await client.get("/metrics")).text
        assert (_metric(m, 'jfp8kv_requests_rejected_total{reason="server_overloaded"}')
                == codes.count(503))
        assert "jfp8kv_queue_length" in m

    slow = SlowEngine(max_running=1, max_queue_len=2)
    slow.step_s = 0.05
    asyncio.run(_run(body, engine=slow))


def test_server_flags(monkeypatch):
    from jfp8kv.serve.__main__ import parse_args

    monkeypatch.delenv("JFP8KV_API_KEY", raising=False)
    args = parse_args(["--max-num-seqs", "12"])
    assert args.max_queue_len == 12 and args.api_key is None and args.request_timeout is None
    assert parse_args(["--max-queued-requests", "3"]).max_queue_len == 3
    assert parse_args(["--max-queue-len", "5"]).max_queue_len == 5
    monkeypatch.setenv("JFP8KV_API_KEY", KEY)
    assert parse_args([]).api_key == KEY
    assert parse_args(["--api-key", "other"]).api_key == "other"
    for bad in (dict(api_key=" "), dict(max_body_bytes=0), dict(request_timeout_s=-1.0)):
        with pytest.raises(ValueError):
            ServerLimits(**bad)
