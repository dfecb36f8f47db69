"""Real architectures' shapes with random weights, for speed benchmarks on the GPU.

``load_model("random:qwen3-8b")`` gives a model with Qwen3-8B's config (36 layers, 32 query
heads, 8 KV heads, head_dim 128) and random weights, plus a tokenizer that needs no files:
token id ``i`` decodes to `` t<i>``. Quality is meaningless; bytes moved and FLOPs are real.
"""

from __future__ import annotations

import jax

from jfp8kv.config import ModelConfig, YarnScaling
from jfp8kv.config_fields import hybrid_fields
from jfp8kv.models.loaded import LoadedModel

_DEEPSEEK_V2_LITE = dict(
    family="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    num_layers=27, num_heads=16, num_kv_heads=16, head_dim=64, rms_norm_eps=1e-6,
    rope_theta=10000.0, max_position_embeddings=163840, eos_token_ids=(100001,),
    rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096,
                             mscale=0.707, mscale_all_dim=0.707),
    q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, rope_interleave=True, num_experts=64, num_experts_per_tok=6,
    moe_intermediate_size=1408, n_shared_experts=2, first_k_dense_replace=1)

# Qwen3-30B-A3B's config.json: every layer routed (decoder_sparse_step 1, no mlp_only_layers),
# 128 experts top-8 renormalized, GQA 32 query / 4 KV heads; ~30.5B parameters, ~3.3B active.
_QWEN3_30B_A3B = dict(
    family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=40960, qk_norm=True, eos_token_ids=(151645,),
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=())

# Qwen3.5-35B-A3B's text config (Qwen3.6-35B-A3B has the same shapes): 40 layers, every
# fourth full attention (16 query / 2 KV heads of 256, a quarter of each head rotated), the
# others Gated DeltaNet (16 q/k heads, 32 v heads of 128, conv 4); 256 experts top-8 and a
# shared expert; ~35B parameters (~70 GB in bf16), ~3B active.
_QWEN36_35B_A3B = hybrid_fields(dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, full_attention_interval=4, max_position_embeddings=262144,
    eos_token_id=248044, rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                              partial_rotary_factor=0.25)))

PRESETS = {
    "qwen3-8b": dict(family="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                     qk_norm=True, eos_token_ids=(151645,)),
    "qwen3-0.6b": dict(family="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                       qk_norm=True, tie_word_embeddings=True, eos_token_ids=(151645,)),
    "llama-3-8b": dict(family="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, rope_theta=5e5, max_position_embeddings=8192,
                       eos_token_ids=(128009,)),
    "smollm2-135m": dict(family="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                         head_dim=64, rope_theta=1e5, max_position_embeddings=8192,
                         tie_word_embeddings=True, eos_token_ids=(2,)),
    # Not a real model: Qwen3's layout at toy size, for CPU smoke tests of the GPU benches.
    "qwen3-tiny": dict(family="qwen3", vocab_size=4096, hidden_size=128, intermediate_size=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e6,
                       max_position_embeddings=40960, qk_norm=True, tie_word_embeddings=True,
                       eos_token_ids=(4095,)),
    # DeepSeek-V2-Lite's shapes: MLA (no q LoRA, r 512 + 64 RoPE dims), 64 routed experts
    # top-6 plus 2 shared, first layer dense, YaRN x40.
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
    # Not a real model: the same layout at toy size, for CPU smoke tests.
    "deepseek-v2-tiny": dict(
        _DEEPSEEK_V2_LITE, vocab_size=4096, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=4, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, eos_token_ids=(4095,)),
    # Qwen3-30B-A3B's shapes (random weights): 61 GB in bf16, fits one H200.
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # Not a real model: the same layout at toy size for CPU smoke tests; layer 0 is dense
    # (mlp_only_layers) so that the mixed dense/routed path is exercised too.
    "qwen3-moe-tiny": dict(
        _QWEN3_30B_A3B, vocab_size=4096, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, mlp_only_layers=(0,), tie_word_embeddings=True,
        eos_token_ids=(4095,)),
    "qwen3.6-35b-a3b": _QWEN36_35B_A3B,
    # Not a real model: the same layout at toy size for CPU smoke tests.
    "qwen3.6-tiny": hybrid_fields(dict(
        vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, full_attention_interval=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, max_position_embeddings=40960, eos_token_id=4095,
        rope_parameters=dict(rope_theta=1e7, partial_rotary_factor=0.25))),
}


class IdTokenizer:
    """A file-free tokenizer for random-weight models: ids <-> `` t<id>`` words."""

    def __init__(self, vocab_size: int, eos_token_id: int | None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self.chat_template = None

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = []
        for w in text.split():
            body = w[1:] if w.startswith("t") else w
            out.append(int(body) % self.vocab_size if body.isdigit() else
                       sum(map(ord, w)) % self.vocab_size)
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" t{int(i)}" for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        text = " ".join(m["content"] for m in messages)
        return self.encode(text) if tokenize else text


def load_random(preset: str, dtype: str, seed: int = 0, tensor_parallel_size: int = 1):
    """A ``LoadedModel`` of ``preset`` with random weights (``families.random_params``),
    generated in place on their shards when ``tensor_parallel_size`` > 1."""
    from jfp8kv.models import families, sharding
    from jfp8kv.models.v4_presets import v4_config

    key = preset.lower()
    if key.startswith("deepseek-v4"):
        cfg = v4_config(key)  # ValueError naming the V4 presets
    elif key in PRESETS:
        cfg = ModelConfig(**PRESETS[key], name=f"random:{key}")
    else:
        from jfp8kv.models.v4_presets import FLASH

        names = [*PRESETS, "deepseek-v4-flash", f"deepseek-v4-flash-<N>l (its first N of "
                 f"{FLASH['num_hidden_layers']} layers)", "deepseek-v4-tiny"]
        raise ValueError(f"unknown random preset {preset!r}; choose one of "
                         + ", ".join("random:" + k for k in names))
    tp = sharding.plan(cfg, tensor_parallel_size)
    params = families.random_params(cfg, jax.random.PRNGKey(seed), dtype,
                                    sharding_of=None if tp is None else tp.sharding,
                                    arrange=None if tp is None else tp.arrange)
    tok = IdTokenizer(cfg.vocab_size, cfg.eos_token_ids[0] if cfg.eos_token_ids else None)
    return LoadedModel(config=cfg, params=params, tokenizer=tok, kv_scales=None, name=cfg.name,
                       tensor_parallel_size=tensor_parallel_size)
