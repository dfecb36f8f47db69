"""DeepSeek-V2/V3 (multi-head latent attention, MoE) against transformers (float32).

Tiny random DeepSeek-V2 (no q LoRA, greedy softmax routing, YaRN with mscale) and V3
(q LoRA, sigmoid grouped routing with bias, interleaved RoPE; YaRN with an attention factor
!= 1, and a rotate-half variant) checkpoints are written with ``save_pretrained``; the
engine's logits through the latent cache must match transformers' for one-shot and chunked
prefill and paged decode over shuffled pages, for a batch of unequal lengths, and greedy
decode through ``LLM``. The fp8 latent cache is checked against an independent fake
quantization (``bench.fakequant``, numpy + ml_dtypes) applied inside a float64 transformers
model: the dequantized cache rows are bitwise equal and the logits agree to round-off.
"""

import jax
import numpy as np
import pytest

from jfp8kv import SamplingParams
from jfp8kv.config import CacheConfig
from jfp8kv.engine.llm import LLM
from jfp8kv.kvcache.cache import KVCache, bytes_per_token
from jfp8kv.models.loader import load_model
from tests.models.test_parity import (GREEDY, LENGTHS, PAGE, PagedModel,
                                       assert_llm_matches_transformers,
                                       assert_paged_paths_match)
from tests.models.test_parity import small_llm as _llm
from tests.tiny_checkpoints import randomize, save_with_tokenizer
from tests.x64 import x64

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {  # name -> (config class name, overrides)
    "v2": ("DeepseekV2Config", dict(q_lora_rank=None, topk_method="greedy",
                                    rope_parameters={**YARN, "mscale": 0.707,
                                                     "mscale_all_dim": 0.707})),
    "v3": ("DeepseekV3Config", dict(q_lora_rank=48, n_group=4, topk_group=2,
                                    routed_scaling_factor=2.5, rope_interleave=True,
                                    rope_parameters={**YARN, "mscale": 1.0,
                                                     "mscale_all_dim": 0.8})),
    "v3-rotate-half": ("DeepseekV3Config", dict(q_lora_rank=48, n_group=2, topk_group=1,
                                                rope_interleave=False)),
    # all layers dense, default RoPE: the float64 fake-quantization reference (below)
    "v3-dense": ("DeepseekV3Config", dict(q_lora_rank=48, first_k_dense_replace=3)),
    # the shapes the Mosaic GPU MLA decode kernel takes (rank 128 + RoPE 64, 16 heads), all
    # layers dense (no routing for rounding to flip): tests/engine/test_gpu_e2e.py
    "v2-mosaic": ("DeepseekV2Config", dict(q_lora_rank=None, first_k_dense_replace=3,
                                           hidden_size=256, num_attention_heads=16,
                                           kv_lora_rank=128, qk_rope_head_dim=64,
                                           qk_nope_head_dim=32, v_head_dim=32)),
}


