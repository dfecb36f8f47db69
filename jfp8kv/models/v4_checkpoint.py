"""DeepSeek-V4 checkpoint names -> transformers' names (what ``deepseek_v4.params_from_hf``
reads). DeepSeek's release spells tensors ``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight`` (one tensor per expert), ``hc_head_fn``, ``head.weight``;
transformers' ``save_pretrained`` writes the same names under ``model.``. The renaming rules
are transformers' own (``conversion_mapping.py``, "deepseek_v4"), applied in its order; the
per-expert tensors are stacked as transformers does (gate_up = [w1; w3] per expert, down =
w2). Checkpoints already in transformers' names pass through unchanged.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

_RULES = [(r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
          (r"\.indexer\.compressor\.", ".compressor.indexer."),
          (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
          (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"),
          (r"^hc_head_scale", "hc_head.hc_scale"), (r"\.attn_norm\.", ".input_layernorm."),
          (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_fn", ".attn_hc.fn"),
          (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
          (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"),
          (r"\.hc_ffn_scale", ".ffn_hc.scale"), (r"\.attn_sink", ".sinks"),
          (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
          (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."),
          (r"\.ape", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
          (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
          (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
          (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
          (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
          (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
          (r"\.shared_experts\.w3\.", ".shared_experts.up_proj.")]
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")


def hf_name(name: str) -> str:
    """transformers' name of a checkpoint tensor (the rules leave transformers' own names
    unchanged, so either spelling maps)."""
    n = name[len("model."):] if name.startswith("model.") else name
    for pattern, repl in _RULES:
        n = re.sub(pattern, repl, n)
    return n if n.startswith("lm_head.") else "model." + n


def transformers_getter(names, read: Callable[[str], np.ndarray]):
    """(get, consumed): ``get(hf name)`` -> the tensor, from a checkpoint whose tensors are
    ``names`` (either spelling) read by ``read(name)``; per-expert tensors are stacked into
    ``experts.gate_up_proj`` [E, 2I, D] and ``experts.down_proj`` [E, D, I]. ``consumed``:
    the checkpoint names read so far."""
    direct, experts = {}, {}
    for name in names:
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(hf_name(m.group(1)), {})[(int(m.group(2)), m.group(3))] = name
        else:
            direct[hf_name(name)] = name
    consumed: set[str] = set()

    def take(name: str) -> np.ndarray:
        consumed.add(name)
        return read(name)

    def get(name: str) -> np.ndarray:
        base, _, kind = name.rpartition(".")
        if name not in direct and base in experts and kind in ("gate_up_proj", "down_proj"):
            parts = experts[base]
            count = 1 + max(e for e, _ in parts)
            if kind == "down_proj":
                return np.stack([take(parts[(e, "w2")]) for e in range(count)])
            return np.stack([np.concatenate([take(parts[(e, "w1")]), take(parts[(e, "w3")])])
                             for e in range(count)])
        if name not in direct:
            raise KeyError(name)
        return take(direct[name])

    return get, consumed
