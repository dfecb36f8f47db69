"""Offline API for JAX users: ``jfp8kv.LLM`` and ``jfp8kv.generate``."""

from __future__ import annotations

import itertools
import logging
import math
from typing import Iterator, Sequence

import jax
import numpy as np

from jfp8kv.config import (ATTENTION_BACKENDS, CHECK_DTYPES, KV_SCALE_MODES, CacheConfig,
                            check_compute_dtype)
from jfp8kv.engine.compile_cache import setup_compile_cache
from jfp8kv.engine.llm_engine import LLMEngine
from jfp8kv.engine.runner import ModelRunner, page_widths_from
from jfp8kv.engine.scheduler import Scheduler
from jfp8kv.engine.types import RequestOutput, SamplingParams
from jfp8kv.kvcache import fp8
from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.kvcache.cache import STAT_FIELDS, KVCache, bytes_per_token, plan_num_pages
from jfp8kv.kvcache import calibrate

log = logging.getLogger(__name__)

# Chosen from bench/results/quality-cpu.json (see README, "Choosing the default scale mode").
DEFAULT_FP8_SCALE_MODE = "token"
CPU_DEFAULT_CACHE_MEMORY = 1 << 30
# GPU shape policy: decode is memory-bound, so coarse batch buckets cost little and save
# compiles; several decode steps per dispatch hide host overhead.
GPU_DECODE_BUCKETS = (8, 32, 64, 128, 256)
GPU_MIN_CHUNK = 128
GPU_DECODE_STEPS = 8
GPU_CACHE_FRACTION = 0.85
# CPU shape policy (reference attention reads every page in its table): decode page tables
# are as wide as the batch needs (256 tokens, then x4), few batch buckets, one-row prefill.
CPU_DECODE_BUCKETS = (1, 4, 16, 64)
CPU_PAGE_WIDTH_FLOOR_TOKENS = 256


def check_fp8_support(device, storage_dtype: str, backend: str) -> None:
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
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {requested!r}; choose one of "
                         f"{list(ATTENTION_BACKENDS)}")
    on_gpu = device.platform == "gpu"
    if requested == "pallas" and not on_gpu:
        raise ValueError("attention_backend='pallas' needs an NVIDIA GPU (Pallas Triton "
                         "kernels); use 'reference' or 'auto' on this device "
                         f"({device.platform})")
    if requested == "auto":
        return "pallas" if on_gpu else "reference"
    return requested


