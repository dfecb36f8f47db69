"""Hugging Face checkpoint directories (config.json + safetensors) -> params pytree.

Hugging Face tensor naming is also the canonical intermediate for other formats: the GGUF
loader renames its tensors to HF names and goes through ``build_params`` too, so the
name -> pytree mapping, shape checks and transposes live here once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jfp8kv.config import ModelConfig
from jfp8kv.models import sharding
from jfp8kv.models.loaded import LoadedModel

NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
             "float32": np.dtype(np.float32)}
# Checkpoint storage dtypes we read (fp8/int weights are quantized checkpoints: unsupported).
SOURCE_DTYPES = set(NP_DTYPES.values())
NP_DTYPES["float64"] = np.dtype(np.float64)  # the float64 check mode (an exact upcast)
# End-of-turn markers that chat templates emit; added to the stop ids when the template does.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_KV_SCALE_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")
_IGNORED_RE = re.compile(r"(rotary_emb\.inv_freq|self_attn\.(k_scale|v_scale|kv_scale))$")


class TensorSpec(NamedTuple):
    """One checkpoint tensor: HF name and shape, where it goes, whether to transpose."""

    name: str
    shape: tuple[int, ...]
    layer: int | None  # None: top-level key of params
    key: str
    transpose: bool
    expert: int | None = None  # routed expert: row of the [E, ...] stack at ``key``


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor ``cfg`` needs, with HF names and HF shapes (linear weights [out, in])."""
    v, d, i_sz, hd = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_heads * hd, cfg.num_kv_heads * hd
    specs = [TensorSpec("model.embed_tokens.weight", (v, d), None, "embed", False)]
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        if cfg.is_mla:
            specs += _mla_specs(cfg, n)
            continue
        if cfg.hybrid is not None:  # Qwen3.5/3.6: models/qwen3_hybrid.py
            from jfp8kv.models import qwen3_hybrid

            specs += qwen3_hybrid.hf_layer_specs(cfg, n, TensorSpec) + _moe_specs(cfg, n)
            continue
        specs += [
            TensorSpec(p + "input_layernorm.weight", (d,), n, "attn_norm", False),
            TensorSpec(p + "self_attn.q_proj.weight", (q_dim, d), n, "wq", True),
            TensorSpec(p + "self_attn.k_proj.weight", (kv_dim, d), n, "wk", True),
            TensorSpec(p + "self_attn.v_proj.weight", (kv_dim, d), n, "wv", True),
            TensorSpec(p + "self_attn.o_proj.weight", (d, q_dim), n, "wo", True),
            TensorSpec(p + "post_attention_layernorm.weight", (d,), n, "mlp_norm", False),
        ]
        specs += _moe_specs(cfg, n) if cfg.is_moe_layer(n) else [
            TensorSpec(p + "mlp.gate_proj.weight", (i_sz, d), n, "w_gate", True),
            TensorSpec(p + "mlp.up_proj.weight", (i_sz, d), n, "w_up", True),
            TensorSpec(p + "mlp.down_proj.weight", (d, i_sz), n, "w_down", True),
        ]
        if cfg.attention_bias:
            specs += [TensorSpec(p + f"self_attn.{x}_proj.bias", (dim,), n, f"b{x}", False)
                      for x, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
        if cfg.qk_norm:
            specs += [TensorSpec(p + f"self_attn.{x}_norm.weight", (hd,), n, f"{x}_norm", False)
                      for x in ("q", "k")]
    specs.append(TensorSpec("model.norm.weight", (d,), None, "final_norm", False))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (v, d), None, "lm_head", True))
    return specs


