"""Offline API for JAX users: ``jfp8kv.LLM`` and ``jfp8kv.generate``."""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Iterator, Sequence

import numpy as np

from jfp8kv.config import CacheOptions, EngineConfig, LoadConfig, split_options
# DEFAULT_FP8_SCALE_MODE, check_fp8_support and resolve_backend are re-exported for callers
# that import them from here.
from jfp8kv.engine.builder import build_engine, cache_info, check_fp8_support, resolve_backend
from jfp8kv.engine import startup_profile
from jfp8kv.engine.overlap import warm_helpers
from jfp8kv.engine.types import RequestOutput, SamplingParams
from jfp8kv.kvcache.cache import DEFAULT_FP8_SCALE_MODE, STAT_FIELDS

log = logging.getLogger(__name__)


class LLM:
    """A model with a paged KV cache and a continuous-batching engine.

    Options are the fields of ``LoadConfig`` (``model``, ``dtype``), ``CacheOptions``
    (``kv_cache_dtype``, ``kv_scale_mode``, ``kv_scales``) and ``EngineConfig`` (
    ``max_model_len``, ``kv_cache_memory`` in bytes, ``page_size``, ``seed``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_queue_len``, ``attention_backend``,
    ``decode_steps``, ``decode_buckets``, ``min_prefill_chunk``), each documented there. Pass
    them as keywords, or whole configs as ``cache_options`` / ``engine_config``; a keyword
    given (not None) overrides the config's field. ``kv_cache_dtype``: "auto" (the compute
    dtype), "bfloat16", "float16", "float32", "fp8_e4m3" (alias "fp8"), "fp8_e5m2".
    ``kv_scale_mode`` (fp8 only): "tensor", "channel", "token" or "block" (default:
    ``DEFAULT_FP8_SCALE_MODE``). ``kv_scales`` (static modes): a float for every layer, a
    scales JSON path, or None (checkpoint scales, else calibration at start-up).
    ``loaded`` (a LoadedModel) skips loading; ``device`` defaults to JAX's first device.

    Compiling: every batch size, prompt-chunk length and page-table width the engine pads a
    step to is one XLA executable. ``warmup`` (default None: True on a GPU, False on a CPU)
    compiles them all at construction, behind a progress bar, as the server does before
    /health, so no ``generate`` waits for a compile (this takes a minute or more for an 8B
    model: docs/guide/gpu-quickstart.md). With ``warmup=False``, or on a CPU by default,
    each shape compiles on its first use instead: a call that meets a new shape waits for
    that compile (on a 2-core CPU, tens of seconds for the default model's first
    ``generate`` and first ``nll``), which one INFO log line at construction says;
    ``warmup()`` compiles them all later. Compiled code is kept in the persistent
    compilation cache (``compile_cache``), so a later process mostly loads it.
    """

    def __init__(self, model: str | None = None, dtype: str | None = None,
                 kv_cache_dtype: str | None = None, max_model_len: int | None = None,
                 kv_cache_memory: int | None = None, page_size: int | None = None,
                 seed: int | None = None, *, engine_config: EngineConfig | None = None,
                 cache_options: CacheOptions | None = None, device=None, loaded=None,
                 warmup: bool | None = None, **options):
        positional = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                          max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                          page_size=page_size, seed=seed)
        options = {k: v for k, v in positional.items() if v is not None} | options
        load, cache, engine = split_options(options, load=LoadConfig(model=model),
                                            cache=cache_options, engine=engine_config)
        built = build_engine(load, cache, engine, device=device, loaded=loaded)
        self.engine = built.engine
        self.engine_config = built.engine_config
        self.cache_plan = built.cache_plan
        self.config = built.loaded.config
        self.tokenizer = built.loaded.tokenizer
        self.dtype = built.dtype
        self.backend = built.backend
        self.max_model_len = built.engine_config.max_model_len
        self.kv_cache_memory = built.engine_config.kv_cache_memory
        self.bytes_per_token = built.bytes_per_token
        self.kv_scales_source = built.kv_scales_source
        self._built = built
        self._ids = itertools.count()
        if warmup is None:  # a GPU warms up, as the server does; a CPU says it does not
            warmup = not self.engine.runner.on_cpu
            if not warmup:
                log.info("on a CPU, shapes compile on first use (a generate or nll meeting a "
                         "new batch or prompt shape waits for it); LLM(warmup=True) or "
                         "llm.warmup() compiles them all up front")
        if warmup:
            self.warmup()

    def _shapes(self):
        sched = self.engine.scheduler
        return self.engine.runner.warmup_shapes(sched.max_num_seqs, sched.max_num_batched_tokens,
                                                sched.step_counts)

    def warmup(self, progress: bool = True, run: bool | None = None) -> None:
        """Compile every decode and prefill bucket the engine can dispatch (on parallel
        threads) and the overlap scheduler's helpers: the server does this before /health,
        so no request waits for a compile: requests with log-probs, penalties or prompt
        scoring (``echo``) run the switched executables compiled here too (``variants.py``;
        with ``feature_executables="per-mix"`` they compile on first use).

        ``run``: also execute each shape once on zeros (writing only to the sink page).
        Default: on a GPU, where it takes milliseconds and surfaces a temporary buffer that
        does not fit before the first request; not on a CPU, where the compiled
        executables are already the ones the jitted calls find (nothing compiles on first
        use; tests/engine/test_cpu_buckets.py) and running every bucket once took 11 of a
        warm start's 40 s (the 64-row decode over 4,096 tokens alone 4-5 s). Shapes the
        parallel compile missed are always compiled by running them."""
        sched, runner = self.engine.scheduler, self.engine.runner
        shapes = self._shapes()
        with startup_profile.phase("warmup"):
            compiled = self._precompile(shapes, progress)
            if run is None:
                run = not runner.on_cpu
            if run or compiled < len(shapes):
                runner.warmup(shapes, progress and compiled < len(shapes))
            if self.engine.overlap_scheduling:
                batches = sorted({runner.decode_bucket(n)
                                  for n in range(1, sched.max_num_seqs + 1)})
                warm_helpers(runner.decode_bucket(sched.max_num_seqs), batches,
                             sched.step_counts, sched.max_num_seqs)
        log.info(startup_profile.log_line(startup_profile.summary()))
        written = startup_profile.write_if_asked()
        if written:
            log.info("start-up profile written to %s", written)

    def _precompile(self, shapes, progress: bool = False) -> int:
        """Compile ``shapes`` on parallel threads (XLA compiles outside the GIL; on the
        2-core CPU machine two threads halve the start); returns how many compiled. A
        failure here only costs time: warmup then compiles what is missing itself."""
        runner = self.engine.runner
        t0, store, loads = time.perf_counter(), runner.store, runner.stored_loads
        try:
            n = runner.precompile(shapes, min(8, os.cpu_count() or 1, len(shapes)), progress)
        except Exception as e:  # noqa: BLE001
            log.warning("parallel precompile failed (%s: %s); compiling one shape at a time",
                        type(e).__name__, e)
            return 0
        log.info("compiled %d shapes on parallel threads in %.0f s (%d executables loaded from "
                 "%s)", n, time.perf_counter() - t0, runner.stored_loads - loads,
                 store.path if store else "nowhere: compile cache off")
        return n

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
        if self.engine.has_unfinished():
            raise RuntimeError("nll() needs an idle engine")
        return self.engine.nll_chunks(token_ids, chunk_size)

    def cache_info(self) -> dict:
        """The KV cache's resolved settings and sizes (dtype, pages, bytes, backend)."""
        return cache_info(self._built)

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


__all__ = ["DEFAULT_FP8_SCALE_MODE", "LLM", "check_fp8_support", "generate",
           "resolve_backend"]
