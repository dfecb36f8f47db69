"""Build a ready engine from (LoadConfig, CacheOptions, EngineConfig): one pass down the layers.

``build_engine`` runs these steps in order, each a function of its own:

1. ``resolve_storage``: cache storage dtype and scale mode (cheap checks, before any weights)
2. ``choose_backend``: attention backend for the device, fp8 hardware support
3. ``device_defaults``: the device's shape policy for the knobs left ``None``
4. load the model (or take an already ``LoadedModel``), weights straight onto their shards
   of the ``tensor_parallel_size`` mesh (``models/sharding.py``)
5. ``plan_capacity``: max_model_len, memory budget and page count -> ``CacheConfig`` (per
   device under tensor parallelism)
6. ``resolve_static_scales``: static fp8 scales (a float, a JSON, the checkpoint, calibration)
   and the K shift of a smoothing ``kv_rotation`` (a JSON or calibration)
7. ``assemble_engine``: cache, runner, scheduler and ``LLMEngine``

Every error a user can cause is a ValueError (FileNotFoundError for paths) raised here, at
construction, naming what would work.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np

from jfp8kv.config import (ATTENTION_BACKENDS, CHECK_DTYPES, CacheConfig, CacheOptions,
                           EngineConfig, LoadConfig, check_compute_dtype)
from jfp8kv import kernels
from jfp8kv.engine.llm_engine import LLMEngine
from jfp8kv.engine import hybrid_cache, v4_engine
from jfp8kv.engine.compile_cache import setup_compile_cache
from jfp8kv.engine.device_policy import cache_memory, device_defaults
from jfp8kv.engine.runner import ModelRunner
from jfp8kv.engine.scheduler import Scheduler
from jfp8kv.kvcache import calibrate, fp8, k_transform
from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.kvcache import latent, scale_modes
from jfp8kv.kvcache.cache import KVCache, bytes_per_token, plan_num_pages
from jfp8kv.models import sharding

log = logging.getLogger(__name__)

# Chosen from bench/results/quality-cpu.json (docs/results-history.md, "Why token...").
DEFAULT_FP8_SCALE_MODE = "token"
CPU_PAGE_WIDTH_FLOOR_TOKENS = 256  # reference attention's narrowest decode page table


@dataclasses.dataclass(frozen=True, eq=False)
class BuiltEngine:
    """What ``build_engine`` made: the engine, the loaded model and every resolved setting.
    ``engine_config`` is the resolved copy (device defaults, max_model_len and
    kv_cache_memory filled in); ``kv_scales_source`` is None unless scales are static."""

    engine: LLMEngine
    loaded: object  # jfp8kv.models.loader.LoadedModel
    dtype: str
    backend: str
    engine_config: EngineConfig
    cache_config: CacheConfig
    bytes_per_token: int
    kv_scales_source: str | None
    tp: sharding.TensorParallel | None = None


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    cache_config: CacheConfig
    max_model_len: int
    kv_cache_memory: int
    bytes_per_token: int


def resolve_storage(cache: CacheOptions, dtype: str) -> tuple[str, str | None]:
    """(storage dtype name, fp8 scale mode or None). fp8-only options given for another
    storage dtype are ignored with a warning."""
    check_compute_dtype(dtype)
    storage = fp8.storage_dtype_name(cache.kv_cache_dtype, dtype)
    if fp8.is_fp8(storage):
        return storage, cache.kv_scale_mode or DEFAULT_FP8_SCALE_MODE
    ignored = [f"{name}={value!r}" for name, value in
               (("kv_scale_mode", cache.kv_scale_mode), ("kv_scales", cache.kv_scales),
                ("kv_rotation", None if cache.kv_rotation == "none" else cache.kv_rotation))
               if value is not None]
    if ignored:
        log.warning("%s: fp8-only option(s) ignored because kv_cache_dtype=%r stores %s; pass "
                    "kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2' to use them",
                    ", ".join(ignored), cache.kv_cache_dtype, storage)
    return storage, None


def check_fp8_support(device, storage_dtype: str, backend: str | None = None) -> None:
    """fp8 KV on a GPU needs compute capability >= 8.9 (Ada, Hopper, Blackwell)."""
    if not fp8.is_fp8(storage_dtype) or device.platform != "gpu":
        return
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = (int(x) for x in str(cc).split("."))
    except (TypeError, ValueError):
        return
    if (major, minor) < (8, 9):
        raise ValueError(
            f"fp8 KV cache needs an NVIDIA GPU of compute capability >= 8.9 (Ada/Hopper), "
            f"but {device.device_kind} has {cc}; use kv_cache_dtype='auto' or 'bfloat16'")


def resolve_backend(requested: str, device) -> str:
    """'auto' -> 'pallas' on an NVIDIA GPU, 'reference' elsewhere; 'pallas' needs a GPU."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {requested!r}; choose one of "
                         f"{list(ATTENTION_BACKENDS)}")
    on_gpu = device.platform == "gpu"
    if requested.startswith("pallas") and not on_gpu:
        raise ValueError(f"attention_backend={requested!r} needs an NVIDIA GPU (Pallas "
                         "kernels); use 'reference' or 'auto' on this device "
                         f"({device.platform})")
    if requested == "auto":
        return "pallas" if on_gpu else "reference"
    return requested