def write_checkpoint(path, tokenizer_dir, variant):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, overrides = VARIANTS[variant]
    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
              kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=24,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
    cfg = getattr(transformers, cls)(**{**kw, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    # e_score_correction_bias: routing biases large enough to change the choice
    randomize(model, list(VARIANTS).index(variant), {"e_score_correction_bias": 0.3})
    return save_with_tokenizer(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def deepseek_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    made = {}

    def make(variant):
        if variant not in made:
            made[variant] = write_checkpoint(tmp_path_factory.mktemp(f"tiny-{variant}"),
                                             tiny_tokenizer_dir, variant)
        return made[variant]

    return make


class LatentPagedModel(PagedModel):
    """``PagedModel`` over a latent cache (storage and scale mode as given)."""

    def __init__(self, loaded, rng, storage="float32", mode=None, num_pages=40):
        cfg = loaded.config
        super().__init__(loaded, rng, num_pages)
        self.cache = KVCache.init(CacheConfig(cfg.num_layers, 1, cfg.latent_dim, num_pages, PAGE,
                                              storage, mode, layout="latent"))


def test_config_and_weights(deepseek_checkpoint):
    from safetensors.numpy import load_file

    path = deepseek_checkpoint("v3")
    loaded = load_model(str(path), "float32")
    cfg = loaded.config
    assert (cfg.family, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.latent_dim, cfg.num_experts,
            cfg.n_group, cfg.topk_group, cfg.rope_interleave) == (
        "deepseek_v3", 48, 64, 96, 8, 4, 2, True)
    assert [cfg.is_moe_layer(n) for n in range(3)] == [False, True, True]
    t = load_file(str(path / "model.safetensors"))
    lp = loaded.params["layers"][1]
    np.testing.assert_array_equal(lp["wkv_b"], t["model.layers.1.self_attn.kv_b_proj.weight"].T)
    np.testing.assert_array_equal(lp["router_bias"],
                                  t["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert lp["shared_gate"].shape == (64, 32) and "w_gate" in loaded.params["layers"][0]
    v2 = load_model(str(deepseek_checkpoint("v2")), "float32").config
    assert v2.q_lora_rank is None and v2.rope_interleave and v2.rope_scaling.factor == 4.0
    assert "wq" in load_model(str(deepseek_checkpoint("v2")), "float32").params["layers"][0]


@pytest.mark.parametrize("variant", ["v2", "v3", "v3-rotate-half"])
def test_paged_logits_match_transformers(deepseek_checkpoint, variant):
    assert_paged_paths_match(deepseek_checkpoint(variant), LatentPagedModel, variant)


def test_llm_greedy_matches_transformers(deepseek_checkpoint):
    """Through LLM (latent float32 cache): prefill logits one-shot and chunked equal
    transformers'; an unequal batch decodes transformers' teacher-forced argmax."""
    path = deepseek_checkpoint("v2")
    llm = _llm(load_model(str(path), "float32"))
    info = llm.cache_info()
    assert info["kv_layout"] == "latent" and info["bytes_per_token"] == 3 * 96 * 4
    assert_llm_matches_transformers(llm, path)


def test_capacity_and_mode_validation(deepseek_checkpoint):
    loaded = load_model(str(deepseek_checkpoint("v3")), "float32")
    want = {"bfloat16": 3 * 96 * 2, "fp8_e4m3:block": 3 * (96 + 3 * 2),
            "fp8_e4m3:token": 3 * (96 + 4)}
    for key, bpt in want.items():
        kv, _, mode = key.partition(":")
        llm = _llm(loaded, kv_cache_dtype=kv, kv_scale_mode=mode or None)
        info = llm.cache_info()
        assert info["bytes_per_token"] == bpt, key
        assert info["pool_bytes"] == (info["num_pages"] + 1) * info["page_size"] * bpt, key
        assert info["num_pages"] * info["page_size"] * bpt <= (1 << 20), key
    assert _llm(loaded, kv_cache_dtype="fp8_e4m3").cache_info()["kv_scale_mode"] == "block"
    for mode in ("tensor", "channel"):
        with pytest.raises(ValueError, match="not supported for deepseek_v.'s cache; use 'block' or 'token'"):
            _llm(loaded, kv_cache_dtype="fp8_e4m3", kv_scale_mode=mode)
    assert bytes_per_token(27, 1, 576, "float8_e4m3fn", "block", layout="latent") == 27 * 612


def _hf_fakequant_float64(path, seqs, mode):
    """transformers in float64 (exact: no float32 step), the latent rows fake-quantized by
    bench.fakequant before they are expanded; returns (logits, per-layer dequantized rows)."""
    import types

    import torch
    from transformers import AutoModelForCausalLM

    from bench import fakequant as fq

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64,
                                                 attn_implementation="sdpa").eval()
    fq.exact_float64(model)
    captured = {}

    def expand_kv(self, kv_nope, k_rot):
        rows = torch.cat([kv_nope, k_rot], -1).numpy()  # [B, 1, T, R]
        deq = fq.fake_quant_rows(rows, "fp8_e4m3", mode).astype(np.float64)
        captured.setdefault(self.layer_idx, []).append(deq[0, 0])
        r = kv_nope.shape[-1]
        return type(self).expand_kv(self, torch.from_numpy(deq[..., :r]),
                                    torch.from_numpy(deq[..., r:]))

    for m in model.modules():
        if hasattr(m, "kv_b_proj"):
            m.expand_kv = types.MethodType(expand_kv, m)
    with torch.no_grad():
        logits = [model(torch.tensor([s])).logits[0].numpy() for s in seqs]
    return logits, captured


@pytest.mark.parametrize("mode", ["block", "token"])
def test_fp8_latent_cache_equals_fake_quantization_float64(deepseek_checkpoint, mode):
    from jfp8kv.kernels import reference

    path = deepseek_checkpoint("v3-dense")
    rng = np.random.default_rng()
    seqs = [rng.integers(0, 384, n).tolist() for n in LENGTHS]
    ref, rows = _hf_fakequant_float64(path, seqs, mode)
    with x64():
        loaded = load_model(str(path), "float64")
        m = LatentPagedModel(loaded, rng, "float8_e4m3fn", mode)
        got = m.run([(s, 0) for s in seqs])
        cfg = m.cache.config
        for layer in range(loaded.config.num_layers):
            deq = np.asarray(reference.gather_dequantized(m.cache.k[layer],
                                                          m.cache.k_scale[layer],
                                                          jax.numpy.asarray(m.pt), cfg))
            for i, n in enumerate(LENGTHS):  # deq [B, 1, pages * PAGE, R]
                np.testing.assert_array_equal(deq[i, 0, :n], rows[layer][i])
    for i, n in enumerate(LENGTHS):
        np.testing.assert_allclose(got[i][:n], ref[i], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", ["block", "token"])
def test_fp8_paths_agree_in_float64(deepseek_checkpoint, mode):
    """fp8 latent cache (V2, MoE included): chunked prefill equals one-shot to round-off and
    teacher-forced argmax reproduces greedy decode."""
    with x64():
        llm = _llm(load_model(str(deepseek_checkpoint("v2")), "float64"), dtype="float64",
                   kv_cache_dtype="fp8_e4m3", kv_scale_mode=mode)
        rng = np.random.default_rng()
        prompts = [rng.integers(3, 320, n).tolist() for n in (5, 23)]
        for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
            full = p + o.token_ids
            one_shot, lg = llm.nll(full, chunk_size=128, return_logits=True)
            np.testing.assert_allclose(llm.nll(full, chunk_size=6), one_shot, rtol=1e-9,
                                       atol=1e-9)
            assert lg[len(p) - 1:].argmax(-1).tolist() == o.token_ids
        assert llm.kv_stats()["nan_total"] == 0


def test_random_presets():
    """random:deepseek-v2-tiny runs end to end through LLM (bf16 and the default fp8 latent
    cache: block); random:deepseek-v2-lite has V2-Lite's shapes and cache cost."""
    from jfp8kv.models.presets import PRESETS
    from jfp8kv.config import ModelConfig

    lite = ModelConfig(**PRESETS["deepseek-v2-lite"])
    assert (lite.latent_dim, lite.num_layers, lite.is_moe_layer(0), lite.is_moe_layer(1)) == (
        576, 27, False, True)
    assert bytes_per_token(27, 1, 576, "bfloat16", None, layout="latent") == 31104
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(model="random:deepseek-v2-tiny", dtype="bfloat16", max_model_len=64,
                  kv_cache_memory=1 << 20, kv_cache_dtype=kv)
        outs[kv] = [o.token_ids for o in llm.generate([[5, 6, 7, 8], [9, 10]], params)]
        assert all(len(t) == 6 for t in outs[kv])
    assert llm.cache_info()["kv_scale_mode"] == "block"
