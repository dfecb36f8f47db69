"""Server-side failures seen through the app (in-process, fake engine): a request whose
output handling fails gets a 500 (or an error event in its stream) and the rest go on."""

from __future__ import annotations

import asyncio
import json

import httpx

from jfp8kv.serve.app import build_app
from jfp8kv.serve.async_engine import AsyncEngine

from .fake_engine import FakeEngine


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 500 for c in text]


async def _run(body):
    fake = FakeEngine()
    ae = AsyncEngine(fake, idle_wait_s=0.05)
    app = build_app(ae, served_model_name="fake", tokenizer=_Tokenizer(),
                    chat_prompt=lambda msgs: "".join(m["content"] for m in msgs),
                    max_model_len=fake.max_model_len, vocab_size=1000)
    ae.start()  # ASGITransport does not run the lifespan
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            return await asyncio.wait_for(body(client, fake, ae), 20)
    finally:
        await asyncio.to_thread(ae.shutdown)


def test_failed_request_is_500_and_others_complete():
    async def body(client, fake, ae):
        bad, good = await asyncio.gather(
            client.post("/v1/completions", json={"prompt": [1, 666], "max_tokens": 3}),
            client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}))
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == "<3><4><5>"
        r = await client.post("/v1/completions", json={"prompt": [1, 666], "max_tokens": 3,
                                                        "stream": True})
        lines = [ln for ln in r.text.splitlines() if ln]
        assert lines[-1] == "data: [DONE]"
        assert "error" in json.loads(lines[-2][len("data: "):])

    asyncio.run(_run(body))


def test_unhealthy_engine_is_503_and_health_says_so():
    async def body(client, fake, ae):
        ae.failed_steps_in_a_row = 99
        r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert (await client.get("/health")).status_code == 503
        ae.failed_steps_in_a_row = 0
        assert (await client.get("/health")).status_code == 200

    asyncio.run(_run(body))


def test_chat_prompt_too_long_is_400():
    async def body(client, fake, ae):
        r = await client.post("/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "x" * 100}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"

    asyncio.run(_run(body))
