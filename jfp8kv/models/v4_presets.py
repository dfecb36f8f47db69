"""DeepSeek-V4 shapes as config.json dicts (parsed by ``ModelConfig.from_hf_dict``), for
random-weight runs: ``deepseek-v4-flash`` (DeepSeek-V4-Flash's published config: 43 layers,
2 window-only then CSA / HCA alternating, 256 experts top-6, the first 3 MoE layers
hash-routed), ``deepseek-v4-flash-<N>l`` (its first N layers, every expert kept) and
``deepseek-v4-tiny`` (the same layout at toy size, CPU tests)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jfp8kv.config import ModelConfig
from jfp8kv.models.layers import map_named

FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "num_hash_layers": 3, "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "swiglu_limit": 10.0,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "sliding_window": 128,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "compress_rope_theta": 160000, "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],  # trailing 0: the MTP layer
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}

TINY = dict(FLASH, vocab_size=96, hidden_size=64, moe_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
            q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
            num_experts_per_tok=2, num_hash_layers=1, index_n_heads=16, index_head_dim=32,
            index_topk=3, sliding_window=6, hc_mult=2, compress_ratios=[0, 4, 8, 4],
            compress_rates={"compressed_sparse_attention": 4,
                            "heavily_compressed_attention": 8},
            rope_scaling={"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                          "original_max_position_embeddings": 64}, eos_token_id=95)


def v4_config(name: str) -> ModelConfig:
    """The ModelConfig of a V4 preset name (without ``random:``); ValueError naming them."""
    key = name.lower()
    if key == "deepseek-v4-flash":
        return ModelConfig.from_hf_dict(FLASH, name=f"random:{key}")
    if key == "deepseek-v4-tiny":
        return ModelConfig.from_hf_dict(TINY, name=f"random:{key}")
    if key.startswith("deepseek-v4-flash-") and key.endswith("l") and key[18:-1].isdigit():
        n = int(key[18:-1])
        if 1 <= n <= FLASH["num_hidden_layers"]:
            return ModelConfig.from_hf_dict(dict(FLASH, num_hidden_layers=n),
                                            name=f"random:{key}")
    raise ValueError(f"unknown DeepSeek-V4 preset {name!r}; choose deepseek-v4-flash, "
                     "deepseek-v4-flash-<N>l (first N of 43 layers) or deepseek-v4-tiny")


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal_on_device(key, shape: tuple[int, ...], dtype: str):
    return (jax.random.normal(key, shape, jnp.float32) * shape[-2] ** -0.5).astype(dtype)


@functools.cache
def _normal_on(shape: tuple[int, ...], dtype: str, where):
    return jax.jit(lambda key: _normal_on_device(key, shape, dtype), out_shardings=where)


def _normal(key, shape: tuple[int, ...], dtype: str, where=None):
    """N(0, 1 / fan_in) of ``shape`` (fan_in: the second-to-last axis), made on the device
    (``where``: made in place on the shards of that sharding, the same random bits)."""
    if where is None:
        return _normal_on_device(key, shape, dtype)
    return _normal_on(shape, dtype, where)(key)


def _layer_shapes(cfg: ModelConfig, i: int) -> dict:
    """{name: shape} of layer ``i``'s float matrices (``deepseek_v4``'s params layout)."""
    v4, d, hd = cfg.v4, cfg.hidden_size, cfg.head_dim
    h, g, n = cfg.num_heads, v4.o_groups, v4.hc_mult
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    shared = inter * max(1, cfg.n_shared_experts)
    out = {"wq_a": (d, cfg.q_lora_rank), "wq_b": (cfg.q_lora_rank, h * hd), "wkv": (d, hd),
           "wo_a": (g, h * hd // g, v4.o_lora_rank), "wo_b": (g * v4.o_lora_rank, d),
           "router": (d, e), "experts_gate": (e, d, inter), "experts_up": (e, d, inter),
           "experts_down": (e, inter, d), "shared_gate": (d, shared), "shared_up": (d, shared),
           "shared_down": (shared, d), "hc_attn/fn": (n * d, (2 + n) * n),
           "hc_ffn/fn": (n * d, (2 + n) * n)}
    kind = v4.layer_kind(i)
    if kind != "window":
        c = 2 * hd if kind == "csa" else hd
        out.update({"compressor/wkv": (d, c), "compressor/wgate": (d, c)})
    if kind == "csa":
        di, ni = v4.index_head_dim, v4.index_n_heads
        out.update({"indexer/wkv": (d, 2 * di), "indexer/wgate": (d, 2 * di),
                    "indexer/wq_b": (cfg.q_lora_rank, ni * di), "indexer/w_weights": (d, ni)})
    return out


def _random_layer(cfg: ModelConfig, i: int, key, dtype: str, sharding_of=None) -> dict:
    """Layer ``i``'s params: matrices N(0, 1/fan_in), norms 1, sinks / biases 0, mHC scales
    1; a hash layer's table sends token v to experts (7v + j) mod E, j < k (distinct).
    ``sharding_of(name, shape)``: where each matrix is made (None: the default device)."""
    v4, d, hd, n = cfg.v4, cfg.hidden_size, cfg.head_dim, cfg.v4.hc_mult
    ones, zeros = (lambda *s: jnp.ones(s, dtype)), (lambda *s: jnp.zeros(s, dtype))
    lp: dict = {"attn_norm": ones(d), "mlp_norm": ones(d), "q_a_norm": ones(cfg.q_lora_rank),
                "kv_norm": ones(hd), "sinks": zeros(cfg.num_heads)}
    for j, (name, shape) in enumerate(_layer_shapes(cfg, i).items()):
        arr = _normal(jax.random.fold_in(key, j), shape, dtype,
                      None if sharding_of is None else sharding_of(name, shape))
        if "/" in name:
            outer, inner = name.split("/")
            lp.setdefault(outer, {})[inner] = arr
        else:
            lp[name] = arr
    for hc in ("hc_attn", "hc_ffn"):
        lp[hc].update(base=zeros((2 + n) * n), scale=ones(3))
    kind, m = v4.layer_kind(i), v4.compress_ratios[i]
    if kind != "window":
        lp["compressor"].update(bias=zeros(m, 2 * hd if kind == "csa" else hd), norm=ones(hd))
    if kind == "csa":
        lp["indexer"].update(bias=zeros(m, 2 * v4.index_head_dim),
                             norm=ones(v4.index_head_dim))
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    if v4.hash_layers[i]:
        v = jnp.arange(cfg.vocab_size, dtype=jnp.int32)[:, None]
        lp["tid2eid"] = (7 * v + jnp.arange(k, dtype=jnp.int32)[None]) % e
    else:
        lp["router_bias"] = zeros(e)
    return lp


def init_random_params(cfg: ModelConfig, key, dtype: str = "bfloat16",
                       sharding_of=None) -> dict:
    """Random weights in ``deepseek_v4``'s params layout (for benchmarks and tests: the
    bytes and FLOPs are Flash's at its presets, the outputs meaningless), made on the
    default device one matrix at a time; with ``sharding_of(name, shape)`` (tensor
    parallelism) each matrix is made on its shards (the same numbers) and the small
    leaves are placed there after."""
    d, n = cfg.hidden_size, cfg.v4.hc_mult
    keys = jax.random.split(key, cfg.num_layers + 3)
    where = (lambda name, shape: None) if sharding_of is None else sharding_of
    embed = _normal(keys[0], (cfg.vocab_size, d), dtype)
    params = {"embed": embed * cfg.vocab_size ** 0.5,
              "lm_head": _normal(keys[1], (d, cfg.vocab_size), dtype,
                                 where("lm_head", (d, cfg.vocab_size))),
              "final_norm": jnp.ones((d,), dtype),
              "hc_head": {"fn": _normal(keys[2], (n * d, n), dtype),
                          "base": jnp.zeros((n,), dtype), "scale": jnp.ones((1,), dtype)},
              "layers": [_random_layer(cfg, i, keys[3 + i], dtype, sharding_of)
                         for i in range(cfg.num_layers)]}
    if sharding_of is None:
        return params
    return map_named(lambda name, x: jax.device_put(x, sharding_of(name, x.shape)), params)
