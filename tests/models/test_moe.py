"""Qwen3-MoE: grouped expert matmuls and end-to-end parity with transformers (float32).

A tiny random Qwen3-MoE checkpoint (8 experts, top-2, one dense layer among routed ones) is
written with transformers' ``save_pretrained``; the engine's logits must match transformers'
through the paged model (one-shot and chunked prefill, paged decode over shuffled pages,
unequal batch) and through ``LLM`` (float32 cache; fp8 cache against the engine's own
float64 paths and near the unquantized NLL).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.config import ModelConfig
from jfp8kv.models import moe
from jfp8kv.models.loader import load_model
from tests.models.test_parity import (GREEDY, PagedModel, assert_llm_matches_transformers,
                                       assert_paged_paths_match)
from tests.models.test_parity import small_llm as _llm
from tests.tiny_checkpoints import randomize, save_with_tokenizer
from tests.x64 import x64

VARIANTS = {  # name -> Qwen3MoeConfig overrides
    # layer 1 dense via mlp_only_layers, renormalized top-2 weights
    "mlp-only": dict(norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1),
    # every second layer routed (layer 1 only), raw softmax weights
    "sparse-step": dict(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2),
}


def _write_checkpoint(path, tokenizer_dir, variant, seed):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5,
                         rope_theta=1e6, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False, use_sliding_window=False, **VARIANTS[variant])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    randomize(model, seed)
    return save_with_tokenizer(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def qwen3_moe_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    made = {}

    def make(variant="mlp-only"):
        if variant not in made:
            path = tmp_path_factory.mktemp(f"tiny-qwen3-moe-{variant}")
            made[variant] = _write_checkpoint(path, tiny_tokenizer_dir, variant,
                                              seed=list(VARIANTS).index(variant))
        return made[variant]

    return make


def test_grouped_experts_equal_a_per_token_loop():
    rng = np.random.default_rng()
    n, k, e, d, i = 13, 3, 6, 16, 8
    x = rng.standard_normal((n, d)).astype(np.float32)
    ids = np.stack([rng.choice(e - 1, k, replace=False) for _ in range(n)]).astype(np.int32)
    ids[ids == 2] = 4  # expert 2 (and 5) get no tokens; duplicates within a row are allowed
    w = rng.random((n, k)).astype(np.float32)
    wg, wu = (rng.standard_normal((2, e, d, i)) / 4).astype(np.float32)
    wd = (rng.standard_normal((e, i, d)) / 3).astype(np.float32)
    got = np.asarray(jax.jit(moe.grouped_experts)(x, ids, w, wg, wu, wd))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    want = np.zeros((n, d), np.float64)
    for t in range(n):
        for j in range(k):
            ex = ids[t, j]
            want[t] += w[t, j] * ((silu(x[t] @ wg[ex]) * (x[t] @ wu[ex])) @ wd[ex])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_softmax_topk_matches_transformers_router():
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    rng = np.random.default_rng()
    h = rng.standard_normal((50, 16)).astype(np.float32)
    wr = rng.standard_normal((10, 16)).astype(np.float32) / 4
    for norm in (False, True):
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=10,
                                                   num_experts_per_tok=3, norm_topk_prob=norm))
        with torch.no_grad():
            router.weight.copy_(torch.from_numpy(wr))
            _, ref_w, ref_i = (t.numpy() for t in router(torch.from_numpy(h)))
        w, i = moe.softmax_topk(moe.router_logits(jnp.asarray(h), jnp.asarray(wr.T)), 3, norm)
        np.testing.assert_array_equal(np.asarray(i), ref_i)
        np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-6, atol=1e-7)


def test_config_and_stacked_expert_weights(qwen3_moe_checkpoint):
    from safetensors.numpy import load_file

    path = qwen3_moe_checkpoint("mlp-only")
    loaded = load_model(str(path), "float32")
    cfg = loaded.config
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.norm_topk_prob, cfg.mlp_only_layers) == ("qwen3_moe", 8, 2, 32, True, (1,))
    assert [cfg.is_moe_layer(n) for n in range(3)] == [True, False, True]
    tensors = load_file(str(path / "model.safetensors"))
    lp = loaded.params["layers"][2]
    assert "w_gate" not in lp and lp["experts_gate"].shape == (8, 64, 32)
    assert lp["experts_down"].shape == (8, 32, 64)
    np.testing.assert_array_equal(lp["router"], tensors["model.layers.2.mlp.gate.weight"].T)
    for e in (0, 5):
        for x in ("gate", "up", "down"):
            np.testing.assert_array_equal(
                lp[f"experts_{x}"][e], tensors[f"model.layers.2.mlp.experts.{e}.{x}_proj.weight"].T)
    assert loaded.params["layers"][1]["w_gate"].shape == (64, 128)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8,
                                  "hidden_size": 8, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": 1,
                                  "num_experts": 4, "num_experts_per_tok": 5})


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_logits_match_transformers(qwen3_moe_checkpoint, variant):
    assert_paged_paths_match(qwen3_moe_checkpoint(variant), PagedModel, variant)


def test_llm_float32_cache_matches_transformers(qwen3_moe_checkpoint):
    """Through LLM: prefill logits (one-shot, chunked) equal transformers'; what a batch of
    unequal prompts decodes greedily is transformers' teacher-forced argmax."""
    path = qwen3_moe_checkpoint("mlp-only")
    assert_llm_matches_transformers(_llm(load_model(str(path), "float32")), path)


@pytest.mark.parametrize("mode", ["token", "block"])
def test_fp8_cache_paths_agree_in_float64(qwen3_moe_checkpoint, mode):
    """fp8 e4m3 cache in the float64 check mode: chunked prefill equals one-shot to round-off
    and teacher-forced argmax reproduces decode (MoE routing included)."""
    with x64():
        llm = _llm(load_model(str(qwen3_moe_checkpoint("mlp-only")), "float64"),
                   dtype="float64", kv_cache_dtype="fp8_e4m3", kv_scale_mode=mode)
        rng = np.random.default_rng()
        prompts = [rng.integers(3, 320, n).tolist() for n in (5, 23)]
        for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
            full = p + o.token_ids
            one_shot, lg = llm.nll(full, chunk_size=128, return_logits=True)
            np.testing.assert_allclose(llm.nll(full, chunk_size=6), one_shot, rtol=1e-9,
                                       atol=1e-9)
            assert lg[len(p) - 1:].argmax(-1).tolist() == o.token_ids
        assert llm.kv_stats()["nan_total"] == 0


def test_fp8_cache_stays_close_to_unquantized(qwen3_moe_checkpoint):
    loaded = load_model(str(qwen3_moe_checkpoint("mlp-only")), "float32")
    ids = np.random.default_rng().integers(3, 320, 100).tolist()
    ref = _llm(loaded).nll(ids)
    for mode in ("token", "block"):
        got = _llm(loaded, kv_cache_dtype="fp8_e4m3", kv_scale_mode=mode).nll(ids)
        rel = abs(got.mean() - ref.mean()) / ref.mean()
        assert rel < 0.02, (mode, rel)