def choose_backend(requested: str, device, storage: str, dtype: str) -> str:
    check_fp8_support(device, storage)
    backend = resolve_backend(requested, device)
    if dtype in CHECK_DTYPES and backend != "reference":
        raise ValueError(f"dtype={dtype!r} runs only with attention_backend='reference'")
    return backend


def plan_capacity(model_cfg, engine: EngineConfig, storage: str, mode: str | None,
                  device, tp: sharding.TensorParallel | None = None,
                  bitcast_pool: bool = False, kv_rotation: str = "none") -> CapacityPlan:
    """Pages that fit the memory budget; raises when one max_model_len sequence does not.
    Under tensor parallelism the budget and ``bytes_per_token`` are per device (one
    device's KV heads); the ``CacheConfig`` describes the global pool (all heads).
    ``bitcast_pool``: integer page arrays (``CacheConfig.bitcast_pool``; same bytes)."""
    if model_cfg.v4 is not None:  # DeepSeek-V4's own pools (engine/v4_engine.py)
        return v4_engine.plan_capacity(model_cfg, engine, storage, device)
    if model_cfg.hybrid is not None:  # DeltaNet state slots beside the pages
        return hybrid_cache.plan_capacity(model_cfg, engine, storage, mode, device, tp,
                                          bitcast_pool, kv_rotation)
    layout = "latent" if model_cfg.is_mla else "kv"
    if model_cfg.is_mla:
        latent.check_latent_mode(model_cfg, storage, mode)
        if kv_rotation != "none":
            raise ValueError(f"kv_rotation={kv_rotation!r} applies to K heads; the MLA latent "
                             f"cache of {model_cfg.family} takes only 'none'")
        shape = latent.cache_shape(model_cfg)
    else:
        scale_modes.get(mode, storage).validate(model_cfg.head_dim)
        k_transform.validate(kv_rotation, model_cfg.head_dim)
        if tp is not None and k_transform.smooths(kv_rotation):
            raise ValueError(f"kv_rotation={kv_rotation!r} is not supported with tensor "
                             "parallelism yet; use 'none' or 'hadamard'")
        shape = dict(num_layers=model_cfg.num_layers,
                     num_kv_heads=tp.kv_heads_per_device if tp else model_cfg.num_kv_heads,
                     head_dim=model_cfg.head_dim)
    max_model_len = engine.max_model_len or model_cfg.max_position_embeddings
    bpt = bytes_per_token(*shape.values(), storage, mode, layout=layout)
    memory = cache_memory(device, engine.kv_cache_memory, bpt, max_model_len, engine.max_num_seqs)
    usable = plan_num_pages(memory, **shape, page_size=engine.page_size,
                            storage_dtype=storage, scale_mode=mode, layout=layout)
    if usable * engine.page_size < max_model_len:
        need = math.ceil(max_model_len / engine.page_size) * engine.page_size * bpt
        raise ValueError(
            f"kv_cache_memory={memory} bytes holds {usable * engine.page_size} tokens "
            f"({bpt} bytes/token), fewer than one sequence of max_model_len={max_model_len}; "
            f"give at least {need} bytes or lower max_model_len")
    if tp is not None:
        shape["num_kv_heads"] = tp.cache_kv_heads
    ccfg = CacheConfig(*shape.values(), usable + 1, engine.page_size, storage, mode,
                       bitcast_pool=bitcast_pool, layout=layout, kv_rotation=kv_rotation)
    return CapacityPlan(ccfg, max_model_len, memory, bpt)


