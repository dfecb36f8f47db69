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
