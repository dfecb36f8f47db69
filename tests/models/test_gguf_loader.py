"""GGUF loading: tiny files written here with gguf.GGUFWriter, and the packaged SmolLM2.

Tiny files are written the way llama.cpp's converter writes them (Q/K rows of llama-arch
models permuted to its RoPE layout, dims in ggml order), from a torch model's weights, in a
mix of storage formats. The loaded params must equal gguf's own dequantization of each tensor
(after undoing the permutation, checked by re-applying llama.cpp's permutation) and the
original weights within that format's quantization error.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.config import ModelConfig
from jfp8kv.models import gguf_loader, hf_loader
from jfp8kv.models.loader import load_model
from jfp8kv.models.families import random_params as init_random_params

TEXTS = ["Hello world! How are you today?", "def add(a, b):\n    return a + b\n",
         "über café 3.14159 <b>"]
_HF_TO_GGUF = {  # llama.cpp's names, written out independently of the loader's table
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, n, rest = hf.split(".", 3)
    return f"blk.{n}.{_HF_TO_GGUF[rest]}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation (HF rotate-half -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _qtype(hf: str, layer: int | None):
    """The storage format each tiny-model tensor is written in (a mix of all we test)."""
    from gguf import GGMLQuantizationType as Q

    if hf.endswith("norm.weight") or hf.endswith(".bias"):
        return Q.F32
    table = {"embed_tokens": Q.Q8_0, "q_proj": Q.F16, "k_proj": Q.Q4_0, "v_proj": Q.Q4_1,
             "o_proj": Q.BF16, "gate_proj": (Q.Q8_0, Q.F32)[layer or 0], "up_proj": Q.Q4_0,
             "down_proj": (Q.Q4_K, Q.Q6_K)[layer or 0], "lm_head": Q.F16}
    return next(q for key, q in table.items() if key in hf)


def _random_k_quant_bytes(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize these) with sane f16 super-scales."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, raw.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin lead the block
        raw[..., 0:2], raw[..., 2:4] = d, d
    else:  # Q6_K: d closes the block
        raw[..., -2:] = d
    return raw.reshape(rows, -1)


def _gguf_tokenizer_metadata(writer, tokenizer, vocab_size: int) -> None:
    import gguf

    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = set(tokenizer.all_special_ids)
    types = [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    for i in range(len(tokens), vocab_size):  # llama.cpp pads the list to the embedding rows
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def write_tiny_gguf(path: Path, arch: str, hf_cfg, state: dict, tokenizer) -> dict:
    """Write ``state`` (HF names, torch tensors) as llama.cpp would; return {gguf name: qtype}."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(hf_cfg.num_hidden_layers)
    writer.add_context_length(hf_cfg.max_position_embeddings)
    writer.add_embedding_length(hf_cfg.hidden_size)
    writer.add_feed_forward_length(hf_cfg.intermediate_size)
    writer.add_head_count(hf_cfg.num_attention_heads)
    writer.add_head_count_kv(hf_cfg.num_key_value_heads)
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(hf_cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(hf_cfg.rms_norm_eps)
    _gguf_tokenizer_metadata(writer, tokenizer, hf_cfg.vocab_size)
    written = {}
    for hf, tensor in state.items():
        if hf == "lm_head.weight" and hf_cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        layer = int(hf.split(".")[2]) if hf.startswith("model.layers.") else None
        if arch == "llama" and ".q_proj." in hf:
            w = llama_cpp_permute(w, hf_cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            w = llama_cpp_permute(w, hf_cfg.num_key_value_heads)
        qtype = _qtype(hf, layer)
        if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            data = _random_k_quant_bytes(*w.shape, qtype, rng)
        elif qtype == gguf.GGMLQuantizationType.F32:
            data = w
        else:
            data = gguf.quants.quantize(w, qtype)
        writer.add_tensor(gguf_name(hf), data, raw_dtype=None if data is w else qtype)
        written[gguf_name(hf)] = qtype
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _hf_model(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path))
    return model.config, model.state_dict(), AutoTokenizer.from_pretrained(
        str(path), local_files_only=True)


def _quant_bound(w: np.ndarray, qtype) -> np.ndarray:
    """Per-element bound on |dequant(quant(w)) - w| for the formats gguf-py can write."""
    from gguf import GGMLQuantizationType as Q

    if qtype == Q.F32:
        return np.zeros_like(w)
    if qtype in (Q.F16, Q.BF16):
        return np.abs(w) * (2.0 ** -11 if qtype == Q.F16 else 2.0 ** -8) + 1e-7
    blocks = np.abs(w).reshape(w.shape[0], -1, 32)  # 32-element blocks along the input dim
    amax = blocks.max(-1, keepdims=True)
    # Q8_0: half a step of amax/127. Q4_0: one step of amax/8 (the +8 end clips to +7).
    # Q4_1: half a step of (max - min)/15 <= 2 * amax / 15. Plus the fp16 rounding of the
    # block scale (and Q4_1's min): at most 2^-11 relative, times |q| * step <= amax.
    step = {Q.Q8_0: amax / 127 / 2, Q.Q4_0: amax / 8, Q.Q4_1: amax / 15}[qtype]
    return np.broadcast_to(step + amax * 2.0 ** -9 + 1e-7, blocks.shape).reshape(w.shape)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_dequantize_and_original(tiny_hf_checkpoint, tmp_path, monkeypatch,
                                                   family):
    import gguf

    monkeypatch.setenv("JFP8KV_CACHE", str(tmp_path / "cache"))
    hf_cfg, state, tokenizer = _hf_model(tiny_hf_checkpoint(family))
    path = tmp_path / f"tiny-{family}.gguf"
    written = write_tiny_gguf(path, family, hf_cfg, state, tokenizer)
    loaded = load_model(str(path), dtype="float32")
    cfg = loaded.config
    want = ModelConfig.from_hf_dict(hf_cfg.to_dict(), name=path.stem)
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rope_theta", "attention_bias",
                  "qk_norm", "tie_word_embeddings", "max_position_embeddings", "bos_token_id"):
        assert getattr(cfg, field) == getattr(want, field), field
    assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
    assert loaded.kv_scales is None and loaded.name == path.stem
    assert 2 in cfg.eos_token_ids

    reader = gguf.GGUFReader(str(path))
    file_tensors = {t.name: t for t in reader.tensors}
    assert set(file_tensors) == set(written)
    layers = loaded.params["layers"]
    top = {"token_embd.weight": ("embed", False), "output_norm.weight": ("final_norm", False),
           "output.weight": ("lm_head", True)}
    keys = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q": "wq", "attn_k": "wk",
            "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate", "ffn_up": "w_up",
            "ffn_down": "w_down", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
    for name, t in file_tensors.items():
        if name in top:
            key, transpose = top[name]
            got = np.asarray(loaded.params[key])
        else:
            _, n, base, kind = name.split(".")
            key = ("b" + base[-1]) if kind == "bias" else keys[base]
            got = np.asarray(layers[int(n)][key])
            transpose = kind == "weight" and got.ndim == 2
        got_hf = got.T if transpose else got  # back to HF [out, in]
        hf = next(k for k in state if gguf_name(k) == name)
        # The file's own content, re-deriving the permutation llama.cpp applied.
        as_file = got_hf
        if family == "llama" and ".attn_q." in name:
            as_file = llama_cpp_permute(got_hf, hf_cfg.num_attention_heads)
        elif family == "llama" and ".attn_k." in name:
            as_file = llama_cpp_permute(got_hf, hf_cfg.num_key_value_heads)
        np.testing.assert_array_equal(as_file, gguf.quants.dequantize(t.data, t.tensor_type),
                                      err_msg=name)
        if written[name] in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            continue  # random blocks: there is no original to compare with
        orig = state[hf].float().numpy()
        err = np.abs(got_hf - orig)
        bound = _quant_bound(orig, written[name])
        assert (err <= bound).all(), (name, written[name].name, float((err - bound).max()))
    for text in TEXTS[:2]:
        ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert loaded.tokenizer.decode(ids) == text
    assert loaded.tokenizer.chat_template == tokenizer.chat_template