def _mla_specs(cfg: ModelConfig, n: int) -> list[TensorSpec]:
    """DeepSeek-V2/V3 layer ``n``: latent attention, then a dense MLP (layers before
    ``first_k_dense_replace``) or the MoE with shared experts (and V3's router bias)."""
    d, hh, r, p = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, f"model.layers.{n}."
    qk = hh * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    a = p + "self_attn."
    specs = [TensorSpec(p + "input_layernorm.weight", (d,), n, "attn_norm", False),
             TensorSpec(p + "post_attention_layernorm.weight", (d,), n, "mlp_norm", False),
             TensorSpec(a + "kv_a_proj_with_mqa.weight", (r + cfg.qk_rope_head_dim, d), n,
                        "wkv_a", True),
             TensorSpec(a + "kv_a_layernorm.weight", (r,), n, "kv_a_norm", False),
             TensorSpec(a + "kv_b_proj.weight", (hh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
                        n, "wkv_b", True),
             TensorSpec(a + "o_proj.weight", (d, hh * cfg.v_head_dim), n, "wo", True)]
    if cfg.q_lora_rank is None:
        specs.append(TensorSpec(a + "q_proj.weight", (qk, d), n, "wq", True))
    else:
        ql = cfg.q_lora_rank
        specs += [TensorSpec(a + "q_a_proj.weight", (ql, d), n, "wq_a", True),
                  TensorSpec(a + "q_a_layernorm.weight", (ql,), n, "q_a_norm", False),
                  TensorSpec(a + "q_b_proj.weight", (qk, ql), n, "wq_b", True)]
    i_sz, m = cfg.intermediate_size, p + "mlp."
    if not cfg.is_moe_layer(n):
        return specs + [TensorSpec(m + "gate_proj.weight", (i_sz, d), n, "w_gate", True),
                        TensorSpec(m + "up_proj.weight", (i_sz, d), n, "w_up", True),
                        TensorSpec(m + "down_proj.weight", (d, i_sz), n, "w_down", True)]
    si = cfg.n_shared_experts * cfg.moe_intermediate_size
    specs += _moe_specs(cfg, n) + [
        TensorSpec(m + "shared_experts.gate_proj.weight", (si, d), n, "shared_gate", True),
        TensorSpec(m + "shared_experts.up_proj.weight", (si, d), n, "shared_up", True),
        TensorSpec(m + "shared_experts.down_proj.weight", (d, si), n, "shared_down", True)]
    if cfg.family == "deepseek_v3":
        specs.append(TensorSpec(m + "gate.e_score_correction_bias", (cfg.num_experts,), n,
                                "router_bias", False))
    return specs


def _moe_specs(cfg: ModelConfig, n: int) -> list[TensorSpec]:
    """Router and per-expert SwiGLU weights of routed layer ``n`` (stacked at load time)."""
    d, i_sz, p = cfg.hidden_size, cfg.moe_intermediate_size, f"model.layers.{n}.mlp."
    specs = [TensorSpec(p + "gate.weight", (cfg.num_experts, d), n, "router", True)]
    for e in range(cfg.num_experts):
        specs += [TensorSpec(p + f"experts.{e}.{x}_proj.weight", shape, n, f"experts_{x}", True, e)
                  for x, shape in (("gate", (i_sz, d)), ("up", (i_sz, d)), ("down", (d, i_sz)))]
    return specs


def build_params(cfg: ModelConfig, fetch: Callable[[str], np.ndarray | None], dtype: str,
                 source: str, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """Assemble the params pytree from HF-named host arrays.

    ``fetch(name)`` returns the tensor as a numpy array in HF layout, or None when the
    checkpoint lacks it. Raises ValueError naming the tensor on a missing tensor, a shape
    mismatch or an unsupported storage dtype. Each tensor goes from the host straight to
    its device(s): with ``tensor_parallel_size`` > 1, each device receives only its shard
    (``models/sharding.py``), never a full copy on one device.
    """
    out_dtype = NP_DTYPES[dtype]
    put = sharding.weight_placer(cfg, tensor_parallel_size)
    params: dict[str, Any] = {"layers": [{} for _ in range(cfg.num_layers)]}
    for spec in tqdm(tensor_specs(cfg), desc=f"loading {Path(source).name}", unit="tensor",
                     leave=False):
        arr = fetch(spec.name)
        if arr is None:
            hint = " (or set tie_word_embeddings)" if spec.key == "lm_head" else ""
            raise ValueError(f"checkpoint {source} is missing tensor {spec.name}{hint}")
        if arr.dtype not in SOURCE_DTYPES:
            raise ValueError(f"tensor {spec.name} in {source} has unsupported dtype {arr.dtype}; "
                             "jfp8kv reads float32, float16 and bfloat16 weights")
        if tuple(arr.shape) != spec.shape:
            raise ValueError(f"tensor {spec.name} in {source} has shape {tuple(arr.shape)}, "
                             f"expected {spec.shape}")
        host = np.ascontiguousarray(arr.T if spec.transpose else arr, dtype=out_dtype)
        target = params if spec.layer is None else params["layers"][spec.layer]
        if spec.expert is None:
            target[spec.key] = put(spec.key, host)
        else:  # rows of an [E, ...] host stack, moved to the device once complete below
            stack = target.setdefault(spec.key, np.empty((cfg.num_experts, *host.shape), out_dtype))
            stack[spec.expert] = host
    for lp in params["layers"]:
        lp.update({k: put(k, v) for k, v in lp.items() if isinstance(v, np.ndarray)})
    return params


def read_kv_scales(names: Iterable[str], fetch: Callable[[str], np.ndarray | None],
                   num_layers: int, source: str) -> dict[str, np.ndarray] | None:
    """Per-layer fp8 K/V scales from ``self_attn.{k,v}_scale`` (legacy ``kv_scale``: both)."""
    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for name in names:
        m = _KV_SCALE_RE.fullmatch(name)
        if m is None:
            continue
        layer, kind = int(m.group(1)), m.group(2)
        value = np.asarray(fetch(name), dtype=np.float32)
        if value.size != 1:
            raise ValueError(f"{name} in {source} has shape {value.shape}; expected one "
                             "per-tensor scale")
        for which in ("k", "v") if kind == "kv_scale" else (kind[0],):
            found[which].setdefault(layer, float(value.reshape(())))
    if not found["k"] and not found["v"]:
        return None
    scales = {}
    for which in ("k", "v"):
        missing = sorted(set(range(num_layers)) - set(found[which]))
        if missing:
            raise ValueError(f"checkpoint {source} has fp8 {which}_scale tensors for some "
                             f"layers but not for layers {missing}")
        scales[which] = np.array([found[which][n] for n in range(num_layers)], np.float32)
    return scales


def check_no_unused(names: Iterable[str], cfg: ModelConfig, source: str) -> None:
    """Raise when the checkpoint holds tensors the model would silently drop."""
    used = {s.name for s in tensor_specs(cfg)}
    if cfg.tie_word_embeddings:
        used.add("lm_head.weight")
    unused = sorted(n for n in names if n not in used and not _IGNORED_RE.search(n))
    if unused:
        more = f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
        raise ValueError(f"checkpoint {source} has tensors jfp8kv's {cfg.family} model does not "
                         f"use: {unused[:5]}{more}; this variant (quantized weights, extra "
                         "biases, ...) is not supported")


def with_stop_ids(cfg: ModelConfig, tokenizer: Any, extra: Iterable[int] = ()) -> ModelConfig:
    """Add the tokenizer's eos and the chat template's end-of-turn markers to the stop ids."""
    ids = list(cfg.eos_token_ids) + [int(i) for i in extra]
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        vocab = tokenizer.get_vocab()
        ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in template and t in vocab]
    return dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(ids)))


