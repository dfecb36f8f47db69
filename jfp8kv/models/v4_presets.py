"""DeepSeek-V4 shapes as config.json dicts (parsed by ``ModelConfig.from_hf_dict``), for
random-weight runs: ``deepseek-v4-flash`` (DeepSeek-V4-Flash's published config: 43 layers,
2 window-only then CSA / HCA alternating, 256 experts top-6, the first 3 MoE layers
hash-routed), ``deepseek-v4-flash-<N>l`` (its first N layers, every expert kept) and
``deepseek-v4-tiny`` (the same layout at toy size, CPU tests)."""

from __future__ import annotations

from jfp8kv.config import ModelConfig

FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "num_hash_layers": 3, "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "swiglu_limit": 10.0,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "sliding_window": 128,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],  # trailing 0: the MTP layer
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}

TINY = dict(FLASH, vocab_size=96, hidden_size=64, moe_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
            q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
            num_experts_per_tok=2, num_hash_layers=1, index_n_heads=16, index_head_dim=32,
            index_topk=3, sliding_window=6, hc_mult=2, compress_ratios=[0, 4, 8, 4],
            compress_rates={"compressed_sparse_attention": 4,
                            "heavily_compressed_attention": 8},
            rope_scaling={"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                          "original_max_position_embeddings": 64}, eos_token_id=95)


def v4_config(name: str) -> ModelConfig:
    """The ModelConfig of a V4 preset name (without ``random:``); ValueError naming them."""
    key = name.lower()
    if key == "deepseek-v4-flash":
        return ModelConfig.from_hf_dict(FLASH, name=f"random:{key}")
    if key == "deepseek-v4-tiny":
        return ModelConfig.from_hf_dict(TINY, name=f"random:{key}")
    if key.startswith("deepseek-v4-flash-") and key.endswith("l") and key[18:-1].isdigit():
        n = int(key[18:-1])
        if 1 <= n <= FLASH["num_hidden_layers"]:
            return ModelConfig.from_hf_dict(dict(FLASH, num_hidden_layers=n),
                                            name=f"random:{key}")
    raise ValueError(f"unknown DeepSeek-V4 preset {name!r}; choose deepseek-v4-flash, "
                     "deepseek-v4-flash-<N>l (first N of 43 layers) or deepseek-v4-tiny")
