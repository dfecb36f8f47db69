"""/tokenize, /detokenize and /tokenizer_info (vLLM's shapes) in-process over a fake engine,
with the default model's real tokenizer (built from its GGUF), against transformers'
AutoTokenizer loaded from the same tokenizer saved as a folder."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from jfp8kv.serve.app import build_app
from jfp8kv.serve.async_engine import AsyncEngine
from jfp8kv.serve.tokenize import save_tokenizer

from .fake_engine import FakeEngine

MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def tokenizers(smollm2_gguf_path, smollm2_tokenizer_dir):
    """(the server's tokenizer, the transformers reference)."""
    from transformers import AutoTokenizer

    from jfp8kv.models.gguf_tokenizer import load_gguf_tokenizer

    return (load_gguf_tokenizer(smollm2_gguf_path),
            AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir), local_files_only=True))


def call(tokenizer, requests):
    """Send ``requests`` ([(method, path, json)]) to a fresh app; returns the responses."""
    def chat_prompt(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    async def run():
        ae = AsyncEngine(FakeEngine(), idle_wait_s=0.05)
        app = build_app(ae, served_model_name="smol", tokenizer=tokenizer,
                        chat_prompt=chat_prompt, max_model_len=MAX_MODEL_LEN)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.request(m, p, json=j) for m, p, j in requests]

    return asyncio.run(run())


def random_text(rng: random.Random) -> str:
    words = ["fp8", "cache", " page", "Paris", "é", "東京", "\n", "  ", "!", "<|im_end|>",
             "tokens", "42", "x"]
    return "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randint(1, 30)))


def test_tokenize_and_detokenize_match_transformers(tokenizers):
    ours, ref = tokenizers
    rng = random.Random()
    texts = [random_text(rng) for _ in range(8)]
    reqs = [("POST", "/tokenize", {"prompt": t, "add_special_tokens": special,
                                   "return_token_strs": True})
            for t in texts for special in (True, False)]
    ids = [ref.encode(t, add_special_tokens=s) for t in texts for s in (True, False)]
    reqs += [("POST", "/detokenize", {"tokens": x, "model": "smol"}) for x in ids]
    out = call(ours, reqs)
    assert all(r.status_code == 200 for r in out), [r.text for r in out if r.status_code != 200]
    for r, want in zip(out[:len(ids)], ids):
        body = r.json()
        assert body == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want,
                        "token_strs": ref.convert_ids_to_tokens(want)}
    for r, x in zip(out[len(ids):], ids):
        assert r.json() == {"prompt": ref.decode(x)}


def test_tokenize_chat_matches_the_template(tokenizers):
    ours, ref = tokenizers
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is fp8?"},
                {"role": "assistant", "content": "A byte"}]
    variants = [dict(), dict(add_generation_prompt=False),
                dict(add_generation_prompt=False, continue_final_message=True)]
    out = call(ours, [("POST", "/tokenize", {"messages": messages, **v}) for v in variants])
    for r, v in zip(out, variants):
        text = ref.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=v.get("add_generation_prompt", True),
                                       continue_final_message=v.get("continue_final_message",
                                                                    False))
        assert r.status_code == 200
        assert r.json()["tokens"] == ref.encode(text, add_special_tokens=False)
        assert r.json()["token_strs"] is None


def test_tokenizer_info_and_errors(tokenizers):
    ours, ref = tokenizers
    out = call(ours, [
        ("GET", "/tokenizer_info", None),
        ("POST", "/tokenize", {"prompt": "hi", "model": "other"}),
        ("POST", "/detokenize", {"tokens": [1, len(ref) + 5]}),
        ("POST", "/detokenize", {"tokens": [-1]}),
        ("POST", "/tokenize", {"text": "no prompt field"}),
        ("POST", "/tokenize", {"messages": [{"role": "user", "content": "x"}],
                               "continue_final_message": True}),
    ])
    info = out[0].json()
    assert info["eos_token"] == ref.eos_token and info["bos_token"] == ref.bos_token
    assert info["chat_template"] == ref.chat_template
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert out[1].status_code == 404 and out[1].json()["error"]["param"] == "model"
    for r in out[2:4]:
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert out[4].status_code == 400 and "error" in out[4].json()
    assert out[5].status_code == 400
    assert out[5].json()["error"]["param"] == "continue_final_message"


def test_save_tokenizer_writes_an_hf_folder(tiny_hf_checkpoint, tmp_path):
    """``python -m jfp8kv.serve.tokenize --out DIR``: a folder AutoTokenizer loads, encoding
    as the model's own tokenizer does."""
    from transformers import AutoTokenizer

    model = tiny_hf_checkpoint("llama")
    out = save_tokenizer(str(model), str(tmp_path / "tok"))
    text = random_text(random.Random())
    saved = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ref = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    assert saved.encode(text) == ref.encode(text)