class LLM:
    """A model with a paged KV cache and a continuous-batching engine.

    ``kv_cache_dtype``: "auto" (the compute dtype), "bfloat16", "float16", "float32",
    "fp8_e4m3" (alias "fp8"), "fp8_e5m2". ``kv_scale_mode`` (fp8 only): "tensor",
    "channel", "token" or "block" (default: ``DEFAULT_FP8_SCALE_MODE``). ``kv_scales``
    (static modes): a float for every layer, a scales JSON path, or None (checkpoint
    scales, else calibration at start-up). ``kv_cache_memory`` is in bytes.
    """

    def __init__(self, model: str | None = None, dtype: str = "bfloat16",
                 kv_cache_dtype: str = "auto", max_model_len: int | None = None,
                 kv_cache_memory: int | None = None, page_size: int = 16, seed: int = 0, *,
                 kv_scale_mode: str | None = None, kv_scales=None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_queue_len: int = 1024,
                 attention_backend: str = "auto", decode_steps: int | None = None,
                 device=None, loaded=None, compile_cache: bool = True):
        # Cheap validation first, before any weights are read.
        check_compute_dtype(dtype)
        storage = fp8.storage_dtype_name(kv_cache_dtype, dtype)
        if fp8.is_fp8(storage):
            kv_scale_mode = kv_scale_mode or DEFAULT_FP8_SCALE_MODE
            if kv_scale_mode not in KV_SCALE_MODES:
                raise ValueError(f"unknown kv_scale_mode {kv_scale_mode!r}; choose one of "
                                 f"{list(KV_SCALE_MODES)}")
        else:
            kv_scale_mode = None
        if page_size < 1 or page_size & (page_size - 1) or not 8 <= page_size <= 128:
            raise ValueError(f"page_size must be a power of two in [8, 128], got {page_size}")
        setup_compile_cache(compile_cache)
        device = device or jax.devices()[0]
        check_fp8_support(device, storage, attention_backend)
        self.backend = resolve_backend(attention_backend, device)
        if dtype in CHECK_DTYPES and self.backend != "reference":
            raise ValueError(f"dtype={dtype!r} runs only with attention_backend='reference'")

        if loaded is None:
            from jfp8kv.models.loader import load_model

            loaded = load_model(model, dtype)
        cfg = loaded.config
        self.config = cfg
        self.tokenizer = loaded.tokenizer
        self.dtype = dtype
        if kv_scale_mode == "block" and cfg.head_dim % 32:
            raise ValueError(f"kv_scale_mode='block' needs head_dim divisible by 32 (this model "
                             f"has {cfg.head_dim}); use 'token', 'channel' or 'tensor'")
        max_model_len = max_model_len or cfg.max_position_embeddings
        bpt = bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, storage,
                              kv_scale_mode)
        if kv_cache_memory is None:
            kv_cache_memory = self._default_cache_memory(device, bpt, max_model_len, max_num_seqs)
        usable = plan_num_pages(kv_cache_memory, num_layers=cfg.num_layers,
                                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                page_size=page_size, storage_dtype=storage,
                                scale_mode=kv_scale_mode)
        if usable * page_size < max_model_len:
            need = math.ceil(max_model_len / page_size) * page_size * bpt
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory} bytes holds {usable * page_size} tokens "
                f"({bpt} bytes/token), fewer than one sequence of max_model_len={max_model_len}; "
                f"give at least {need} bytes or lower max_model_len")
        self.cache_config = CacheConfig(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                        usable + 1, page_size, storage, kv_scale_mode)
        self.kv_cache_memory = kv_cache_memory
        self.bytes_per_token = bpt
        k_s, v_s = self._static_scales(loaded, kv_scales)
        cache = KVCache.init(self.cache_config, k_s, v_s)
        max_pages = math.ceil(max_model_len / page_size)
        on_gpu = device.platform == "gpu"
        runner = ModelRunner(cfg, loaded.params, cache, self.backend, max_pages,
                             decode_buckets=GPU_DECODE_BUCKETS if on_gpu else CPU_DECODE_BUCKETS,
                             min_chunk=GPU_MIN_CHUNK if on_gpu else 16,
                             page_widths=None if self.backend != "reference" else page_widths_from(
                                 max(1, CPU_PAGE_WIDTH_FLOOR_TOKENS // page_size), max_pages),
                             prefill_one_row=not on_gpu)
        if decode_steps is None:
            decode_steps = GPU_DECODE_STEPS if on_gpu else 1
        scheduler = Scheduler(PageAllocator(usable + 1), page_size, max_model_len, max_num_seqs,
                              max_num_batched_tokens, decode_steps)
        eos = set(cfg.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.engine = LLMEngine(runner, scheduler, self.tokenizer, model_name=loaded.name,
                                max_model_len=max_model_len, eos_token_ids=tuple(eos),
                                seed=seed, max_queue_len=max_queue_len)
        self.max_model_len = max_model_len
        self._ids = itertools.count()
        log.info("KV cache: %s", self.cache_info())

    def warmup(self, progress: bool = True) -> None:
        """Compile the decode and prefill buckets now (the server does this at start-up)."""
        sched = self.engine.scheduler
        runner = self.engine.runner
        shapes = runner.warmup_shapes(sched.max_num_seqs, sched.max_num_batched_tokens)
        runner.warmup(shapes, sched.decode_steps, progress)

    @staticmethod
    def _default_cache_memory(device, bpt, max_model_len, max_num_seqs) -> int:
        if device.platform == "gpu":
            stats = device.memory_stats() or {}
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            if free > 0:
                return int(free * GPU_CACHE_FRACTION)
        return int(min(CPU_DEFAULT_CACHE_MEMORY, bpt * max_model_len * max(8, max_num_seqs // 4)))

    def _static_scales(self, loaded, kv_scales):
        ccfg = self.cache_config
        if not ccfg.is_fp8 or ccfg.scale_mode not in ("tensor", "channel"):
            if kv_scales is not None:
                log.warning("kv_scales is ignored: kv_scale_mode=%s computes scales at store "
                            "time", ccfg.scale_mode)
            return None, None
        shape = (ccfg.num_layers, ccfg.num_kv_heads, ccfg.head_dim)
        if isinstance(kv_scales, (int, float)):
            if kv_scales <= 0:
                raise ValueError(f"kv_scales must be positive, got {kv_scales}")
            if kv_scales == 1.0:
                fp8.warn_unit_scale()
            s = np.full(shape, kv_scales, np.float32)
            self.kv_scales_source = f"constant {kv_scales}"
            return s, s
        if isinstance(kv_scales, str):
            amax = calibrate.KVAmax.from_json(kv_scales, calibrate.fingerprint(self.config))
        elif kv_scales is None and loaded.kv_scales is not None:
            k = np.broadcast_to(np.asarray(loaded.kv_scales["k"], np.float32)[:, None, None], shape)
            v = np.broadcast_to(np.asarray(loaded.kv_scales["v"], np.float32)[:, None, None], shape)
            self.kv_scales_source = "checkpoint k_scale/v_scale"
            log.info("fp8 KV: using the checkpoint's k_scale/v_scale tensors")
            return k, v
        elif kv_scales is None:
            log.warning("fp8 KV with static scales and no kv_scales: calibrating at start-up on "
                        "the built-in text (pass a scales JSON from `python -m jfp8kv.calibrate` "
                        "for scales measured on your own data)")
            amax = calibrate.calibrate_on_text(loaded, [calibrate.BUILTIN_TEXT],
                                               page_size=ccfg.page_size)
        else:
            raise ValueError(f"kv_scales must be a float, a path to a scales JSON or None, "
                             f"got {type(kv_scales).__name__}")
        self.kv_scales_source = amax.source
        return amax.scales(ccfg.storage_dtype, ccfg.scale_mode)

    # -- generation -------------------------------------------------------------------
    def _submit(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        ids = []
        try:
            for p, sp in zip(prompts, sampling_params):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, p, sp)
                ids.append(rid)
        except Exception:
            for rid in ids:  # all-or-nothing: a bad prompt leaves nothing queued
                self.engine.abort_request(rid, report=False)
            raise
        return ids

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists), batched
        continuously; outputs are in the order of the prompts."""
        ids = self._submit(prompts, sampling_params)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield each request's cumulative output every time it gains tokens."""
        self._submit(prompts, sampling_params)
        while self.engine.has_unfinished():
            yield from self.engine.step()

    def chat_prompt(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)

    def chat(self, messages, sampling_params=None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.chat_prompt(m), add_special_tokens=False)
                   for m in convs]
        return self.generate(prompts, sampling_params)

    # -- scoring and introspection ----------------------------------------------------
    def nll(self, token_ids: Sequence[int], chunk_size: int | None = None,
            return_logits: bool = False):
        """Teacher-forced NLL of each next token: out[i] = -log p(ids[i+1] | ids[:i+1]).

        Runs through the paged cache (same storage format and kernels as generation), in
        chunks of ``chunk_size`` (default: max_num_batched_tokens)."""
        chunks = self.nll_chunks(token_ids, chunk_size)
        nll = np.concatenate([np.asarray(c[:n]) for c, _, n in chunks])
        if not return_logits:
            return nll
        return nll, np.concatenate([np.asarray(lg[:n]) for _, lg, n in chunks])

    def nll_chunks(self, token_ids: Sequence[int], chunk_size: int | None = None):
        """``nll`` without the host copies: a list of (nll [t], logits [t, V], n) device arrays
        per chunk, valid in their first n rows (for scoring on the device)."""
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ValueError("nll needs at least 2 tokens")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed max_model_len={self.max_model_len}")
        if self.engine.has_unfinished():
            raise RuntimeError("nll() needs an idle engine")
        sched = self.engine.scheduler
        chunk_size = chunk_size or sched.max_num_batched_tokens
        pages = sched.allocator.allocate(math.ceil(len(ids) / sched.page_size))
        out = []
        try:
            for s in range(0, len(ids) - 1, chunk_size):
                part = ids[s:min(s + chunk_size, len(ids) - 1)]
                tgt = ids[s + 1:s + 1 + len(part)]
                out.append((*self.engine.runner.nll(part, tgt, s, pages), len(part)))
        finally:
            sched.allocator.free(pages)
        return out

    def cache_info(self) -> dict:
        c = self.cache_config
        return dict(kv_cache_dtype=fp8.user_dtype_name(c.storage_dtype),
                    storage_dtype=c.storage_dtype, kv_scale_mode=c.scale_mode,
                    page_size=c.page_size, num_pages=c.num_pages - 1,
                    max_tokens=c.max_tokens, bytes_per_token=self.bytes_per_token,
                    kv_cache_memory=self.kv_cache_memory,
                    pool_bytes=self.engine.runner.cache.nbytes(),
                    compute_dtype=self.dtype, attention_backend=self.backend,
                    max_model_len=self.max_model_len)

    def kv_stats(self) -> dict:
        """Per-layer counters of saturated and NaN elements written, and running K/V amax."""
        s = np.asarray(self.engine.runner.cache.stats)
        per_layer = [{f: float(row[i]) for i, f in enumerate(STAT_FIELDS)} for row in s]
        return {"layers": per_layer,
                "saturated_total": float(s[:, 0].sum() + s[:, 1].sum()),
                "nan_total": float(s[:, 2].sum() + s[:, 3].sum())}


def generate(prompts, model: str | None = None, sampling_params=None, **kwargs):
    """One-call convenience: build an ``LLM`` and generate. kwargs go to ``LLM``."""
    return LLM(model=model, **kwargs).generate(prompts, sampling_params)


__all__ = ["LLM", "generate"]
