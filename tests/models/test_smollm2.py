"""The embedded default model, SmolLM2-135M-Instruct (GGUF Q4_1), against transformers.

transformers dequantizes the same GGUF file, so both sides run identical fp32 weights.
"""

import inspect

import numpy as np
import pytest

import jfp8kv

pytestmark = pytest.mark.timeout(900)


def natural_text_ids(tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """Python's own documentation topics: natural English prose shipped with CPython."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tokenizer.encode(text[offset:offset + 12 * n_tokens])
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    p = smollm2_gguf_path
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    return jfp8kv.LLM(dtype="float32", max_model_len=1024, kv_cache_memory=256 << 20,
                      max_num_batched_tokens=256)


def test_nll_matches_transformers_over_natural_text(llm, hf_model):
    import torch

    ids = natural_text_ids(llm.tokenizer, 600)
    nll = llm.nll(ids)  # chunks of 256 through the paged cache
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    ref = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]),
                                            reduction="none").numpy()
    assert nll.shape == ref.shape and np.isfinite(nll).all()
    err = np.abs(nll - ref)
    assert err.max() < 1e-3, f"max per-token NLL difference {err.max():.2e}"
    assert 1.0 < ref.mean() < 5.0  # real text, a real model: sanity of the reference


def test_greedy_generation_matches_transformers(llm, hf_model):
    import torch

    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Explain what a KV cache is in one sentence."]
    prompts = [llm.tokenizer.encode(llm.chat_prompt([{"role": "user", "content": q}]),
                                    add_special_tokens=False) for q in questions]
    outs = llm.generate(prompts, jfp8kv.SamplingParams(max_tokens=24, temperature=0,
                                                       ignore_eos=True))
    # transformers 5.25 renamed forward's past_key_values (and the output's) to cache; 5.17
    # (the H200 machine) has only the old name
    kw = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    for p, o in zip(prompts, outs):
        ref = []
        with torch.no_grad():  # plain greedy loop: EOS is an ordinary token, like ignore_eos
            # transformers' own KV cache: one prefill, then 23 one-token steps (re-running the
            # whole sequence each step cost ~8 minutes of CI under load)
            step = hf_model(torch.tensor([p]), use_cache=True)
            for _ in range(24):
                ref.append(int(step.logits[0, -1].argmax()))
                if len(ref) < 24:
                    step = hf_model(torch.tensor([ref[-1:]]), use_cache=True,
                                    **{kw: getattr(step, kw)})
        assert o.token_ids == ref, (llm.tokenizer.decode(o.token_ids), llm.tokenizer.decode(ref))
        assert o.finish_reason == "length" and o.text
