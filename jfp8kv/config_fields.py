"""The config.json fields of the model families beyond dense attention, parsed into
``ModelConfig`` keyword arguments (``jfp8kv.config.ModelConfig.from_hf_dict`` calls these):
Qwen3-MoE experts, DeepSeek-V2/V3 latent attention and MoE routing, and the RoPE scalings
(Llama-3, YaRN).
Imports nothing from ``jfp8kv.config`` (which imports this)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def llama3_scaling(rs: dict[str, Any]) -> RopeScaling:
    return RopeScaling(
        factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]))


MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling ("rope_type": "yarn") as transformers computes it for DeepSeek:
    inverse frequencies blended between interpolation and extrapolation over the
    [beta_fast, beta_slow] correction range, cos/sin times ``attention_factor``, and the
    softmax scale times ``mscale(factor, mscale_all_dim)**2`` (``jfp8kv.models.mla``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


def yarn_scaling(rs: dict[str, Any]) -> YarnScaling:
    af = rs.get("attention_factor")
    return YarnScaling(
        factor=float(rs["factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
        mscale=float(rs.get("mscale") or 0), mscale_all_dim=float(rs.get("mscale_all_dim") or 0),
        attention_factor=None if af is None else float(af), truncate=bool(rs.get("truncate", True)))


def mla_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """DeepSeek-V2/V3 attention and MoE settings from config.json (``n_routed_experts`` is
    the experts count; null n_group/topk_group mean 1)."""
    experts = int(cfg.get("n_routed_experts", cfg.get("num_experts", 0)) or 0)
    top_k = int(cfg.get("num_experts_per_tok", 0) or 0)
    if experts > 0 and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..n_routed_experts={experts}")
    q_lora = cfg.get("q_lora_rank")
    return dict(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
        # transformers' DeepSeek-V2 always rotates pairs; V3 does when rope_interleave.
        rope_interleave=family == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
        num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", family == "deepseek_v3")),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        topk_method=cfg.get("topk_method") or "greedy",
        n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1))


def moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's expert settings from config.json (``num_local_experts`` is the alias
    transformers writes for ``num_experts``); raises ValueError on an impossible top-k."""
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    top_k = int(cfg.get("num_experts_per_tok", 0) or 0)
    if experts > 0 and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={experts}")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=max(1, int(cfg.get("decoder_sparse_step", 1) or 1)),
                mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))


HYBRID_FAMILIES = ("qwen3_5_moe",)
HYBRID_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
HYBRID_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


@dataclasses.dataclass(frozen=True)
class HybridFields:
    """The Gated DeltaNet half of a Qwen3.5/3.6 hybrid model (``jfp8kv.models.qwen3_hybrid``):
    which layers are linear attention, the DeltaNet head shapes, the causal conv width, the
    full-attention layers' partial RoPE and the MoE's shared expert."""

    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    partial_rotary_factor: float
    shared_expert_intermediate_size: int
    # dtype of the DeltaNet state slots (config.json's mamba_ssm_dtype): float32 or bfloat16,
    # never fp8 (kvcache/state_pool.py); float64 for the float64 check mode only
    state_dtype: str = "float32"

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad:
            raise ValueError(f"unknown layer_types {bad}; Qwen3.5 layers are linear_attention "
                             "or full_attention")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a "
                             f"multiple of linear_num_key_heads={self.linear_num_key_heads}")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k (key_dim each) and v (value_dim)."""
        return 2 * self.key_dim + self.value_dim


def hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every ``ModelConfig`` keyword argument (but ``name``) of a Qwen3.5/3.6 MoE text config
    (the multimodal checkpoint nests it under ``text_config``: ``unwrap_text_config``). The
    router always renormalizes its top-k; there is no dense MLP (``intermediate_size`` 0);
    defaults are transformers' (Qwen3.5-35B-A3B's shapes)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r} for qwen3_5_moe; "
                         "supported: default (text-only mRoPE is the default rotation)")
    eos = cfg.get("eos_token_id")
    heads = int(cfg["num_attention_heads"])
    return dict(
        family="qwen3_5_moe", vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]), intermediate_size=0, num_layers=n,
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e7))),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 262144)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=True, bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (int(eos),)),
        num_experts=int(cfg.get("num_experts", 256)),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 512)), norm_topk_prob=True,
        hybrid=HybridFields(
            layer_types=tuple(types),
            linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 cfg.get("partial_rotary_factor", 0.25))),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size",
                                                        512)),
            state_dtype=str(cfg.get("mamba_ssm_dtype") or "float32")))


def unwrap_text_config(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The text config of a Qwen3.5/3.6 MoE checkpoint's config.json (nested under
    ``text_config`` in the multimodal one), or None when ``cfg`` is another family."""
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") not in HYBRID_MODEL_TYPES and not set(archs) & set(
            HYBRID_ARCHITECTURES):
        return None
    text = dict(cfg.get("text_config") or cfg)
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return text
