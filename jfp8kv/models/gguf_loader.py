"""llama.cpp GGUF files -> params pytree, dequantized to the compute dtype.

Tensors are renamed to Hugging Face names and assembled by ``hf_loader.build_params``; the
tokenizer is built from the file's metadata by ``gguf_tokenizer`` (no torch needed).
Two layout facts matter:

- GGUF lists dims in ggml ``ne`` order (fastest first), so a linear weight of HF shape
  [out, in] is described as [in, out]; ``gguf.quants.dequantize`` returns the row-major
  [out, in] array, which ``build_params`` checks against the HF shape.
- llama.cpp's converter permutes the rows of Q and K of *llama*-architecture models from
  HF's rotate-half RoPE layout to its interleaved one (per head: rows [0..d/2) and
  [d/2..d) are interleaved). ``unpermute_qk`` undoes that. Qwen2/Qwen3 are converted
  without the permutation (they use the NeoX layout, which is HF's).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from jfp8kv.config import ModelConfig
from jfp8kv.models import hf_loader
from jfp8kv.models.gguf_tokenizer import load_gguf_tokenizer
from jfp8kv.models.loaded import LoadedModel

FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight",
          "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias",
          "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF tensor name (None when unknown)."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. w: [n_heads * hd, ...] (weight or bias)."""
    hd = w.shape[0] // n_heads
    # llama.cpp stored rows as (head, pair i, half j) for HF row (head, half j, pair i).
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default: Any = None) -> Any:
    """Scalar or string metadata value (arrays are not read here: they can be huge)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    import gguf

    part = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def config_from_gguf(reader, name: str) -> ModelConfig:
    """ModelConfig from GGUF metadata; raises ValueError for unsupported variants."""
    arch = _field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; jfp8kv reads "
                         f"{sorted(FAMILIES)} GGUF files")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with rope_freqs (Llama 3.1+ scaled RoPE) are not "
                         "supported; load the Hugging Face checkpoint directory instead")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (only none)")

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("GGUF with partial rotary embeddings is not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(get("vocab_size"))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        family=FAMILIES[arch], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 8192)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names, qk_norm=arch == "qwen3",
        bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
        name=name)


def load_gguf(path: Path, dtype: str, name: str | None = None,
              tensor_parallel_size: int = 1) -> LoadedModel:
    """Load a GGUF file (see ``loader.load_model``); weights dequantized to ``dtype`` on the
    host one tensor at a time, then sent straight to their shards (``build_params``)."""
    import gguf

    path = Path(path)
    name = name or path.stem
    reader = gguf.GGUFReader(str(path))
    cfg = config_from_gguf(reader, name)
    by_hf_name: dict[str, Any] = {}
    for t in reader.tensors:
        target = hf_name(t.name)
        if target is None:
            raise ValueError(f"{path}: tensor {t.name} is not part of a supported "
                             f"{cfg.family} model")
        by_hf_name[target] = t
    if cfg.tie_word_embeddings:
        by_hf_name.pop("lm_head.weight", None)

    def fetch(tensor: str) -> np.ndarray | None:
        t = by_hf_name.get(tensor)
        if t is None:
            return None
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, row-major [out, in]
        ne = tuple(int(x) for x in reversed(t.shape))
        if w.shape != ne:
            raise ValueError(f"{path}: tensor {t.name} dequantized to {w.shape}, but its ggml "
                             f"dims say {ne}")
        proj = tensor.split(".")[-2]  # "q_proj" for model.layers.N.self_attn.q_proj.weight
        heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(proj)
        # A wrong row count is left for build_params to report with the expected shape.
        if cfg.family == "llama" and heads and w.shape[0] == heads * cfg.head_dim:
            w = unpermute_qk(w, heads)
        return w

    hf_loader.check_no_unused(by_hf_name, cfg, source=str(path))
    params = hf_loader.build_params(cfg, fetch, dtype, source=str(path),
                                    tensor_parallel_size=tensor_parallel_size)
    tokenizer = load_gguf_tokenizer(path, reader)
    cfg = hf_loader.with_stop_ids(cfg, tokenizer)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, kv_scales=None, name=name,
                       tensor_parallel_size=tensor_parallel_size)
