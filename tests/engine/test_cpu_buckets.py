"""CPU shape policy: page-table width buckets and a warm-up that covers every dispatch."""

import jax
import numpy as np
import pytest

from jfp8kv import SamplingParams
from jfp8kv.engine.llm import LLM
from jfp8kv.models.loader import load_model


@pytest.fixture(scope="module")
def llama_bf16(tiny_hf_checkpoint):
    return load_model(str(tiny_hf_checkpoint("llama")), "bfloat16")


def make(loaded, **kw):
    kw = {"dtype": "bfloat16", "page_size": 8, "kv_cache_memory": 1 << 22,
          "max_num_batched_tokens": 64, "max_num_seqs": 8, **kw}
    return LLM(loaded=loaded, compile_cache=False, **kw)


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_short_sequences_decode_the_same_at_any_max_model_len(llama_bf16, kv):
    rng = np.random.default_rng()
    ps = [rng.integers(3, llama_bf16.config.vocab_size, n).tolist() for n in (5, 30, 70)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    short = make(llama_bf16, kv_cache_dtype=kv, max_model_len=128)
    long = make(llama_bf16, kv_cache_dtype=kv, max_model_len=1024)
    assert short.engine.runner.page_widths == (16,)
    assert long.engine.runner.page_widths == (32, 128)
    a, b = short.generate(ps, sp), long.generate(ps, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_no_compile_after_warmup(llama_bf16):
    llm = make(llama_bf16, max_model_len=1024)
    llm.warmup(progress=False)
    compiles = []

    def listen(event, duration, **kw):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        rng = np.random.default_rng()
        vocab = llama_bf16.config.vocab_size
        for n_req, plen, max_tokens in [(1, 3, 5), (3, 17, 30), (5, 60, 12), (8, 40, 300),
                                        (2, 200, 20)]:
            ps = [rng.integers(3, vocab, plen + i).tolist() for i in range(n_req)]
            sps = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=1, ignore_eos=True)
                   for t in ([0] * n_req if n_req % 2 else [0.8] * n_req)]
            outs = llm.generate(ps, sps)
            assert all(len(o.token_ids) == max_tokens for o in outs)
    finally:
        from jax._src import monitoring

        monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
