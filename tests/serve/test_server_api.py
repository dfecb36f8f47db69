"""The API pieces clients and eval harnesses use, through the openai client against the real
server (tiny checkpoint, see conftest): n and best_of, logprobs in both formats, the
lm-evaluation-harness loglikelihood protocol (echo + logprobs + max_tokens=0), penalties,
min_tokens, stop_token_ids, and max_tokens beyond the context."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from .conftest import MAX_MODEL_LEN, wait_idle

PROMPT = "Once upon a time in a land far away"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_n_choices_completions_and_chat_stream_and_not(server):
    c = client(server)
    res = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, temperature=1.0,
                               seed=11, extra_body={"ignore_eos": True})
    assert [ch.index for ch in res.choices] == [0, 1, 2]
    assert len({ch.text for ch in res.choices}) > 1  # distinct seeds, distinct samples
    assert res.usage.completion_tokens == 18
    again = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, temperature=1.0,
                                 seed=11, extra_body={"ignore_eos": True})
    assert [ch.text for ch in again.choices] == [ch.text for ch in res.choices]
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3,
                                       temperature=1.0, seed=11, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    texts = ["", "", ""]
    for ch in chunks[:-1]:
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == [ch.text for ch in res.choices]
    assert chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == res.usage.prompt_tokens

    chat = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, n=2,
                                     temperature=0)
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    streamed = ["", ""]
    for ch in c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, n=2,
                                        temperature=0, stream=True):
        streamed[ch.choices[0].index] += ch.choices[0].delta.content or ""
    assert streamed == [ch.message.content for ch in chat.choices]
    wait_idle(server.url)


def test_best_of_returns_the_likeliest_candidate(server):
    c = client(server)
    res = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, best_of=3,
                               temperature=1.0, seed=3, logprobs=0,
                               extra_body={"ignore_eos": True})
    assert len(res.choices) == 1 and res.usage.completion_tokens == 15
    cands = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=3,
                                 temperature=1.0, seed=3, logprobs=0,
                                 extra_body={"ignore_eos": True})
    best = max(cands.choices, key=lambda ch: sum(ch.logprobs.token_logprobs))
    assert res.choices[0].text == best.text


def test_chat_logprobs(server):
    res = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == res.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token  # greedy takes the likeliest
        assert e.bytes == list(e.token.encode())
        vals = [t.logprob for t in e.top_logprobs]
        assert vals == sorted(vals, reverse=True)
    plain = client(server).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                                   temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_stream_and_not(server):
    c = client(server)
    res = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                               logprobs=2, extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == res.choices[0].text
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok in top and top[tok] == pytest.approx(val) and max(top.values()) == top[tok]
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                       logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks if ch.choices[0].logprobs
               for o in ch.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


@pytest.fixture(scope="module")
def offline_llm(tiny_model_dir):
    """The server's model and settings in this process, to score with ``LLM.nll``."""
    from jfp8kv import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN,
               max_num_batched_tokens=512, kv_cache_memory=12 * 8192)


def test_echo_loglikelihood_protocol_equals_llm_nll(server, offline_llm, tiny_tokenizer):
    """lm-evaluation-harness's local-completions loglikelihood request: echo, logprobs=1,
    max_tokens=0, temperature 0; the prompt's log-probs come back, the first one null."""
    c = client(server)
    ids = tiny_tokenizer.encode("The capital of France is Paris, and the sea is blue.")
    res = c.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=0,
                               temperature=0)
    ch = res.choices[0]
    assert ch.text == tiny_tokenizer.decode(ids) and res.usage.completion_tokens == 0
    got = ch.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)
    np.testing.assert_allclose(got[1:], -offline_llm.nll(ids), rtol=1e-5, atol=1e-6)
    assert all(len(t) >= 1 for t in ch.logprobs.top_logprobs[1:])
    # a string prompt with generation after the echo: prompt then completion
    res = c.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=0, max_tokens=3,
                               temperature=0, extra_body={"ignore_eos": True})
    n_prompt = res.usage.prompt_tokens
    assert res.choices[0].text.startswith(PROMPT)
    assert len(res.choices[0].logprobs.token_logprobs) == n_prompt + 3
    wait_idle(server.url)


def test_penalties_min_tokens_and_stop_token_ids(server, offline_llm, tiny_tokenizer):
    """The random tiny model never repeats within 24 tokens, so the effect shown is the
    other sign: negative presence/frequency penalties make it repeat its own output, and
    repetition_penalty < 1 makes it repeat the prompt (the formula is checked against numpy
    in tests/engine/test_sampler.py)."""
    from jfp8kv import SamplingParams

    c = client(server)
    ids = tiny_tokenizer.encode(PROMPT)
    base = dict(model="tiny", prompt=ids, max_tokens=24, temperature=0, logprobs=0)

    def tokens(**kw):
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        res = c.completions.create(**base, **kw, extra_body=extra)
        return res.choices[0].logprobs.tokens

    plain = tokens()
    assert len(set(plain)) > 20
    assert len(set(tokens(presence_penalty=-2.0, frequency_penalty=-2.0))) <= 4
    prompt_texts = {tiny_tokenizer.decode([t]) for t in ids}
    rep = tokens(extra_body={"repetition_penalty": 0.05})
    assert sum(t in prompt_texts for t in rep) > sum(t in prompt_texts for t in plain) + 10
    stop = offline_llm.generate(ids, SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    base.pop("logprobs")
    first = c.completions.create(**base, extra_body={"stop_token_ids": [stop], "ignore_eos": True})
    assert first.choices[0].finish_reason == "stop" and first.usage.completion_tokens == 1
    held = c.completions.create(**base, extra_body={"stop_token_ids": [stop], "min_tokens": 4,
                                                    "ignore_eos": True})
    assert held.usage.completion_tokens >= 4
    chat = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                     temperature=0, presence_penalty=1.0,
                                     extra_body={"min_tokens": 8})
    assert chat.usage.completion_tokens == 8


def test_max_tokens_beyond_context_is_400_naming_the_limit(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match=str(MAX_MODEL_LEN)) as e:
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=100000)
    assert e.value.body["param"] == "max_tokens"
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_MODEL_LEN)
