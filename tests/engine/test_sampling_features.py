"""Log-probs, prompt scoring, penalties and min_tokens through the offline API (tiny llama,
CPU, several decode steps per dispatch so the penalty state rides in the scan carry)."""

import dataclasses

import jax
import numpy as np
import pytest

from jfp8kv import SamplingParams
from jfp8kv.engine.llm import LLM
from jfp8kv.models.loader import load_model

from tests.engine.test_sampler import ref_penalize

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Two executables' float32 log-probs: bit-close on the CPU; a GPU runs float32 matmuls as
# TF32 (JAX's default precision), 1e-4 relative apart (H100, 2026-12-06)
TOL = 1e-6 if jax.default_backend() == "cpu" else 2e-3


@pytest.fixture(scope="module")
def llm(tiny_hf_checkpoint):
    loaded = load_model(str(tiny_hf_checkpoint("llama")), "float32")
    # the reference attention: the tiny head_dim 16 has no GPU kernel, and the features are
    # the sampler's, whatever the attention backend
    return LLM(loaded=loaded, dtype="float32", max_model_len=128, kv_cache_memory=1 << 20,
               max_num_batched_tokens=64, decode_steps=4, attention_backend="reference")


def _prompt(llm, n, seed=None):
    return np.random.default_rng(seed).integers(3, llm.config.vocab_size, n).tolist()


def test_prompt_logprobs_equal_minus_nll(llm):
    ids = _prompt(llm, 90)  # two scoring chunks of 64
    out = llm.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    plp = out.prompt_logprobs
    assert plp[0] is None and [e.token_id for e in plp[1:]] == ids[1:]
    # the prefill executable scores, llm.nll is its own: float32 rounding apart
    np.testing.assert_allclose([e.logprob for e in plp[1:]], -llm.nll(ids), rtol=TOL, atol=TOL)
    assert all(len(e.top) == 3 and e.top[0][1] >= e.logprob - 1e-6 for e in plp[1:])
    assert llm.engine.scheduler.allocator.num_used == 0
    # prompt scoring followed by generation: same tokens as without scoring
    both = llm.generate(ids[:20], dataclasses.replace(GREEDY, prompt_logprobs=0))[0]
    assert both.token_ids == llm.generate(ids[:20], GREEDY)[0].token_ids
    assert len(both.prompt_logprobs) == 20


def test_generated_logprobs_match_teacher_forcing(llm):
    ids = _prompt(llm, 9)
    out = llm.generate(ids, dataclasses.replace(GREEDY, logprobs=5))[0]
    assert [e.token_id for e in out.logprobs] == out.token_ids
    nll = llm.nll(ids + out.token_ids)[len(ids) - 1:]
    np.testing.assert_allclose([e.logprob for e in out.logprobs], -nll, rtol=max(TOL, 1e-4),
                               atol=max(TOL, 1e-4))
    for e in out.logprobs:  # greedy: the sampled token is the most likely one
        assert len(e.top) == 5 and e.top[0][0] == e.token_id
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
    assert llm.generate(ids, GREEDY)[0].logprobs is None


def _repeating_prompt(llm, n, max_tokens, tries=20):
    """A fresh random prompt whose plain greedy output repeats a token, so that presence,
    frequency and repetition penalties have something to act on (on a prompt whose output
    never repeats, the penalized argmax can equal the plain one at every step)."""
    for _ in range(tries):
        ids = _prompt(llm, n)
        plain = llm.generate(ids, dataclasses.replace(GREEDY, max_tokens=max_tokens))[0]
        if len(set(plain.token_ids)) < len(plain.token_ids):
            return ids, plain
    pytest.fail(f"no prompt in {tries} made greedy decoding repeat a token")


def test_penalized_greedy_is_argmax_of_reference_penalties(llm):
    ids, plain = _repeating_prompt(llm, 6, 16)
    sp = dataclasses.replace(GREEDY, max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5,
                             repetition_penalty=1.3)
    # batched with an unpenalized request, whose output must not change
    pen, other = llm.generate([ids, ids[:4]], [sp, dataclasses.replace(GREEDY, max_tokens=16)])
    assert other.token_ids == llm.generate(ids[:4], dataclasses.replace(GREEDY, max_tokens=16))[0].token_ids
    assert pen.token_ids != plain.token_ids
    _, logits = llm.nll(ids + pen.token_ids, return_logits=True)
    for t, tok in enumerate(pen.token_ids):
        ref = ref_penalize(logits[len(ids) - 1 + t], ids, pen.token_ids[:t], 1.5, 0.5, 1.3)
        assert ref[tok] >= ref.max() - 1e-3, (t, tok, ref.argmax())
    # the effect: penalties spread the output over more distinct tokens
    assert len(set(pen.token_ids)) > len(set(plain.token_ids))


def test_min_tokens_and_stop_token_ids(llm):
    ids = _prompt(llm, 7)
    free = llm.generate(ids, GREEDY)[0].token_ids
    stop = free[0]
    first = llm.generate(ids, dataclasses.replace(GREEDY, stop_token_ids=[stop]))[0]
    assert first.token_ids == [stop] and first.finish_reason == "stop"
    held = llm.generate(ids, dataclasses.replace(GREEDY, stop_token_ids=[stop], min_tokens=5))[0]
    assert stop not in held.token_ids[:5] and len(held.token_ids) >= 5
    if stop in held.token_ids:
        assert held.token_ids[-1] == stop and held.finish_reason == "stop"


def test_per_mix_structure_equals_the_switched_one(llm):
    """The runner's two ways to carry the features (``variants.Variants``): one structure
    switched on the device and one compiled per feature mix (the GPU's former way) give the
    same tokens, log-probs and prompt scores for a batch mixing plain, log-prob, penalized
    and prompt-scored requests."""
    rng = np.random.default_rng()
    prompts = [_prompt(llm, n) for n in (5, 11, 8, 20)]
    params = [dataclasses.replace(GREEDY, temperature=0.9, seed=int(rng.integers(1 << 30))),
              dataclasses.replace(GREEDY, logprobs=4),
              dataclasses.replace(GREEDY, presence_penalty=1.0, repetition_penalty=1.4,
                                  min_tokens=3),
              dataclasses.replace(GREEDY, prompt_logprobs=2, logprobs=0)]
    runner = llm.engine.runner
    default = runner.variants
    try:
        outs = {}
        for switched in (True, False):
            runner.variants = dataclasses.replace(
                default, feature_executables="switched" if switched else "per-mix")
            outs[switched] = llm.generate(prompts, params)
    finally:
        runner.variants = default
    for a, b in zip(outs[True], outs[False]):
        assert_same_outputs(a, b)


def assert_same_outputs(a, b):
    """Two RequestOutputs: the same tokens, log-prob and prompt log-prob entries (ids equal,
    values within 1e-5)."""
    assert a.token_ids == b.token_ids
    for mine, theirs in ((a.logprobs, b.logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
        assert (mine is None) == (theirs is None)
        for x, y in zip(mine or (), theirs or ()):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.token_id == y.token_id
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
                np.testing.assert_allclose([x.logprob] + [v for _, v in x.top],
                                           [y.logprob] + [v for _, v in y.top], atol=1e-5)


def test_new_fields_are_validated():
    for kw, word in [({"presence_penalty": 3}, "presence_penalty"),
                     ({"repetition_penalty": 0}, "repetition_penalty"),
                     ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
                     ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
                     ({"max_tokens": 0}, "prompt_logprobs")]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**kw)
    SamplingParams(max_tokens=0, prompt_logprobs=0)
