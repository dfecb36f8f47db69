"""Overlap scheduling returns exactly the serialized path's tokens and text (tiny llama, CPU):
a matrix of request mixes (greedy and seeded, EOS, stop strings, stop_token_ids, max_tokens,
min_tokens, penalties, logprobs), preemption under a small pool, and aborts."""

import dataclasses

import numpy as np
import pytest

from jfp8kv import SamplingParams
from jfp8kv.engine.llm import LLM
from jfp8kv.models.loader import load_model


@pytest.fixture(scope="module")
def llama(tiny_hf_checkpoint):
    return load_model(str(tiny_hf_checkpoint("llama")), "float32")


def make(loaded, overlap, **kw):
    kw = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": 1 << 20,
          "max_num_batched_tokens": 64, "overlap_scheduling": overlap, **kw}
    return LLM(loaded=loaded, **kw)


def _prompts(vocab, lens, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, k).tolist() for k in lens]


def _mix(llm, seed):
    """Prompts and per-request params: every stop rule and sampling feature, with stop ids
    and strings taken from a free-running greedy pass so that they do fire."""
    rng = np.random.default_rng(seed)
    vocab = llm.config.vocab_size
    ps = _prompts(vocab, rng.integers(2, 50, 10), seed)
    free = llm.generate(ps[:4], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    eos = sorted(llm.engine.eos_token_ids)
    g = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    params = [
        dataclasses.replace(g, stop_token_ids=[free[0].token_ids[int(rng.integers(1, 15))]]),
        dataclasses.replace(g, stop=[free[1].text[5:7] or "x"], logprobs=3),
        dataclasses.replace(g, stop_token_ids=[free[2].token_ids[3]], min_tokens=6,
                            presence_penalty=0.5),
        dataclasses.replace(g, stop_token_ids=eos + [free[3].token_ids[2]], ignore_eos=False),
        SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=1.0, top_p=0.9,
                       seed=int(rng.integers(1 << 30)), ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.8, top_k=20, seed=3, logprobs=2,
                       stop=["e", "ab"], ignore_eos=True),
        dataclasses.replace(g, max_tokens=1),
        dataclasses.replace(g, repetition_penalty=1.3, frequency_penalty=0.2),
        SamplingParams(max_tokens=25, temperature=1.0, seed=11),  # EOS may stop it
        dataclasses.replace(g, max_tokens=40),
    ]
    return ps, params


def _key(outs):
    """Tokens, text, finish reason and log-probs (rounded: batch composition differs
    between the paths, which moves float32 logits in their last bits)."""
    return [(o.token_ids, o.text, o.finish_reason,
             None if o.logprobs is None else [
                 (e.token_id, round(e.logprob, 3), [(t, round(v, 3)) for t, v in e.top])
                 for e in o.logprobs]) for o in outs]


@pytest.mark.parametrize("decode_steps", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_overlapped_equals_serialized(llama, decode_steps, seed):
    serial = make(llama, False, decode_steps=decode_steps)
    over = make(llama, True, decode_steps=decode_steps)
    ps, params = _mix(serial, seed)
    a = serial.generate(ps, params)
    b = over.generate(ps, params)
    assert _key(a) == _key(b)
    assert over.engine.scheduler.allocator.num_used == 0
    assert not over.engine.has_unfinished()


@pytest.mark.parametrize("admission", ["greedy", "reserve"])
def test_overlapped_equals_serialized_under_preemption(llama, admission):
    """A pool of ~12 pages of 16 tokens (512 bytes a token) for 8 requests of up to 57
    tokens: preemptions under greedy admission; reserve admission (which starts fewer at
    once and counts tokens in flight as generated) returns the same tokens too."""
    kw = dict(kv_cache_memory=100_000, page_size=16, max_model_len=64, decode_steps=2,
              max_num_batched_tokens=32, admission=admission)
    outs = []
    for overlap in (False, True):
        llm = make(llama, overlap, **kw)
        pages = llm.engine.scheduler.allocator
        ps = _prompts(llama.config.vocab_size, [20, 30, 9, 25, 14, 33, 5, 18], 7)
        sp = [SamplingParams(max_tokens=24, temperature=t, seed=i, ignore_eos=True,
                             stop_token_ids=[5] if i % 3 == 0 else None)
              for i, t in enumerate([0, 1, 0, 0.7, 0, 1, 0, 1])]
        outs.append((llm.generate(ps, sp), llm.engine.scheduler.num_preemptions))
        assert pages.num_used == 0
    (a, na), (b, nb) = outs
    assert _key(a) == _key(b)
    if admission == "greedy":
        assert na > 0 and nb > 0


def test_aborts_while_a_step_is_in_flight(llama):
    results = []
    for overlap in (False, True):
        llm = make(llama, overlap, decode_steps=2)
        eng = llm.engine
        ps = _prompts(llama.config.vocab_size, [10, 20, 30, 12], 3)
        for i, p in enumerate(ps):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0,
                                                       ignore_eos=True))
        final, steps = {}, 0
        while eng.has_unfinished():
            steps += 1
            if steps == 4:
                eng.abort_request("r1")
            if steps == 6:
                eng.abort_request("r2")
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o
        assert eng.scheduler.allocator.num_used == 0
        results.append(final)
    a, b = results
    assert {k: v.finish_reason for k, v in a.items()} == {k: v.finish_reason for k, v in b.items()}
    for rid in ("r0", "r3"):
        assert a[rid].token_ids == b[rid].token_ids
    for rid in ("r1", "r2"):  # aborted: what was read is a prefix of the full output
        assert a[rid].finish_reason == "abort"
        assert a["r0"].token_ids is not None


def test_decode_gemm_autotune_picks_its_jit_and_keeps_the_tokens(llama):
    """Each ``decode_gemm_autotune`` value runs its own decode jit (``steps.DECODE_JITS``);
    the option only changes how XLA tiles the GEMMs on a GPU, so on the CPU the tokens are
    the same."""
    from jfp8kv.engine import steps

    ps = _prompts(llama.config.vocab_size, [7, 19, 33], 5)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for choice in ("default", "exhaustive"):
        llm = make(llama, True, decode_steps=2, decode_gemm_autotune=choice)
        assert llm.engine.runner._decode is steps.DECODE_JITS[choice]
        outs[choice] = [o.token_ids for o in llm.generate(ps, sp)]
    assert outs["default"] == outs["exhaustive"]
    assert steps.DECODE_JITS["default"] is not steps.DECODE_JITS["exhaustive"]