def test_gguf_rope_freqs_and_unknown_arch_rejected(tmp_path):
    import gguf

    for arch, extra, match in [("llama", "rope_freqs.weight", "rope_freqs"),
                               ("gpt2", None, "unsupported GGUF architecture 'gpt2'")]:
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_block_count(1)
        writer.add_embedding_length(32)
        writer.add_head_count(2)
        if extra:
            writer.add_tensor(extra, np.ones(8, np.float32))
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=match):
            load_model(str(path))


# ---------------------------------------------------------------- the packaged SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2():
    """The default model through ``load_model(None)`` in float32 (tokenizer cache as is)."""
    return load_model(None, dtype="float32")


def test_smollm2_config(smollm2):
    loaded = smollm2
    cfg = loaded.config
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "llama", 30, 9, 3, 64, 49152, 576, 1536)
    assert cfg.tie_word_embeddings and "lm_head" not in loaded.params
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.bos_token_id == 1 and 2 in cfg.eos_token_ids  # <|im_start|>, <|im_end|>
    assert not cfg.attention_bias and not cfg.qk_norm and cfg.rope_scaling is None
    assert loaded.name == cfg.name == "smollm2-135m-instruct" and loaded.kv_scales is None
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), loaded.params)
    ref = jax.eval_shape(lambda k: init_random_params(cfg, k, jnp.float32), jax.random.key(0))
    assert shapes == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), ref)


def test_smollm2_params_match_transformers_gguf_processing(smollm2, smollm2_gguf_path):
    """Names (gguf-py's own table), dequantization and the Q/K un-permutation agree with
    what transformers' GGUF loader does to each tensor of the file."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    cfg = smollm2.config
    processor = TENSOR_PROCESSORS["llama"](config=dict(num_attention_heads=9,
                                                       num_key_value_heads=3))
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_layers)
    specs = hf_loader.tensor_specs(cfg)
    to_gguf = {table.get_name(s.name.rsplit(".", 1)[0]) + ".weight": s for s in specs}
    reader = gguf.GGUFReader(str(smollm2_gguf_path))
    assert sorted(t.name for t in reader.tensors) == sorted(to_gguf)  # tied: no output.weight
    for t in reader.tensors:
        spec = to_gguf[t.name]
        assert gguf_loader.hf_name(t.name) == spec.name
        tree = smollm2.params if spec.layer is None else smollm2.params["layers"][spec.layer]
        got = np.asarray(tree[spec.key])
        ref = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type),
                                name=t.name).weights
        np.testing.assert_array_equal(got.T if spec.transpose else got, ref, err_msg=t.name)


def test_smollm2_tokenizer(smollm2):
    tok = smollm2.tokenizer
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
