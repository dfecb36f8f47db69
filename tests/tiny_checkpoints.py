"""The one builder of tiny random Hugging Face checkpoints that every test folder uses.

The fixtures that call it live in ``tests/conftest.py`` (``tiny_tokenizer_dir``,
``tiny_hf_checkpoint``, ``smollm2_tokenizer_dir``) and ``tests/serve/conftest.py``
(``tiny_model_dir``); this module holds no fixtures, so no conftest imports another's.

``build_tiny_checkpoint(path, family, dtype="float32", tied=None, sharded=None,
tokenizer_dir=None, init_seed=None, **config_overrides)`` writes a 2-layer model with
transformers' ``save_pretrained`` next to a tokenizer (``tokenizer_dir``'s, or a small
byte-level BPE with a ChatML chat template trained here) and returns ``path``. Families:

    llama    LlamaConfig, GQA 4/2, untied
    llama3   LlamaConfig with llama3 rope_scaling, GQA 4/2, tied, sharded safetensors
    mistral  MistralConfig (sliding_window=None), MQA 4/1, untied
    qwen2    Qwen2Config (q/k/v biases), GQA 4/2, tied
    qwen3    Qwen3Config (q/k norms, head_dim 32 so heads*head_dim != hidden), GQA 4/2, untied

By default (``init_seed=None``) weights are re-drawn at a larger scale than HF's init (norm
weights and biases too), so that logits are not near-uniform and parity tests can see real
differences. With ``init_seed=N`` the weights are HF's own init (scale from the config's
``initializer_range``) under ``torch.manual_seed(N)``. Load the reference with
``AutoModelForCausalLM.from_pretrained(path)`` (local, offline).
"""

from __future__ import annotations

import math
from pathlib import Path

VOCAB_SIZE = 384  # model rows; the tokenizer has fewer (like real padded vocabularies)
TOKENIZER_VOCAB = 320
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "Paged attention stores keys and values in fixed-size pages of the cache.",
    "def add(a, b):\n    return a + b\n",
    "1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
]
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
_DEFAULTS = {  # family -> (tied, sharded)
    "llama": (False, False), "llama3": (True, True), "mistral": (False, False),
    "qwen2": (True, False), "qwen3": (False, False),
}


def build_tiny_tokenizer(path: Path):
    """Train a tiny byte-level BPE offline; specials 0..2 = endoftext, im_start, im_end."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return fast


def hf_config(family: str, tied: bool, **overrides):
    """The transformers config of a tiny ``family`` model; ``overrides`` replace fields."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=tied)
    if family == "llama":
        return LlamaConfig(**{**common, "rope_theta": 10000.0, **overrides})
    if family == "llama3":
        return LlamaConfig(**{**common, **overrides}, rope_scaling={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if family == "mistral":
        return MistralConfig(**{**common, "num_key_value_heads": 1, "sliding_window": None,
                                "rope_theta": 1e6, **overrides})
    if family == "qwen2":
        return Qwen2Config(**{**common, "rope_theta": 1e6, "use_sliding_window": False,
                              **overrides})
    if family == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 32, "rope_theta": 1e6,
                              "use_sliding_window": False, **overrides})
    raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")


def randomize(model, seed: int, scales: dict[str, float] | None = None) -> None:
    """Larger-than-init random weights, so that logits (and MoE routing) are far from
    uniform: matrices N(0, 1/in) (fan-in is the last axis, also of stacked experts [E, out,
    in]), norms 1 + N(0, 0.04), biases N(0, 0.04), embeddings N(0, 0.25); ``scales`` maps
    a parameter-name suffix to the standard deviation of parameters to draw as N(0, s^2)."""
    import torch

    scales = {".bias": 0.2, **(scales or {})}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            scale = next((v for k, v in scales.items() if name.endswith(k)), None)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif scale is not None:
                p.copy_(scale * noise)
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def save_with_tokenizer(model, path: Path, tokenizer_dir: Path, **save_kw) -> Path:
    """``model.save_pretrained(path)`` and the tokenizer saved in ``tokenizer_dir`` beside it."""
    from transformers import AutoTokenizer

    model.save_pretrained(str(path), **save_kw)
    AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(
        str(path))
    return path


def build_tiny_checkpoint(path: Path, family: str, dtype: str = "float32",
                          tied: bool | None = None, sharded: bool | None = None,
                          tokenizer_dir: Path | None = None, init_seed: int | None = None,
                          **config_overrides) -> Path:
    """Write a tiny ``family`` checkpoint to ``path`` (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    d_tied, d_sharded = _DEFAULTS[family]
    tied = d_tied if tied is None else tied
    sharded = d_sharded if sharded is None else sharded
    cfg = hf_config(family, tied, **config_overrides)
    torch.manual_seed(0 if init_seed is None else init_seed)
    model = AutoModelForCausalLM.from_config(cfg)
    if init_seed is None:
        randomize(model, seed=FAMILIES.index(family))
    model = model.to(getattr(torch, dtype))
    shard = "40KB" if sharded else "5GB"
    if tokenizer_dir is not None:
        return save_with_tokenizer(model, path, tokenizer_dir, max_shard_size=shard)
    model.save_pretrained(str(path), max_shard_size=shard)
    build_tiny_tokenizer(path)
    return path


def first_layers(loaded, n: int):
    """A loaded real model (``models.loader.LoadedModel``) cut to its first ``n`` layers: the
    real weights, tokenizer and head layout (SmolLM2: 9 query heads, 3 KV heads of 64, vocab
    49,152) with fewer layers to compile and run, for checks whose outcome does not depend on
    the depth (sharding, prefix caching)."""
    import dataclasses

    cfg = dataclasses.replace(loaded.config, num_layers=n)
    return dataclasses.replace(loaded, config=cfg,
                               params={**loaded.params, "layers": loaded.params["layers"][:n]})