def _load_v4_dir(path: Path, cfg: ModelConfig, dtype: str, tensor_parallel_size: int):
    """A DeepSeek-V4 checkpoint of float tensors, in DeepSeek's names or transformers'
    (``v4_checkpoint``), through ``deepseek_v4.params_from_hf``, each leaf onto its shards
    of a ``tensor_parallel_size`` mesh; the MTP layer is skipped. ValueError for a
    quantized (fp8 / fp4) tensor, a missing or an unused one."""
    from safetensors import safe_open

    from jfp8kv.models import deepseek_v4, v4_checkpoint

    files = {n: f for n, f in _tensor_files(path).items() if not n.startswith("mtp.")}
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="numpy"))
                   for f in set(files.values())}

        def read(name: str) -> np.ndarray:
            arr = handles[files[name]].get_tensor(name)
            if arr.dtype.kind not in "iu" and arr.dtype not in SOURCE_DTYPES:
                raise ValueError(f"tensor {name} in {path} is {arr.dtype}: DeepSeek-V4's "
                                 "released fp8 / fp4 checkpoints are not loaded yet (dequantize "
                                 "them to bf16 first); jfp8kv reads float32/16 and bf16")
            return arr

        get, consumed = v4_checkpoint.transformers_getter(files, read)

        def need(name: str) -> np.ndarray:
            try:
                return get(name)
            except KeyError:
                raise ValueError(f"checkpoint {path} is missing tensor {name}") from None

        params = deepseek_v4.params_from_hf(need, cfg, NP_DTYPES[dtype],
                                            sharding.weight_placer(cfg, tensor_parallel_size))
    unused = sorted(set(files) - consumed)
    if unused:
        raise ValueError(f"checkpoint {path} has tensors jfp8kv's DeepSeek-V4 model does not "
                         f"use: {unused[:5]}; this variant is not supported")
    tokenizer = _load_tokenizer(path)
    return LoadedModel(config=with_stop_ids(cfg, tokenizer), params=params,
                       tokenizer=tokenizer, kv_scales=None, name=path.resolve().name,
                       tensor_parallel_size=tensor_parallel_size)


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = {f: path / f for f in set(weight_map.values())}
        for f, p in files.items():
            if not p.is_file():
                raise FileNotFoundError(f"shard {f} listed in {index_file} does not exist")
        return {name: files[f] for name, f in weight_map.items()}
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors file in {path} (PyTorch .bin checkpoints are "
                                "not supported; re-save with safe_serialization=True)")
    from safetensors import safe_open

    index = {}
    for shard in shards:
        with safe_open(str(shard), framework="numpy") as f:
            index.update({name: shard for name in f.keys()})
    return index


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise FileNotFoundError(f"could not load a tokenizer from {path} (it needs "
                                f"tokenizer.json or tokenizer_config.json): {e}") from e


