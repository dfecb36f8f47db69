"""DeepSeek-V4 through the engine at a context that fills many HCA entries and exceeds the
CSA top-k many times over (random tiny preset, float32, CPU: window 6, CSA m = 4 with
top-3, HCA m = 8, pages of 16 tokens): prompts of 150, 90 and 37 tokens, prefilled in
chunks of 64 beside decode, then 16 greedy tokens each (up to 166 tokens: 41 CSA entries,
20 HCA entries, 11 pages). The engine's greedy tokens equal the dense reference forward's
(``deepseek_v4.forward`` with the pools' storage), fp8 and bf16 pools, through the
engine's CPU backend (the jnp twins of the in-place path) and, for fp8, through the
Pallas kernels in interpret mode (the runner's backend switched after the build: the
engine refuses a Pallas backend on the CPU); on a GPU (``-m gpu``) through the compiled
kernels. Every value of the pools is NaN before the
first request (rows, scales, compressor state, the padding page and slot): what the
sequences write replaces it, and nothing else may be read."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv import LLM, SamplingParams
from jfp8kv.models import deepseek_v4 as dv4
from jfp8kv.models.loader import load_model

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
_RNG = np.random.default_rng(57)
PROMPTS = [_RNG.integers(0, 95, n).tolist() for n in (150, 90, 37)]
STORAGE = {"bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}


@pytest.fixture(scope="module")
def loaded():
    return load_model("random:deepseek-v4-tiny", "float32")


@functools.cache
def reference_greedy(storage: str) -> list[list[int]]:
    """Greedy tokens of the dense reference forward: the prompts as one padded chunk with
    per-row real counts, then batched decode steps."""
    lm = load_model("random:deepseek-v4-tiny", "float32")
    cfg, params = lm.config, lm.params
    ids = np.zeros((len(PROMPTS), 160), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = p
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    logits, state = dv4.forward(params, dv4.init_state(cfg, len(PROMPTS), 256),
                                jnp.asarray(ids), cfg, storage=storage, n_new=lens)
    out = [jnp.take_along_axis(logits, (lens - 1)[:, None, None], 1)[:, 0].argmax(-1)]
    for _ in range(GREEDY.max_tokens - 1):
        logits, state = dv4.forward(params, state, out[-1][:, None], cfg, storage=storage)
        out.append(logits[:, 0].argmax(-1))
    return np.stack([np.asarray(t) for t in out], 1).tolist()


def _llm(loaded, kv):
    """The engine, its pools all NaN."""
    llm = LLM(loaded=loaded, dtype="float32", kv_cache_dtype=kv, max_model_len=256,
              max_num_seqs=4, decode_buckets=(4,), max_num_batched_tokens=64,
              decode_steps=4)
    runner = llm.engine.runner
    runner.cache = jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), runner.cache)
    return llm


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_long_context_greedy_equals_the_reference_forward(loaded, kv):
    llm = _llm(loaded, kv)
    assert llm.cache_info()["attention_backend"] == "reference"
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference_greedy(STORAGE[kv])


def test_long_context_through_the_kernels_in_interpret_mode(loaded):
    llm = _llm(loaded, "fp8_e4m3")
    llm.engine.runner.backend = "pallas_interpret"  # the kernels, and the grouped MoE
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference_greedy("float8_e4m3fn")


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_gpu_long_context_through_the_kernels(loaded, kv):
    """On a GPU the engine runs the compiled kernels (backend pallas) over NaN-filled pools;
    the reference forward on the same device is the twin. float32 at the highest matmul
    precision; the two sum in different orders (tf32 products in the kernels), so a near
    tie may flip a greedy token and everything after it: each prompt's first token must
    agree and at least 90% of all tokens."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs an NVIDIA GPU")
    with jax.default_matmul_precision("highest"):
        llm = _llm(loaded, kv)
        assert llm.cache_info()["attention_backend"] == "pallas"
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        want = reference_greedy(STORAGE[kv])
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    print(f"{kv}: {same} of {sum(map(len, want))} tokens agree")
    assert [g[0] for g in got] == [w[0] for w in want]
    assert same >= 0.9 * sum(map(len, want))
