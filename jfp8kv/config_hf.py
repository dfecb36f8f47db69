"""A Hugging Face ``config.json`` dict -> ``ModelConfig``'s fields: which family an
architecture is, its RoPE, and the shared fields (the family-specific ones come from
``config_fields`` and ``config_v4``)."""

from __future__ import annotations

from typing import Any

from jfp8kv.config_fields import (MLA_FAMILIES, llama3_scaling, mla_fields, moe_fields,
                                  yarn_scaling)
from jfp8kv.config_v4 import V4_FAMILY, v4_fields

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV4ForCausalLM": V4_FAMILY,
}


def hf_family(cfg: dict[str, Any]) -> str:
    """The model family of a config dict; ValueError naming the supported architectures."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        model_type = cfg.get("model_type")
        by_type = {f: f for f in SUPPORTED_ARCHITECTURES.values()} | {"mistral": "llama"}
        if model_type not in by_type:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}; jfp8kv supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = by_type[model_type]
    else:
        family = SUPPORTED_ARCHITECTURES[arch]
    if family == "llama" and cfg.get("sliding_window") not in (None, 0) and (
        cfg.get("model_type") == "mistral"
    ):
        sw = cfg["sliding_window"]
        if sw < cfg.get("max_position_embeddings", sw):
            raise ValueError(
                f"Mistral with sliding_window={sw} is not supported; use a checkpoint with "
                "sliding_window null (Mistral v0.2+), Llama, Qwen2 or Qwen3"
            )
    return family


def rope_fields(cfg: dict[str, Any], family: str):
    """``(rope_theta, rope_scaling)``; ValueError for an unsupported scaling type."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    rope_scaling = None
    rope_theta = float(cfg.get("rope_theta", 10000.0))
    if family == V4_FAMILY:  # main RoPE plain; the compressed layers' lives in v4
        rs = None
    if isinstance(rs, dict):
        rope_theta = float(rs.get("rope_theta", rope_theta))
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype == "llama3":
            rope_scaling = llama3_scaling(rs)
        elif rtype == "yarn" and family in MLA_FAMILIES:
            rope_scaling = yarn_scaling(rs)
        elif rtype not in (None, "default"):
            raise ValueError(
                f"unsupported rope_scaling type {rtype!r}; supported: default, llama3 "
                "(and yarn for deepseek_v2/deepseek_v3)"
            )
    return rope_theta, rope_scaling


def hf_model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments (all but ``name``) for a non-hybrid config dict."""
    family = hf_family(cfg)
    num_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    rope_theta, rope_scaling = rope_fields(cfg, family)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return dict(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size", cfg.get("moe_intermediate_size")),
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        # MLA caches no KV heads: config.json's count means nothing there.
        **({} if family == V4_FAMILY else dict(
            num_kv_heads=num_heads if family in MLA_FAMILIES else (
                cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        **(moe_fields(cfg) if family == "qwen3_moe" else {}),
        **(mla_fields(cfg, family) if family in MLA_FAMILIES else {}),
        **(v4_fields(cfg) if family == V4_FAMILY else {}),
    )
