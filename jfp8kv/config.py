"""Frozen, hashable configuration, layered outward: model -> cache -> engine.

Configs are never mutated; use ``dataclasses.replace`` to derive a new one. They are
hashable so they can be static arguments of jitted functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama / Qwen2 / Qwen3 families).

    ``family`` selects the per-family differences: ``qwen2`` adds q/k/v biases, ``qwen3``
    adds per-head RMSNorm on q and k before RoPE; ``qwen3_moe`` is qwen3 attention with a
    mixture-of-experts MLP in the layers ``is_moe_layer`` names (``num_experts`` > 0; the
    other layers keep the dense MLP of ``intermediate_size``), as transformers' Qwen3-MoE.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    # Mixture of experts (qwen3_moe); num_experts == 0 means every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` uses the routed experts (transformers' Qwen3-MoE rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict; raise for unsupported architectures."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            by_type = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                       "qwen3_moe": "qwen3_moe"}
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
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_scaling = None
        rope_theta = float(cfg.get("rope_theta", 10000.0))
        if isinstance(rs, dict):
            rope_theta = float(rs.get("rope_theta", rope_theta))
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            elif rtype not in (None, "default"):
                raise ValueError(
                    f"unsupported rope_scaling type {rtype!r}; supported: default, llama3"
                )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            **(_moe_fields(cfg) if family == "qwen3_moe" else {}),
        )


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
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


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2", "fp8")
KV_SCALE_MODES = ("tensor", "channel", "token", "block")
ATTENTION_BACKENDS = ("auto", "pallas", "reference")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
# Not for serving: float64 compute exists so the fp8 cache can be checked against another
# float64 implementation without float32 rounding noise (CPU, reference attention, x64 on).
CHECK_DTYPES = ("float64",)


def check_compute_dtype(dtype: str) -> str:
    """Validate a compute dtype name; ``float64`` needs ``JAX_ENABLE_X64=1``."""
    if dtype in CHECK_DTYPES:
        import jax

        if not jax.config.jax_enable_x64:
            raise ValueError("dtype='float64' needs 64-bit JAX (JAX_ENABLE_X64=1); it is a "
                             "numerics-check mode, use bfloat16, float16 or float32 to serve")
        return dtype
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {dtype!r}; choose one of {list(COMPUTE_DTYPES)}")
    return dtype


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Static description of the paged KV cache.

    ``storage_dtype`` is the dtype of the page arrays (``float8_e4m3fn``, ``float8_e5m2``,
    ``bfloat16``, ``float16`` or ``float32``); it is a different thing from the model's
    compute dtype. ``scale_mode`` is meaningful only for fp8 storage (``None`` otherwise).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    storage_dtype: str
    scale_mode: str | None = None
    scale_block: int = 32

    @property
    def is_fp8(self) -> bool:
        return self.storage_dtype.startswith("float8")

    @property
    def max_tokens(self) -> int:
        """Tokens the pool holds for sequences (page 0 is the reserved padding sink)."""
        return (self.num_pages - 1) * self.page_size