def resolve_static_scales(loaded, ccfg: CacheConfig, kv_scales, tp=None):
    """(k_scale, v_scale, k_shift, source): static scales for static scale modes and the K
    shift of a smoothing ``ccfg.kv_rotation``, None where not needed. ``kv_scales``: a float
    for every layer, a scales JSON path, or None (the checkpoint's k_scale/v_scale, else
    calibration on the built-in text, run on ``tp``'s mesh). Scales and shift are [layers,
    model KV heads, head_dim]; ``ccfg``'s own head count is not read. Checkpoint scales
    describe unrotated K: with a K transform they are not used (calibration instead)."""
    static = scale_modes.of(ccfg).is_static
    smooth = k_transform.smooths(ccfg.kv_rotation)
    if not static and not smooth:
        if kv_scales is not None and ccfg.is_fp8:
            log.warning("kv_scales is ignored: kv_scale_mode=%s computes scales at store "
                        "time", ccfg.scale_mode)
        return None, None, None, None
    shape = (ccfg.num_layers, loaded.config.num_kv_heads, ccfg.head_dim)
    if not static and isinstance(kv_scales, (int, float)):
        log.warning("kv_scales=%s is ignored: kv_scale_mode=%s computes scales at store time",
                    kv_scales, ccfg.scale_mode)
        kv_scales = None
    if isinstance(kv_scales, (int, float)):
        if kv_scales == 1.0:
            fp8.warn_unit_scale()
        s = np.full(shape, kv_scales, np.float32)
        shift = _measured_shift(loaded, ccfg, None, tp) if smooth else None
        return s, s, shift, f"constant {kv_scales}"
    if not static:  # a dynamic mode that smooths: the K mean is all it needs
        return None, None, _measured_shift(loaded, ccfg, kv_scales, tp), None
    if kv_scales is None and ccfg.kv_rotation == "none" and (
            loaded.kv_scales is not None):
        k, v = (np.broadcast_to(np.asarray(loaded.kv_scales[n], np.float32)[:, None, None],
                                shape) for n in ("k", "v"))
        log.info("fp8 KV: using the checkpoint's k_scale/v_scale tensors")
        return k, v, None, "checkpoint k_scale/v_scale"
    amax = _measured(loaded, ccfg, kv_scales, tp)
    k, v = amax.scales(ccfg.storage_dtype, ccfg.scale_mode)
    return k, v, amax.k_mean if smooth else None, amax.source


def _measured(loaded, ccfg: CacheConfig, path: str | None, tp) -> calibrate.KVAmax:
    """The K/V amax (and K mean) in ``ccfg.kv_rotation``'s basis: from a scales JSON, else
    calibration on the built-in text."""
    rot = ccfg.kv_rotation
    if path is not None:
        amax = calibrate.KVAmax.from_json(path, calibrate.fingerprint(loaded.config))
        if amax.kv_rotation != rot:
            raise ValueError(
                f"{path} was measured with kv_rotation={amax.kv_rotation!r}, this cache "
                f"stores K with kv_rotation={rot!r}; run `python -m jfp8kv.calibrate --model "
                f"<this model> --kv-rotation {rot} --out scales.json`")
        return amax
    from jfp8kv.engine.calibrate import calibrate_on_text

    _warn_builtin_calibration(rot)
    return calibrate_on_text(loaded, [calibrate.BUILTIN_TEXT], page_size=ccfg.page_size,
                             tp=tp, kv_rotation=rot)


def _measured_shift(loaded, ccfg: CacheConfig, path: str | None, tp) -> np.ndarray:
    """A smoothing ``ccfg.kv_rotation``'s K mean: from a scales JSON, else one calibration
    pass over the built-in text (no amax pass: nothing static is scaled by it)."""
    if path is not None:
        return _measured(loaded, ccfg, path, tp).k_mean
    from jfp8kv.engine.calibrate import measure_k_mean

    _warn_builtin_calibration(ccfg.kv_rotation)
    return measure_k_mean(loaded.config, loaded.params,
                          [loaded.tokenizer.encode(calibrate.BUILTIN_TEXT)],
                          page_size=ccfg.page_size, tp=tp)


def _warn_builtin_calibration(rot: str) -> None:
    why = ("K transform kv_rotation=%s (checkpoint k_scale/v_scale describe unrotated K)"
           % rot if rot != "none" else "static scales")
    log.warning("fp8 KV with %s and no kv_scales file: calibrating at start-up on the "
                "built-in text (pass a scales JSON from `python -m jfp8kv.calibrate` for "
                "numbers measured on your own data)", why)


