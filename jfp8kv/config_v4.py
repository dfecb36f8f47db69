"""DeepSeek-V4's config.json fields beyond ``ModelConfig``'s common ones, parsed into one
frozen ``V4Fields`` (``ModelConfig.v4``). Both spellings are read: DeepSeek's own
(``compress_ratios`` per layer as 0/4/128, ``num_hash_layers``, flat ``rope_scaling``) and
transformers' (``layer_types``, ``compress_rates``, ``mlp_layer_types``, ``rope_parameters``
nested as ``main`` / ``compress``). Imports nothing from ``jfp8kv.config`` (which imports
this)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jfp8kv.config_fields import YarnScaling, yarn_scaling

V4_FAMILY = "deepseek_v4"
_TYPE_OF_NAME = {"sliding_attention": "window", "compressed_sparse_attention": "csa",
                 "heavily_compressed_attention": "hca"}
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class V4Fields:
    """Per-layer schedule and the V4-only shapes.

    ``compress_ratios[i]``: 0 (window only), ``csa_ratio`` (compressed sparse attention:
    lightning-indexer top-k over 4:1 compressed entries) or ``hca_ratio`` (heavily compressed,
    128:1, every entry attended). ``hash_layers[i]``: the MoE of layer i routes by a frozen
    token -> experts table. ``compress_rope``: YaRN of the compressed layers (None: plain).
    """

    compress_ratios: tuple[int, ...]
    hash_layers: tuple[bool, ...]
    csa_ratio: int = 4
    hca_ratio: int = 128
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    compress_rope_theta: float = 160000.0
    compress_rope: YarnScaling | None = None
    scoring_func: str = "sqrtsoftplus"

    def layer_kind(self, layer: int) -> str:
        """"window", "csa" or "hca" for ``layer``."""
        r = self.compress_ratios[layer]
        return "window" if r == 0 else ("csa" if r == self.csa_ratio else "hca")


def _ratios(cfg: dict[str, Any], n: int, csa: int, hca: int) -> tuple[int, ...]:
    if cfg.get("layer_types") is not None:
        by_kind = {"window": 0, "csa": csa, "hca": hca}
        try:
            out = [by_kind[_TYPE_OF_NAME[t]] for t in cfg["layer_types"][:n]]
        except KeyError as e:
            raise ValueError(f"DeepSeek-V4 layer_types entry {e.args[0]!r} is not one of "
                             f"{sorted(_TYPE_OF_NAME)}") from None
    elif cfg.get("compress_ratios") is not None:
        out = [int(r) for r in cfg["compress_ratios"][:n]]  # trailing MTP entry dropped
    else:  # transformers' default: 2 HCA then CSA / HCA alternating
        out = [hca] * min(n, 2) + [csa if i % 2 else hca for i in range(max(n - 2, 0))]
    bad = sorted({r for r in out if r not in (0, csa, hca)})
    if len(out) != n or bad:
        raise ValueError(f"DeepSeek-V4 needs one compress ratio per layer ({n}) from "
                         f"{{0, {csa}, {hca}}}; got {out}")
    return tuple(out)


def _hash_layers(cfg: dict[str, Any], n: int) -> tuple[bool, ...]:
    if cfg.get("mlp_layer_types") is not None:
        kinds = list(cfg["mlp_layer_types"][:n])
        if len(kinds) != n or not set(kinds) <= {"hash_moe", "moe"}:
            raise ValueError("DeepSeek-V4 mlp_layer_types needs one of 'hash_moe' / 'moe' per "
                             f"layer ({n}); got {kinds}")
        return tuple(k == "hash_moe" for k in kinds)
    n_hash = int(cfg.get("num_hash_layers", 3) or 0)
    return tuple(i < n_hash for i in range(n))


def _compress_rope(cfg: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """(theta, YaRN or None) of the compressed layers' RoPE; the V4 reference applies no
    YaRN magnitude factor to cos/sin (transformers pins ``attention_factor`` to 1)."""
    theta = float(cfg.get("compress_rope_theta", 160000.0))
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        rs = rp["compress"]
        theta = float(rs.get("rope_theta", theta))
    else:
        rs = cfg.get("rope_scaling") or (rp if isinstance(rp, dict) else None) or {}
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype in (None, "default"):
        return theta, None
    if rtype != "yarn":
        raise ValueError(f"DeepSeek-V4 compressed RoPE supports default or yarn, not {rtype!r}")
    return theta, dataclasses.replace(yarn_scaling(rs), attention_factor=1.0)


def v4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of a V4 config.json: the shared MoE / q-LoRA fields
    and ``v4=V4Fields(...)``. Raises ValueError on an impossible schedule or routing."""
    n = int(cfg["num_hidden_layers"])
    rates = cfg.get("compress_rates") or {}
    csa = int(rates.get("compressed_sparse_attention", cfg.get("compress_rate_csa", 4)))
    hca = int(rates.get("heavily_compressed_attention", cfg.get("compress_rate_hca", 128)))
    experts = int(cfg.get("n_routed_experts", 0) or 0)
    top_k = int(cfg.get("num_experts_per_tok", 0) or 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..n_routed_experts={experts}")
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"DeepSeek-V4 scoring_func {scoring!r}; supported: {SCORING_FUNCS}")
    head_dim = int(cfg.get("head_dim", 512))
    rope = cfg.get("qk_rope_head_dim")
    if rope is None:
        rope = int(head_dim * float(cfg.get("partial_rotary_factor") or 64 / 512))
    theta, yarn = _compress_rope(cfg)
    v4 = V4Fields(
        compress_ratios=_ratios(cfg, n, csa, hca), hash_layers=_hash_layers(cfg, n),
        csa_ratio=csa, hca_ratio=hca, sliding_window=int(cfg.get("sliding_window", 128)),
        o_groups=int(cfg.get("o_groups", 8)), o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
        index_n_heads=int(cfg.get("index_n_heads", 64)),
        index_head_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)), hc_mult=int(cfg.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(cfg.get("hc_eps", 1e-6)), swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
        compress_rope_theta=theta, compress_rope=yarn, scoring_func=scoring)
    if cfg["num_attention_heads"] % v4.o_groups:
        raise ValueError(f"num_attention_heads={cfg['num_attention_heads']} must be a multiple "
                         f"of o_groups={v4.o_groups}")
    return dict(
        head_dim=head_dim, num_kv_heads=1, q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
        qk_rope_head_dim=int(rope), num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0), norm_topk_prob=True,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0), v4=v4)
