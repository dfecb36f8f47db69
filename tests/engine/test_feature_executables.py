"""The GPU's executables policy, run on the CPU (``variants.Variants`` with plain decode per
sampler mode, as a GPU builds it): after the warm-up, requests with log-probs, penalties,
min_tokens and prompt scoring, greedy and sampled, alone and mixed, at several batch and
prompt shapes compile nothing (issue 39: the H100 soak compiled 7 executables after /health),
and they give the outputs of the former per-mix executables."""

import dataclasses

import numpy as np
import pytest

from jfp8kv import SamplingParams
from jfp8kv.engine.variants import Variants

from tests.engine.test_cpu_buckets import backend_compiles, batched_prefill, make
from tests.engine.test_sampling_features import assert_same_outputs

FEATURES = [{}, {"logprobs": 3}, {"presence_penalty": 1.0, "frequency_penalty": 0.3},
            {"repetition_penalty": 1.3, "min_tokens": 3, "logprobs": 0},
            {"prompt_logprobs": 2}]


def gpu_style(llm, feature_executables: str = "switched"):
    """``llm``'s runner with a GPU's variants (plain decode not switched) and batched prefill,
    before anything compiles."""
    runner = batched_prefill(llm).engine.runner
    runner.variants = dataclasses.replace(runner.variants, switch_plain=False,
                                          feature_executables=feature_executables)
    return llm


def test_variants_per_policy():
    cpu, gpu, per_mix = (Variants(f, plain, 64) for f, plain in (
        ("switched", True), ("switched", False), ("per-mix", False)))
    assert cpu.of("decode") == cpu.of("prefill") == ((None, True),)
    assert gpu.of("decode") == ((True, False), (False, False), (None, True))
    assert gpu.of("prefill") == ((None, False), (None, True))  # plain prefill stays plain
    assert per_mix.of("decode") == ((True, False), (False, False))
    assert per_mix.of("prefill") == ((None, False),)
    assert not gpu.switched("decode", False) and gpu.switched("decode", True)
    assert not gpu.switched("prefill", False) and gpu.switched("prefill", True)
    assert not per_mix.switched("decode", True) and not per_mix.switched("prefill", True)


def _workload(vocab: int, seed: int):
    """(prompts, params) batches: each a batch of one to eight requests whose features cycle
    through FEATURES, greedy and sampled, prompts from 2 to 150 tokens (chunk buckets 16 and
    64, chunked prefill past 64, decode batches 1 and 8)."""
    rng = np.random.default_rng(seed)
    batches = []
    for n_req, plen, max_tokens in [(1, 3, 6), (1, 40, 5), (3, 17, 9), (8, 9, 12),
                                    (5, 70, 6), (2, 150, 4)]:
        prompts = [rng.integers(3, vocab, plen + i).tolist() for i in range(n_req)]
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i,
                                 temperature=0.8 if (i + n_req) % 2 else 0,
                                 **FEATURES[(i + plen) % len(FEATURES)])
                  for i in range(n_req)]
        batches.append((prompts, params))
    one = ([rng.integers(3, vocab, 50).tolist()],  # prompt scoring alone, no output
           [SamplingParams(max_tokens=0, prompt_logprobs=1)])
    return batches + [one]


@pytest.fixture(scope="module")
def llama_f32(tiny_hf_checkpoint):
    from jfp8kv.models.loader import load_model

    return load_model(str(tiny_hf_checkpoint("llama")), "float32")


def test_no_feature_compiles_after_warmup_and_per_mix_outputs(llama_f32):
    llm = gpu_style(make(llama_f32, dtype="float32", max_model_len=256, decode_steps=4))
    llm.warmup(progress=False)
    batches = _workload(llama_f32.config.vocab_size, np.random.default_rng().integers(1 << 30))
    with backend_compiles() as compiles:
        switched = [llm.generate(*batch) for batch in batches]
    assert compiles == []
    runner = llm.engine.runner
    runner.variants = dataclasses.replace(runner.variants, feature_executables="per-mix")
    with backend_compiles() as compiles:
        per_mix = [llm.generate(*batch) for batch in batches]
    assert compiles, "the former per-mix executables compile on first use"
    for outs, refs in zip(switched, per_mix):
        for a, b in zip(outs, refs):
            assert_same_outputs(a, b)
    assert any(o.logprobs for outs in switched for o in outs)
    assert any(o.prompt_logprobs for outs in switched for o in outs)
