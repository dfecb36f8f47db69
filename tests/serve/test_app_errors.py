"""Server-side failures seen through the app (in-process, fake engine): a request whose
output handling fails gets a 500 (or an error event in its stream) and the rest go on."""

from __future__ import annotations

import asyncio
import json

import re

import httpx
import pytest

from jfp8kv.serve.app import build_app
from jfp8kv.serve.async_engine import AsyncEngine

from .fake_engine import FakeEngine


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 500 for c in text]


def _concat(msgs):
    return "".join(m["content"] for m in msgs)


async def _run(body, chat_prompt=_concat):
    fake = FakeEngine()
    ae = AsyncEngine(fake, idle_wait_s=0.05)
    app = build_app(ae, served_model_name="fake", tokenizer=_Tokenizer(),
                    chat_prompt=chat_prompt,
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


def _failing_template(exc):
    def chat_prompt(msgs):
        raise exc
    return chat_prompt


def test_chat_template_missing_dependency_is_500_and_bad_messages_400():
    """A template the server cannot render (jinja2 missing) is the server's fault; one the
    messages break is the client's. Completions keep working either way."""
    async def missing(client, fake, ae):
        r = await client.post("/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "jinja2" in r.json()["error"]["message"]
        ok = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert ok.status_code == 200

    async def broken(client, fake, ae):
        r = await client.post("/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"

    asyncio.run(_run(missing, _failing_template(ImportError("requires jinja2"))))
    asyncio.run(_run(broken, _failing_template(ValueError("roles must alternate"))))


def test_startup_probe_stops_on_missing_template_dependency(caplog):
    from jfp8kv.serve.__main__ import check_chat_template

    with pytest.raises(SystemExit, match="jinja2"):
        check_chat_template(_failing_template(ImportError("requires jinja2")))
    check_chat_template(_failing_template(ValueError("no chat template")))  # warns, goes on
    assert "no chat template" in caplog.text
    check_chat_template(_concat)


def test_declared_dependencies_render_the_default_models_chat_template():
    """The README's server command installs only the declared dependencies (no test extra,
    whose torch pulls jinja2 in); the chat endpoint needs jinja2 through transformers."""
    from importlib.metadata import requires

    names = {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0].lower() for r in requires("jfp8kv")
             if "extra ==" not in r}
    assert "jinja2" in names