def load_hf_dir(path: Path, dtype: str, tensor_parallel_size: int = 1) -> LoadedModel:
    """Load a Hugging Face checkpoint directory (see ``loader.load_model``)."""
    from safetensors import safe_open

    path = Path(path)
    name = path.resolve().name
    cfg_dict = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(cfg_dict, name=name)
    if cfg.v4 is not None:
        return _load_v4_dir(path, cfg, dtype, tensor_parallel_size)
    if cfg_dict.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window=true is not supported; use a checkpoint "
                         "with full attention in every layer")
    files = _tensor_files(path)
    original = {}  # our name -> the checkpoint's, where they differ
    if cfg.hybrid is not None:  # the multimodal checkpoint: text tower only, MTP head unused
        original = {n.replace("model.language_model.", "model.", 1): n for n in files
                    if not n.startswith(("model.visual.", "mtp."))}
        files = {new: files[old] for new, old in original.items()}
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="numpy"))
                   for f in set(files.values())}

        def fetch(tensor: str) -> np.ndarray | None:
            f = files.get(tensor)
            return None if f is None else handles[f].get_tensor(original.get(tensor, tensor))

        params = build_params(cfg, fetch, dtype, source=str(path),
                              tensor_parallel_size=tensor_parallel_size)
        kv_scales = read_kv_scales(files, fetch, cfg.num_layers, source=str(path))
        check_no_unused(files, cfg, source=str(path))
    tokenizer = _load_tokenizer(path)
    gen_file = path / "generation_config.json"
    gen_eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    extra = gen_eos if isinstance(gen_eos, list) else ([] if gen_eos is None else [gen_eos])
    cfg = with_stop_ids(cfg, tokenizer, extra)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, kv_scales=kv_scales,
                       name=name, tensor_parallel_size=tensor_parallel_size)
