"""Build a ready engine from (LoadConfig, CacheOptions, EngineConfig): one pass down the layers.

``build_engine`` runs these steps in order, each a function of its own:

1. ``resolve_storage``: cache storage dtype and the fp8 scale mode asked for (cheap checks,
   before any weights)
2. ``choose_backend``: attention backend for the device, fp8 hardware support
3. ``device_defaults``: the device's shape policy for the knobs left ``None``
4. load the model (or take an already ``LoadedModel``), weights straight onto their shards
   of the ``tensor_parallel_size`` mesh (``models/sharding.py``)
5. ``cache_layout``: the model family's cache layout (``models.families``) and the settings
   it refuses or turns off (``check_settings``)
6. ``capacity.Sizer``: the memory plan (the step's peak temporaries measured on a GPU) and
   the cache plan: pages and slots, max_model_len and the defaults that fit
7. ``static_scales.static_pool_args``: static fp8 scales (a float, a JSON, the checkpoint,
   calibration) and the K shift of a smoothing ``kv_rotation`` (a JSON or calibration)
8. ``assemble_engine``: cache, runner, scheduler and ``LLMEngine``

Every error a user can cause is a ValueError (FileNotFoundError for paths) raised here, at
construction, naming what would work. The engine never asks which family it runs: the
family's layout and forward say what differs.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np

from jfp8kv import kernels
from jfp8kv.config import (ATTENTION_BACKENDS, CHECK_DTYPES, CacheOptions,
                           EngineConfig, LoadConfig, check_compute_dtype)
from jfp8kv.engine import memory, startup_profile
from jfp8kv.engine.capacity import Sizer
from jfp8kv.engine.compile_cache import ExecutableStore, cache_dir, setup_compile_cache
from jfp8kv.engine.device_policy import device_defaults
from jfp8kv.engine.llm_engine import LLMEngine
from jfp8kv.engine.runner import ModelRunner
from jfp8kv.engine.scheduler import Scheduler
from jfp8kv.engine.static_scales import static_pool_args
from jfp8kv.kvcache import fp8, scale_modes
from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.kvcache.cache_tree import Cache, abstract_cache
from jfp8kv.kvcache.layout import CacheLayout, CachePlan, CacheRequest, choices, refuse
from jfp8kv.models import families, sharding

log = logging.getLogger(__name__)

CPU_PAGE_WIDTH_FLOOR_TOKENS = 256  # reference attention's narrowest decode page table


@dataclasses.dataclass(frozen=True, eq=False)
class BuiltEngine:
    """What ``build_engine`` made: the engine, the loaded model and every resolved setting.
    ``engine_config`` is the resolved copy (device defaults, max_model_len and
    kv_cache_memory filled in); ``cache_plan`` the sized cache, ``memory`` the plan it was
    sized by; ``kv_scales_source`` is None unless scales are static."""

    engine: LLMEngine
    loaded: object  # jfp8kv.models.loaded.LoadedModel
    dtype: str
    backend: str
    engine_config: EngineConfig
    cache_plan: CachePlan
    memory: memory.MemoryPlan
    kv_scales_source: str | None
    tp: sharding.TensorParallel | None = None

    @property
    def bytes_per_token(self) -> int | float:
        bpt = self.cache_plan.layout.bytes_per_token(self.cache_plan.page_size)
        return int(bpt) if bpt.denominator == 1 else float(bpt)


def resolve_storage(cache: CacheOptions, dtype: str) -> tuple[str, str | None]:
    """(storage dtype name, the fp8 scale mode asked for or None: the family's layout picks
    its default). fp8-only options given for another storage dtype are ignored with a
    warning."""
    check_compute_dtype(dtype)
    storage = fp8.storage_dtype_name(cache.kv_cache_dtype, dtype)
    if fp8.is_fp8(storage):
        return storage, cache.kv_scale_mode
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


def cache_layout(model_cfg, cache: CacheOptions, storage: str, mode: str | None, backend: str,
                 tp: sharding.TensorParallel | None, bitcast_pool: bool) -> CacheLayout:
    """The family's cache layout for these settings (ValueError naming what works).
    ``bitcast_pool``: integer page arrays (``CacheConfig.bitcast_pool``; same bytes)."""
    req = CacheRequest(storage, mode, cache.kv_rotation if fp8.is_fp8(storage) else "none",
                       kernels.attention_compute(storage, cache.fp8_attention_compute),
                       bitcast_pool, tp.size if tp else 1, tp.cache_kv_heads if tp else None)
    return families.of(model_cfg).cache_layout(model_cfg, req, backend)


def check_settings(layout: CacheLayout, cache: CacheOptions, engine: EngineConfig
                   ) -> EngineConfig:
    """``engine`` with what the layout cannot do turned off (prefix caching, with a
    warning: it is on by default, so an explicit request cannot be told from the default);
    ValueError for settings it refuses."""
    ok = layout.supports
    if engine.tensor_parallel_size > 1 and not ok.tensor_parallel:
        raise refuse(layout.family, "tensor_parallel_size", engine.tensor_parallel_size,
                     "use 1 (its heads and pools are not sharded yet)")
    mode = layout.scale_mode
    if (mode is not None and scale_modes.get(mode, layout.storage_dtype).is_static
            and not ok.static_calibration and not isinstance(cache.kv_scales, (int, float))):
        dynamic = [m for m in ok.scale_modes if not scale_modes.get(m).is_static]
        raise refuse(layout.family, "kv_scale_mode", mode,
                     "it needs static scales, and start-up calibration runs only for dense "
                     f"models: pass a float kv_scales, or use {choices(dynamic)}")
    if engine.enable_prefix_caching and not ok.prefix_caching:
        log.warning("prefix caching is off for %s: %s", layout.family, ok.why_no_prefix_caching)
        engine = dataclasses.replace(engine, enable_prefix_caching=False)
    elif engine.enable_prefix_caching and layout.slots and engine.state_snapshot_memory == 0:
        log.warning("prefix caching is off for %s: a cached prefix needs the state after it, "
                    "and state_snapshot_memory=0 keeps no state snapshot", layout.family)
        engine = dataclasses.replace(engine, enable_prefix_caching=False)
    return engine


def check_snapshots(plan: CachePlan, engine: EngineConfig) -> EngineConfig:
    """``engine`` with prefix caching off (and a warning) where the layout has slot pools and
    the plan holds no state snapshot (the pools too small for one)."""
    if plan.layout.slots and engine.enable_prefix_caching and not plan.num_snapshots:
        log.warning("prefix caching is off for %s: the pools hold no state snapshot (%d bytes "
                    "each); raise --state-snapshot-memory or --kv-cache-memory",
                    plan.layout.family, plan.layout.bytes_per_slot())
        engine = dataclasses.replace(engine, enable_prefix_caching=False)
    return engine


def make_runner(loaded, cache, engine_cfg: EngineConfig, backend: str, on_gpu: bool,
                tp=None) -> ModelRunner:
    """The runner of ``cache`` (a ``Cache``, or its ``abstract_cache`` to compile before the
    pools exist) under the resolved ``engine_cfg``."""
    page_size = cache.plan.page_size
    max_pages = math.ceil(engine_cfg.max_model_len / page_size)
    widths = None  # the Pallas decode kernel splits each row's own length: one width
    if backend == "reference":
        widths = (max(1, CPU_PAGE_WIDTH_FLOOR_TOKENS // page_size), max_pages)
    family = families.of(loaded.config)
    runner = ModelRunner(loaded.config, loaded.params, cache, backend, max_pages,
                       decode_buckets=engine_cfg.decode_buckets,
                       min_chunk=engine_cfg.min_prefill_chunk, page_widths=widths,
                       prefill_one_row=not on_gpu or family.one_row_prefill,
                       chunk_factor=2 if on_gpu else 4,
                       max_chunk=engine_cfg.max_num_batched_tokens, tp=tp,
                       decode_gemm_autotune=engine_cfg.decode_gemm_autotune,
                       feature_executables=engine_cfg.feature_executables)
    # what sizing compiles for the plan is dispatched too: kept for the next start
    runner.store = ExecutableStore.default(engine_cfg.compile_cache)
    return runner


def assemble_engine(loaded, plan: CachePlan, engine_cfg: EngineConfig, runner: ModelRunner,
                    pool_args: dict, namespace: tuple, memory_plan: dict | None = None,
                    shardings: dict | None = None) -> LLMEngine:
    """Allocate the pools of ``plan`` (``pool_args``: their static scales; ``shardings``:
    where each pool lives under tensor parallelism), hand them to ``runner`` (built over the
    plan's shapes, its largest executables compiled before anything was allocated), and
    make the scheduler and engine. ``namespace``: what besides the tokens decides a cached
    page's numbers (prefix caching reuses pages only within one)."""
    runner.cache = Cache.init(plan, pool_args, shardings)
    scheduler = Scheduler.from_config(PageAllocator(plan.num_pages), engine_cfg, namespace,
                                      plan.sequence_slots,
                                      (plan.first_snapshot, plan.num_snapshots))
    eos = set(loaded.config.eos_token_ids)
    if getattr(loaded.tokenizer, "eos_token_id", None) is not None:
        eos.add(loaded.tokenizer.eos_token_id)
    return LLMEngine(runner, scheduler, loaded.tokenizer, model_name=loaded.name,
                     max_model_len=engine_cfg.max_model_len, eos_token_ids=tuple(eos),
                     seed=engine_cfg.seed, max_queue_len=engine_cfg.max_queue_len,
                     overlap_scheduling=engine_cfg.overlap_scheduling,
                     memory_plan=memory_plan)


def _namespace(loaded, layout: CacheLayout, pool_args: dict) -> tuple:
    """Pages are reused only under the settings that produced their numbers."""
    kv = pool_args.get("kv", {})
    digest = [None if kv.get(n) is None else hash(np.asarray(kv[n]).tobytes())
              for n in ("k_scale", "v_scale", "k_shift")]
    return (loaded.name, layout.storage_dtype, layout.scale_mode, *digest[:2],
            layout.kv_rotation, digest[2])


def size_cache(loaded, layout: CacheLayout, engine: EngineConfig, asked: EngineConfig, device,
               backend: str, tp):
    """(sizing, runner or None): ``capacity.Sizer`` with this engine's runner factory, the
    measured-peak memo beside the compilation cache and the pools' shardings."""
    on_gpu = device.platform == "gpu"
    dm = memory.device_memory(device, engine.gpu_memory_utilization,
                              memory.params_bytes(loaded.params))
    memo_dir = cache_dir().parent / "memory-plans" if engine.compile_cache else None

    shardings = pool_shardings(layout, tp)

    def new_runner(plan, eng):
        return make_runner(loaded, abstract_cache(plan, shardings=shardings), eng, backend,
                           on_gpu, tp)

    key = (backend, engine.feature_executables, engine.decode_gemm_autotune,
           tp.size if tp else 1)
    sizer = Sizer(loaded.config, layout, engine, asked, dm, new_runner, memory.PeakMemo(memo_dir),
                  shardings, key, families.of(loaded.config).default_max_model_len)
    with startup_profile.phase("sizing"):
        return sizer.size()


def pool_shardings(layout: CacheLayout, tp) -> dict | None:
    """Where each pool of ``layout`` lives on ``tp``'s mesh (None on one device)."""
    return None if tp is None else tp.cache_shardings(layout)


def build_engine(load: LoadConfig, cache: CacheOptions, engine: EngineConfig, *,
                 device=None, loaded=None) -> BuiltEngine:
    """Validate, pick device and backend, load, lay out and size the cache (measuring the
    step on a GPU), resolve scales, assemble. ``loaded`` (a LoadedModel) skips loading
    ``load.model``; ``device`` defaults to JAX's first device. Logs the memory plan and one
    KV-cache summary line."""
    storage, mode = resolve_storage(cache, load.dtype)
    startup_profile.reset()  # the profile is this engine's start-up, not the process's
    setup_compile_cache(engine.compile_cache)
    memory.claim_device_memory(engine.gpu_memory_utilization)
    device = device or jax.devices()[0]
    backend = choose_backend(engine.attention_backend, device, storage, load.dtype)
    asked, engine = engine, device_defaults(engine, device)
    sharding.check_device_count(engine.tensor_parallel_size)
    if loaded is None:
        from jfp8kv.models.loader import load_model

        loaded = load_model(load.model, load.dtype, engine.tensor_parallel_size)
    loaded, tp = place_model(loaded, engine.tensor_parallel_size)
    # XLA on CPU rewrites a whole bf16/fp8 pool per scatter, an integer one in place.
    layout = cache_layout(loaded.config, cache, storage, mode, backend, tp,
                          bitcast_pool=device.platform == "cpu" and backend == "reference")
    engine = check_settings(layout, cache, engine)
    engine = dataclasses.replace(engine, page_size=layout.page_size(engine.page_size))
    if engine.page_size != asked.page_size:
        log.info("page_size %d -> %d for %s: a page must hold whole compressed windows",
                 asked.page_size, engine.page_size, loaded.name)
    sizing, runner = size_cache(loaded, layout, engine, asked, device, backend, tp)
    engine = dataclasses.replace(sizing.engine, max_queue_len=sizing.engine.max_queue_len
                                 or sizing.engine.max_num_seqs)
    engine = check_snapshots(sizing.plan, engine)
    pool_args, source = static_pool_args(loaded, layout, engine.page_size, cache.kv_scales, tp)
    shardings = pool_shardings(layout, tp)
    if runner is None:
        runner = make_runner(loaded, abstract_cache(sizing.plan, pool_args, shardings), engine,
                             backend, device.platform == "gpu", tp)
    built = BuiltEngine(assemble_engine(loaded, sizing.plan, engine, runner, pool_args,
                                        _namespace(loaded, layout, pool_args),
                                        sizing.memory.info(), shardings),
                        loaded, load.dtype, backend, engine, sizing.plan, sizing.memory,
                        source, tp)
    log.info(sizing.memory.line(sizing.plan.max_tokens, sizing.plan.sequence_slots))
    log.info(cache_summary(cache_info(built)))
    return built


def place_model(loaded, size: int):
    """(loaded, layout): the layout of ``size`` devices (None for one) and ``loaded`` with its
    params on it. Params the loader placed stay where they are; an already loaded model
    (``LLM(loaded=...)``) is moved onto the mesh."""
    tp = sharding.plan(loaded.config, size)
    if tp is None:
        if loaded.tensor_parallel_size > 1:
            raise ValueError(f"{loaded.name} was loaded for tensor_parallel_size="
                             f"{loaded.tensor_parallel_size}; load it again with "
                             "tensor_parallel_size=1 to run it on one device")
        return loaded, None
    params = tp.place_params(loaded.params, loaded.tensor_parallel_size)
    return dataclasses.replace(loaded, params=params, tensor_parallel_size=size), tp


def cache_info(built: BuiltEngine) -> dict:
    """The cache's resolved settings and sizes (``LLM.cache_info``): every pool the same
    way (``pools``: kind, bytes, bytes per page or slot), the memory plan, and under tensor
    parallelism the per-device figures."""
    plan = built.cache_plan
    layout = plan.layout
    return dict(kv_cache_dtype=fp8.user_dtype_name(layout.storage_dtype),
                storage_dtype=layout.storage_dtype, kv_scale_mode=layout.scale_mode,
                kv_layout=layout.kind, model_family=families.of(built.loaded.config).name,
                kv_rotation=layout.kv_rotation, page_size=plan.page_size,
                num_pages=plan.num_pages - 1, max_tokens=plan.max_tokens,
                state_slots=plan.sequence_slots, bytes_per_token=built.bytes_per_token,
                kv_cache_memory=built.engine_config.kv_cache_memory,
                pool_bytes=built.engine.runner.cache.nbytes(per_device=True),
                pools=plan.info(),
                memory_plan=built.memory.info(), compute_dtype=built.dtype,
                attention_backend=built.backend,
                max_model_len=built.engine_config.max_model_len,
                max_num_seqs=built.engine_config.max_num_seqs,
                max_num_batched_tokens=built.engine_config.max_num_batched_tokens,
                enable_prefix_caching=built.engine_config.enable_prefix_caching,
                prefix_cache=dataclasses.asdict(
                    built.engine.scheduler.prefix_cache_stats()),
                snapshot_slots=plan.num_snapshots, snapshot_bytes=plan.snapshot_bytes(),
                snapshots=dataclasses.asdict(built.engine.scheduler.snapshot_stats()),
                **tensor_parallel_info(built))


def tensor_parallel_info(built: BuiltEngine) -> dict:
    """Mesh size and the per-device cache layout. ``bytes_per_token``, ``kv_cache_memory``,
    ``pool_bytes`` and every pool's ``bytes`` are per device (each pool's ``split``: whether
    the devices hold shares of it, or each a whole copy); ``kv_replication_bytes_per_token``
    is what the devices hold beyond one copy of each token's rows, over all of them together
    (replicated KV heads, replicated pools; 0 when everything is split);
    ``kv_heads_per_device``: the first paged pool's heads on one device."""
    tp, plan = built.tp, built.cache_plan
    heads = plan.layout.paged[0].info().get("heads_per_device", 1)
    replicated = 0
    if tp is not None:
        one = cache_layout(built.loaded.config, CacheOptions(), plan.layout.storage_dtype,
                           plan.layout.scale_mode, built.backend, None, False)
        replicated = (tp.size * plan.layout.bytes_per_token(plan.page_size)
                      - one.bytes_per_token(plan.page_size))
        replicated = int(replicated) if replicated.denominator == 1 else float(replicated)
    return dict(tensor_parallel_size=tp.size if tp else 1, kv_heads_per_device=heads,
                kv_head_replication=tp.kv_repeat if tp else 1,
                kv_replication_bytes_per_token=replicated)


def cache_summary(info: dict) -> str:
    """One log line from ``cache_info``: KV cache dtype, pages, slots, tokens, backend."""
    mode = f" ({info['kv_scale_mode']} scales)" if info.get("kv_scale_mode") else ""
    slots = f", {info['state_slots']} state slots" if info.get("state_slots") else ""
    return (f"KV cache: dtype {info['storage_dtype']}{mode}, {info['num_pages']} pages x "
            f"{info['page_size']} tokens = {info['max_tokens']} tokens{slots}, "
            f"{info['bytes_per_token']} bytes/token, max_model_len {info['max_model_len']}, "
            f"backend {info['attention_backend']}")
