"""Frozen, hashable configuration, layered outward: model -> cache -> engine.

Configs are never mutated; use ``dataclasses.replace`` to derive a new one. They are
hashable so they can be static arguments of jitted functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jfp8kv.config_fields import (MLA_FAMILIES, HybridFields, RopeScaling, YarnScaling,
                                  hybrid_fields, unwrap_text_config)
from jfp8kv.config_hf import SUPPORTED_ARCHITECTURES, hf_model_fields  # noqa: F401 (re-export)
from jfp8kv.config_v4 import V4Fields

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
    rope_scaling: RopeScaling | YarnScaling | None = None
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
    # Multi-head latent attention (deepseek_v2 / deepseek_v3); kv_lora_rank == 0: not MLA.
    q_lora_rank: int | None = None  # None: one q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # pairwise (even, odd) rotation instead of rotate-half
    # DeepSeek MoE: layers >= first_k_dense_replace are routed (transformers' rule).
    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    # Qwen3.5/3.6 hybrid (qwen3_5_moe): Gated DeltaNet layers beside gated attention.
    hybrid: HybridFields | None = None
    # DeepSeek-V4 (family deepseek_v4): window / CSA / HCA schedule and V4-only shapes.
    v4: V4Fields | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer by MLA: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` uses the routed experts (transformers' Qwen3-MoE rule; DeepSeek:
        every layer from ``first_k_dense_replace`` on)."""
        if self.family in MLA_FAMILIES:
            return self.num_experts > 0 and layer >= self.first_k_dense_replace
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict; raise for unsupported architectures."""
        text = unwrap_text_config(cfg)
        if text is not None:  # Qwen3.5/3.6 hybrid MoE: config_fields.hybrid_fields
            return cls(**hybrid_fields(text), name=name)
        return cls(**hf_model_fields(cfg), name=name)

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2", "fp8")
KV_SCALE_MODES = ("tensor", "channel", "token", "block")
# What is done to K before fp8 storage (``jfp8kv.kvcache.k_transform``): nothing, a Hadamard
# rotation (queries rotated alike), subtracting a calibrated per-channel K mean, or both.
KV_ROTATIONS = ("none", "hadamard", "smooth", "smooth+hadamard")
ATTENTION_BACKENDS = ("auto", "pallas", "pallas_triton", "reference")
GEMM_AUTOTUNE = ("default", "exhaustive")  # EngineConfig.decode_gemm_autotune
FP8_ATTENTION_COMPUTES = ("dequant", "fp8")  # CacheOptions.fp8_attention_compute
ADMISSION_POLICIES = ("reserve", "greedy")  # EngineConfig.admission (engine/admission.py)
FEATURE_EXECUTABLES = ("switched", "per-mix")  # EngineConfig.feature_executables (variants.py)
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
# Not for serving: float64 compute exists so the fp8 cache can be checked against another
# float64 implementation without float32 rounding noise (CPU, reference attention, x64 on).
CHECK_DTYPES = ("float64",)


def check_choices(obj, **allowed) -> None:
    """ValueError naming the choices for the first field of ``obj`` not among its own."""
    for name, options in allowed.items():
        if getattr(obj, name) not in options:
            raise ValueError(f"unknown {name} {getattr(obj, name)!r}; choose one of "
                             f"{list(options)}")


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

    ``storage_dtype``: the page arrays' dtype (``float8_e4m3fn``, ``float8_e5m2``, ``bfloat16``,
    ``float16``, ``float32``), not the model's compute dtype. ``scale_mode``: fp8 only (else
    ``None``). ``layout="latent"`` (MLA): one page array per layer, ``num_kv_heads`` 1,
    ``head_dim`` = kv_lora_rank + qk_rope_head_dim, no V array (``jfp8kv.kvcache.latent``).
    ``kv_rotation``: the transform of K before storage (and of the queries),
    ``jfp8kv.kvcache.k_transform``; the engine builder sets it for fp8 storage only.
    ``bitcast_pool``: 8/16-bit pages held as same-width unsigned integers
    (``kvcache.cache.pool_dtype``), set by the builder for the reference backend on CPU,
    where XLA updates integer pools in place but rewrites a whole float pool per scatter.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    storage_dtype: str
    scale_mode: str | None = None
    scale_block: int = 32
    bitcast_pool: bool = False
    layout: str = "kv"  # "kv": K and V pages; "latent": one MLA row per token (kvcache/latent.py)
    kv_rotation: str = "none"  # KV_ROTATIONS; see jfp8kv.kvcache.k_transform
    # FP8_ATTENTION_COMPUTES: "fp8" = e4m3 q.K^T products (``kernels.fp8_products``)
    attention_compute: str = "dequant"

    def __post_init__(self):
        check_choices(self, kv_rotation=KV_ROTATIONS, attention_compute=FP8_ATTENTION_COMPUTES)

    @property
    def is_fp8(self) -> bool:
        return self.storage_dtype.startswith("float8")

    @property
    def max_tokens(self) -> int:
        """Tokens the pool holds for sequences (page 0 is the reserved padding sink)."""
        return (self.num_pages - 1) * self.page_size


# -- what a user asks for: model source, cache storage, engine knobs. Each field's metadata
# carries its flag's help, choices and parser: ``jfp8kv.cli`` builds every flag from them.


def _knob(default, help: str, *, choices=None, parse=None, metavar=None):
    meta = {"help": help, "choices": choices, "parse": parse, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


def parse_kv_scales(value: str) -> float | str:
    """A command-line ``--kv-scales`` value: a float, else a path to a scales JSON."""
    try:
        return float(value)
    except ValueError:
        return value


def parse_int_tuple(value: str) -> tuple[int, ...]:
    """``"8,32,64"`` -> ``(8, 32, 64)``."""
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """Which checkpoint to load and the compute dtype of its weights and activations."""

    model: str | None = _knob(
        None, "HF directory, .gguf file, 'random:<preset>', or 'smollm2-135m-instruct' "
              "(the default)")
    dtype: str = _knob("bfloat16", "compute dtype of weights and activations",
                       choices=COMPUTE_DTYPES)


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """The user's request for KV-cache storage; the engine builder resolves it, with the
    model and the memory budget, into a ``CacheConfig``. ``kv_scale_mode``, ``kv_scales``
    and ``kv_rotation`` apply to fp8 storage only (ignored, with a warning, otherwise)."""

    kv_cache_dtype: str = _knob(
        "auto", "KV cache storage dtype: auto (= --dtype) or fp8_e4m3/fp8_e5m2 (fp8 = e4m3)",
        choices=KV_CACHE_DTYPES)
    kv_scale_mode: str | None = _knob(
        None, "fp8 scale granularity (default: token, the engine's documented default)",
        choices=KV_SCALE_MODES)
    kv_scales: float | str | None = _knob(
        None, "static fp8 scales (tensor/channel modes): a float for every layer or a scales "
              "JSON from `python -m jfp8kv.calibrate` (default: checkpoint scales, else "
              "calibrate at start-up)", parse=parse_kv_scales)
    kv_rotation: str = _knob(
        "none", "fp8 K transform before storage: none, hadamard (K and queries rotated), "
                "smooth (a calibrated per-channel K mean subtracted; exact for attention) "
                "or smooth+hadamard", choices=KV_ROTATIONS)
    fp8_attention_compute: str = _knob(
        "dequant", "fp8 prefill attention's products: dequant (fp8 tiles upcast, 16-bit "
        "products) or fp8 (q quantized per row to e4m3, q.K^T on fp8 tensor cores; Hopper's "
        "Mosaic prefill kernel, fp8_e4m3 with token/tensor/channel scales; elsewhere dequant)",
        choices=FP8_ATTENTION_COMPUTES)

    def __post_init__(self):
        check_choices(self, kv_rotation=KV_ROTATIONS, fp8_attention_compute=FP8_ATTENTION_COMPUTES,
                      **({} if self.kv_scale_mode is None else {"kv_scale_mode": KV_SCALE_MODES}))
        s = self.kv_scales
        if isinstance(s, bool) or not isinstance(s, (int, float, str, type(None))):
            raise ValueError(f"kv_scales must be a float, a path to a scales JSON or None, "
                             f"got {type(s).__name__}")
        if isinstance(s, (int, float)) and not s > 0:
            raise ValueError(f"kv_scales must be positive, got {s}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Scheduler, runner and capacity knobs of one engine.

    ``None`` means "chosen by the builder": the model's context length for ``max_model_len``,
    free device memory for ``kv_cache_memory``, the device's shape policy for ``decode_steps``,
    ``decode_buckets``, ``min_prefill_chunk`` and ``max_num_batched_tokens``; the builder
    returns the resolved copy (``None`` left only in ``decode_buckets``: powers of two).
    """

    max_model_len: int | None = _knob(
        None, "tokens per sequence, prompt plus output (default: the model's context length)")
    kv_cache_memory: int | None = _knob(
        None, "bytes for the cache pools (default: what --gpu-memory-utilization leaves after "
              "the weights, the step's measured peak temporaries and a margin; on CPU up to "
              "1 GiB)")
    gpu_memory_utilization: float = _knob(
        0.9, "fraction of the GPU's memory the engine may use: weights, the step's "
             "temporaries and the cache pools")
    page_size: int = _knob(16, "tokens per KV-cache page (a power of two in [8, 128])")
    max_num_seqs: int | None = _knob(
        None, "sequences running at once (decode batch limit; default 64, fewer where the "
              "model's per-sequence state would take more than a quarter of the GPU pool)")
    max_num_batched_tokens: int | None = _knob(
        None, "prefill tokens per engine step (decode rows on top; nll chunk; default 8192 on "
              "GPU, halved while the step's temporaries would take more than a third of the "
              "memory left after the weights; 256 on CPU)")
    max_queue_len: int | None = _knob(
        1024, "waiting requests beyond this are refused (the server answers 503 + Retry-After; "
              "None: max_num_seqs)")
    attention_backend: str = _knob(
        "auto", "attention kernels: auto = pallas on an NVIDIA GPU (on Hopper the Mosaic GPU "
        "prefill kernel for bf16 pages and fp8 with token, tensor or channel scales, and the "
        "Mosaic MLA decode kernel; Triton otherwise), reference elsewhere; "
        "pallas_triton = the Triton kernels only",
        choices=ATTENTION_BACKENDS)
    seed: int = _knob(0, "base seed of sampling (a request's own seed overrides it)")
    decode_steps: int | None = _knob(
        None, "decode steps per device dispatch (default: 8 on GPU, 1 on CPU)")
    decode_buckets: tuple[int, ...] | None = _knob(
        None, "allowed decode batch sizes, e.g. 8,32,64 (default: 8,32,64,128,256 on GPU, "
              "1,8,64 on CPU)", parse=parse_int_tuple, metavar="N,N,...")
    min_prefill_chunk: int | None = _knob(
        None, "smallest prefill chunk bucket in tokens (default: 128 on GPU, 16 on CPU)")
    compile_cache: bool = _knob(
        True, "keep compiled executables in JAX's persistent cache ($JFP8KV_CACHE/jax-cache, "
              "default ~/.cache/jfp8kv/jax-cache), so later starts skip compilation")
    tensor_parallel_size: int = _knob(
        1, "devices one model runs over (a 1-D mesh of the first N devices): attention "
           "heads, KV heads and the page pool sharded; must divide the number of attention "
           "heads; kv_cache_memory is then per device")
    enable_prefix_caching: bool = _knob(
        True, "reuse the cached KV pages of a prompt's prefix computed by an earlier request "
              "(same tokens, same cache settings) instead of recomputing it")
    state_snapshot_memory: float | None = _knob(
        None, "models with a per-sequence state (Qwen3.5/3.6 hybrids, DeepSeek-V4): the "
              "cache pools kept for state snapshots of prefix caching, as a fraction (< 1) "
              "of the pools or bytes (>= 1); 0 turns their prefix caching off (default: 4 "
              "snapshots per running sequence, at most a fifth of the pools)")
    overlap_scheduling: bool = _knob(
        True, "schedule and dispatch the next engine step while the device runs the current "
              "one, reading its sampled tokens one step later (same tokens as the serialized "
              "path; off: read, then schedule)")
    decode_gemm_autotune: str = _knob(
        "default", "XLA's search for the decode step's GEMM tilings on a GPU: default (its "
        "short list) or exhaustive (every Triton tiling: 0.6B decode ~4% faster, 80-90 s "
        "more per decode batch size on the first start; kept in the compilation cache)",
        choices=GEMM_AUTOTUNE)
    admission: str = _knob(
        "greedy", "when a waiting request starts: reserve (only if the free pages cover the "
        "running requests' expected growth, so the pool stays full without preempting) or "
        "greedy (as soon as its first prefill chunk fits; preempts the newest when decode "
        "runs out of pages; the default until an H200 A/B decides: docs/lab/engine-notes.md)",
        choices=ADMISSION_POLICIES)
    feature_executables: str = _knob(
        "switched", "requests with log-probs, penalties, min_tokens or prompt scoring: switched "
        "(one executable per shape, the features switched on the device, compiled before "
        "/health; a GPU keeps plain decode's own executables) or per-mix (each feature mix "
        "compiles its own executable on first use: the former GPU way, for an A/B)",
        choices=FEATURE_EXECUTABLES)

    def __post_init__(self):
        ps = self.page_size
        if not isinstance(ps, int) or ps & (ps - 1) or not 8 <= ps <= 128:
            raise ValueError(f"page_size must be a power of two in [8, 128], got {ps}")
        for name in ("max_model_len", "kv_cache_memory", "max_num_seqs",
                     "max_num_batched_tokens", "max_queue_len", "decode_steps",
                     "min_prefill_chunk", "tensor_parallel_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.state_snapshot_memory is not None and not self.state_snapshot_memory >= 0:
            raise ValueError(f"state_snapshot_memory must be >= 0 (a fraction below 1, or "
                             f"bytes), got {self.state_snapshot_memory!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        check_choices(self, attention_backend=ATTENTION_BACKENDS,
                      decode_gemm_autotune=GEMM_AUTOTUNE, admission=ADMISSION_POLICIES,
                      feature_executables=FEATURE_EXECUTABLES)
        if self.decode_buckets is not None:
            if not self.decode_buckets or any(b < 1 for b in self.decode_buckets):
                raise ValueError(f"decode_buckets must be positive batch sizes, got "
                                 f"{self.decode_buckets!r}")
            object.__setattr__(self, "decode_buckets", tuple(sorted(set(self.decode_buckets))))


OPTION_CLASSES = (LoadConfig, CacheOptions, EngineConfig)


def split_options(options: dict[str, Any], *, load: LoadConfig | None = None,
                  cache: CacheOptions | None = None, engine: EngineConfig | None = None):
    """Distribute flat keyword options (``LLM(**kw)``'s names) over the three option classes,
    starting from the given configs (or the defaults). Raises TypeError naming the known
    options for an unknown name. Returns ``(LoadConfig, CacheOptions, EngineConfig)``."""
    bases = [load or LoadConfig(), cache or CacheOptions(), engine or EngineConfig()]
    owners = {f.name: i for i, b in enumerate(bases) for f in dataclasses.fields(b)}
    unknown = sorted(set(options) - set(owners))
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(owners)}")
    per_class: list[dict[str, Any]] = [{}, {}, {}]
    for name, value in options.items():
        per_class[owners[name]][name] = value
    return tuple(dataclasses.replace(b, **kw) if kw else b for b, kw in zip(bases, per_class))