def assemble_engine(loaded, plan: CapacityPlan, engine_cfg: EngineConfig, backend: str,
                    on_gpu: bool, k_scale, v_scale,
                    tp: sharding.TensorParallel | None = None, k_shift=None) -> LLMEngine:
    """Cache, runner, scheduler and engine for a resolved configuration. Static scales are
    [layers, model KV heads, head_dim]; under ``tp`` the pool is allocated on its shards."""
    ccfg = plan.cache_config
    if v4_engine.init_cache(ccfg) is not None:
        cache = v4_engine.init_cache(ccfg)
    elif tp is None:
        cache = KVCache.init(ccfg, k_scale, v_scale, k_shift)
    else:
        cache = tp.init_cache(ccfg, *(None if s is None else tp.expand_kv_heads(s)
                                      for s in (k_scale, v_scale)))
    cache = hybrid_cache.with_state(loaded.config, cache, engine_cfg)
    max_pages = math.ceil(plan.max_model_len / ccfg.page_size)
    widths = None  # the Pallas decode kernel splits each row's own length: one width
    if backend == "reference":
        widths = (max(1, CPU_PAGE_WIDTH_FLOOR_TOKENS // ccfg.page_size), max_pages)
    runner = ModelRunner(loaded.config, loaded.params, cache, backend, max_pages,
                         decode_buckets=engine_cfg.decode_buckets,
                         min_chunk=engine_cfg.min_prefill_chunk, page_widths=widths,
                         # V4: one row per prefill dispatch bounds its jnp attention's logits
                         prefill_one_row=not on_gpu or loaded.config.v4 is not None,
                         chunk_factor=2 if on_gpu else 4,
                         max_chunk=engine_cfg.max_num_batched_tokens, tp=tp,
                         decode_gemm_autotune=engine_cfg.decode_gemm_autotune,
                         feature_executables=engine_cfg.feature_executables)
    # Pages are reused only under the settings that produced their numbers.
    namespace = (loaded.name, ccfg.storage_dtype, ccfg.scale_mode,
                 None if k_scale is None else hash(np.asarray(k_scale).tobytes()),
                 None if v_scale is None else hash(np.asarray(v_scale).tobytes()),
                 ccfg.kv_rotation,
                 None if k_shift is None else hash(np.asarray(k_shift).tobytes()))
    scheduler = Scheduler.from_config(PageAllocator(ccfg.num_pages), engine_cfg, namespace,
                                      hybrid_cache.sequence_slots(loaded.config, engine_cfg)
                                      or v4_engine.sequence_slots(loaded.config, engine_cfg))
    eos = set(loaded.config.eos_token_ids)
    if getattr(loaded.tokenizer, "eos_token_id", None) is not None:
        eos.add(loaded.tokenizer.eos_token_id)
    return LLMEngine(runner, scheduler, loaded.tokenizer, model_name=loaded.name,
                     max_model_len=plan.max_model_len, eos_token_ids=tuple(eos),
                     seed=engine_cfg.seed, max_queue_len=engine_cfg.max_queue_len,
                     overlap_scheduling=engine_cfg.overlap_scheduling)


def build_engine(load: LoadConfig, cache: CacheOptions, engine: EngineConfig, *,
                 device=None, loaded=None) -> BuiltEngine:
    """Validate, pick device and backend, load, plan capacity, resolve scales, assemble.
    ``loaded`` (a LoadedModel) skips loading ``load.model``; ``device`` defaults to JAX's
    first device. Logs one KV-cache summary line."""
    storage, mode = resolve_storage(cache, load.dtype)
    setup_compile_cache(engine.compile_cache)
    device = device or jax.devices()[0]
    backend = choose_backend(engine.attention_backend, device, storage, load.dtype)
    engine = device_defaults(engine, device)
    sharding.check_device_count(engine.tensor_parallel_size)
    if loaded is None:
        from jfp8kv.models.loader import load_model

        loaded = load_model(load.model, load.dtype, engine.tensor_parallel_size)
    loaded, tp = place_model(loaded, engine.tensor_parallel_size)
    engine = hybrid_cache.check_engine(loaded.config, engine, cache, mode)
    engine = v4_engine.check_engine(loaded.config, engine, cache)
    if loaded.config.is_mla and fp8.is_fp8(storage) and cache.kv_scale_mode is None:
        mode = latent.DEFAULT_LATENT_SCALE_MODE  # the default for latents
    # XLA on CPU rewrites a whole bf16/fp8 pool per scatter, an integer one in place.
    plan = plan_capacity(loaded.config, engine, storage, mode, device, tp,
                         bitcast_pool=device.platform == "cpu" and backend == "reference",
                         kv_rotation=cache.kv_rotation if fp8.is_fp8(storage) else "none")
    if loaded.config.v4 is None:  # V4 pools: block scales, their own kernels
        plan = kernels.with_attention_compute(plan, cache.fp8_attention_compute)
    engine = dataclasses.replace(engine, max_model_len=plan.max_model_len,
                                 kv_cache_memory=plan.kv_cache_memory)
    if loaded.config.is_mla:
        kernels.check_latent_cache(plan.cache_config, loaded.config.kv_lora_rank, backend)
    k_scale, v_scale, k_shift, source = resolve_static_scales(loaded, plan.cache_config,
                                                              cache.kv_scales, tp)
    built = BuiltEngine(assemble_engine(loaded, plan, engine, backend,
                                        device.platform == "gpu", k_scale, v_scale, tp,
                                        k_shift),
                        loaded, load.dtype, backend, engine, plan.cache_config,
                        plan.bytes_per_token, source, tp)
    log.info(cache_summary(cache_info(built)))
    return built


def place_model(loaded, size: int):
    """(loaded, layout): the layout of ``size`` devices (None for one) and ``loaded`` with its
    params on it. Params the loader placed stay where they are; an already loaded model
    (``LLM(loaded=...)``) is moved onto the mesh."""
    tp = sharding.plan(loaded.config, size)
    if tp is None:
        return loaded, None
    return dataclasses.replace(loaded, params=tp.place_params(loaded.params)), tp


def cache_info(built: BuiltEngine) -> dict:
    """The KV cache's resolved settings and sizes (``LLM.cache_info``)."""
    c = built.cache_config
    tp_size = built.tp.size if built.tp else 1
    return dict(kv_cache_dtype=fp8.user_dtype_name(c.storage_dtype),
                storage_dtype=c.storage_dtype, kv_scale_mode=c.scale_mode, kv_layout=c.layout,
                kv_rotation=c.kv_rotation,
                page_size=c.page_size, num_pages=c.num_pages - 1,
                max_tokens=c.max_tokens, bytes_per_token=built.bytes_per_token,
                kv_cache_memory=built.engine_config.kv_cache_memory,
                pool_bytes=built.engine.runner.cache.nbytes() // tp_size,
                compute_dtype=built.dtype, attention_backend=built.backend,
                max_model_len=built.engine_config.max_model_len,
                enable_prefix_caching=built.engine_config.enable_prefix_caching,
                prefix_cache=dataclasses.asdict(
                    built.engine.scheduler.prefix_cache_stats()),
                **tensor_parallel_info(built), **hybrid_cache.state_info(built),
                **v4_engine.pool_info(built))


def tensor_parallel_info(built: BuiltEngine) -> dict:
    """Mesh size and the per-device KV layout. ``bytes_per_token``, ``kv_cache_memory`` and
    ``pool_bytes`` are per device; ``kv_replication_bytes_per_token`` is what replicated KV
    heads add over all devices together (0 when the mesh size divides the KV heads)."""
    c, tp = built.cache_config, built.tp
    model_heads = 1 if c.layout == "latent" else built.loaded.config.num_kv_heads
    replicated = 0
    if tp is not None:
        unsharded = bytes_per_token(c.num_layers, model_heads, c.head_dim, c.storage_dtype,
                                    c.scale_mode)
        replicated = tp.size * built.bytes_per_token - unsharded
    return dict(tensor_parallel_size=tp.size if tp else 1,
                kv_heads_per_device=tp.kv_heads_per_device if tp else model_heads,
                kv_head_replication=tp.kv_repeat if tp else 1,
                kv_replication_bytes_per_token=replicated)


def cache_summary(info: dict) -> str:
    """One log line from ``cache_info``: KV cache dtype, pages, tokens, backend."""
    mode = f" ({info['kv_scale_mode']} scales)" if info.get("kv_scale_mode") else ""
    return (f"KV cache: dtype {info['storage_dtype']}{mode}, {info['num_pages']} pages x "
            f"{info['page_size']} tokens = {info['max_tokens']} tokens, "
            f"{info['bytes_per_token']} bytes/token, max_model_len {info['max_model_len']}, "
            f"backend {info['attention_backend']}")
