"""Sizing the cache: the context length, the defaults that fit, the memory plan
(``memory.py``) and the pages and slots (``kvcache.layout.plan_cache``). ``build_engine``
calls ``size_cache`` once the family's layout is known; nothing here knows a family.

Where the user left them unset, the defaults adapt to the device (a model that fills most of
a GPU, say): the prefill tokens per step are halved while the largest prefill's measured
temporaries would take more than ``TEMP_SHARE`` of the memory left after the weights; the
running sequences are halved while their state slots would take more than ``SLOT_SHARE``
of the pools; ``max_model_len`` becomes what the pages hold when that is less than the
model's context. Each change is logged. A value the user set is kept, or refused with a
message naming what would fit.

Layouts with slot pools and prefix caching on also get state snapshot slots
(``snapshot_memory``: ``state_snapshot_memory`` of the pools, by default
``SNAPSHOTS_PER_SEQUENCE`` per running sequence and at most ``SNAPSHOT_SHARE`` of them),
taken after the sequences' slots and before the pages.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from jfp8kv.config import EngineConfig, ModelConfig
from jfp8kv.engine.memory import (CPU_DEFAULT_CACHE_MEMORY, GiB, DeviceMemory, MemoryPlan,
                                  PeakMemo, largest_shapes, peak_bytes)
from jfp8kv.kvcache.cache_tree import abstract_cache
from jfp8kv.kvcache.layout import EXTRA_SLOTS, CacheLayout, CachePlan, plan_cache

log = logging.getLogger(__name__)

TEMP_SHARE = 1 / 3
SLOT_SHARE = 1 / 4
MIN_AUTO_BATCHED_TOKENS = 512
# Held above a verification's peak when it re-plans the pools: the same executables at
# another pool size measured up to 10% apart on an H100 (XLA's choices differ per program),
# and a re-plan that holds saves a verification (~80 s of compiles at 35B).
REPLAN_CUSHION = 0.10
KEPT_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")  # a plan's defaults
# The default snapshots: a running sequence holds one or two (its latest page-boundary state,
# a capture in flight) and leaves one when it ends; the rest serve other conversations.
SNAPSHOTS_PER_SEQUENCE = 4
SNAPSHOT_SHARE = 1 / 5


@dataclasses.dataclass(frozen=True)
class Sizing:
    """The cache plan, the memory plan behind it and the engine config resolved with them
    (max_model_len, kv_cache_memory, max_num_seqs, max_num_batched_tokens)."""

    plan: CachePlan
    memory: MemoryPlan
    engine: EngineConfig


def context_length(cfg: ModelConfig, asked: int | None, family_default: int | None) -> int:
    """``asked`` if the model's context allows it (ValueError otherwise, as vLLM does), else
    the family's default or the model's context."""
    ctx = cfg.max_position_embeddings
    if asked is not None:
        if asked > ctx:
            raise ValueError(f"max_model_len={asked} is longer than the model's context "
                             f"({ctx} tokens, max_position_embeddings in its config); use at "
                             f"most {ctx}")
        return asked
    return min(ctx, family_default or ctx)


def snapshot_memory(engine: EngineConfig, layout: CacheLayout, budget: int) -> int:
    """Bytes of a ``budget``-byte pool kept for state snapshots (module docstring): 0
    without slot pools or prefix caching; ``engine.state_snapshot_memory`` as a fraction
    (< 1) of ``budget`` or bytes; by default ``SNAPSHOTS_PER_SEQUENCE`` slots per running
    sequence, at most ``SNAPSHOT_SHARE`` of the budget."""
    if not layout.slots or not engine.enable_prefix_caching:
        return 0
    asked = engine.state_snapshot_memory
    if asked is None:  # never so many that one max_model_len sequence no longer fits
        per_seq = SNAPSHOTS_PER_SEQUENCE * engine.max_num_seqs * layout.bytes_per_slot()
        need = math.ceil(engine.max_model_len / engine.page_size) * \
            layout.bytes_per_page(engine.page_size)
        room = (budget - (engine.max_num_seqs + EXTRA_SLOTS) * layout.bytes_per_slot()
                - layout.fixed_bytes() - need)
        return int(max(0, min(SNAPSHOT_SHARE * budget, per_seq, room)))
    return int(asked * budget if asked < 1 else asked)


def cpu_default_budget(layout: CacheLayout, page_size: int, max_len: int, seqs: int) -> int:
    """The CPU's default pool: room for max(8, seqs / 4) sequences of ``max_len``, at most
    ``CPU_DEFAULT_CACHE_MEMORY`` for the pages, plus the state slots."""
    bpt = math.ceil(layout.bytes_per_token(page_size))
    pages = int(min(CPU_DEFAULT_CACHE_MEMORY, bpt * max_len * max(8, seqs // 4)))
    slots = (seqs + EXTRA_SLOTS) * layout.bytes_per_slot() if layout.slots else 0
    return pages + slots


def _line(seen: dict[int, int]) -> Callable[[int], float]:
    """Prefill temporaries by tokens from the budgets measured (``seen``: tokens -> peak):
    proportional to one, else the line through the two smallest (never under proportional
    to the smaller)."""
    (t0, p0), *rest = sorted(seen.items())
    if not rest:
        return lambda t: p0 * t / t0
    t1, p1 = rest[0]
    return lambda t: max(p0 + (p1 - p0) / (t1 - t0) * (t - t0), p0 * t / t0)


class Sizer:
    """One engine's sizing. ``engine``: the config with the device's defaults filled in;
    ``asked``: as the user gave it (what was left unset may adapt). ``new_runner(plan,
    engine)``: a ``ModelRunner`` over the ``abstract_cache`` of ``plan`` (it compiles, runs
    nothing); ``shardings``: where each pool lives (tensor parallelism; ``Cache.init``);
    ``program_key``: what else picks the executables (backend, tunings), for the memo;
    ``family_default``: the family's context when the user names none."""

    def __init__(self, cfg: ModelConfig, layout: CacheLayout, engine: EngineConfig,
                 asked: EngineConfig, memory: DeviceMemory, new_runner: Callable,
                 memo: PeakMemo, shardings: dict | None = None, program_key: tuple = (),
                 family_default: int | None = None):
        self.cfg, self.layout, self.engine, self.asked = cfg, layout, engine, asked
        self.dm, self.new_runner, self.memo = memory, new_runner, memo
        self.shardings, self.program_key = shardings, program_key
        self.family_default = family_default
        self.ps = engine.page_size

    def _largest(self, runner, engine: EngineConfig) -> list[tuple]:
        return largest_shapes(runner, engine.max_num_seqs, engine.max_num_batched_tokens,
                              engine.decode_steps)

    def probe(self, engine: EngineConfig) -> dict[tuple, int]:
        """The peak temporaries of ``engine``'s largest decode and one-row prefill
        executables (their full-featured variant) against a two-page probe pool, each kept
        in the memo; the verification at the planned pool adds the widest prefill."""
        snaps = int(snapshot_memory(engine, self.layout, 1 << 62) > 0)  # their copies' code
        slots = engine.max_num_seqs + EXTRA_SLOTS + snaps if self.layout.slots else 0
        plan = CachePlan(self.layout, self.ps, 2, slots, snaps)
        runner = self.new_runner(plan, engine)
        keys = {shape: PeakMemo.key(repr(self.cfg), repr(self.layout), self.ps, repr(shape),
                                    engine.max_model_len, self.program_key, snaps)
                for shape in self._largest(runner, engine)[:2]}
        peaks = {shape: self.memo.get(key) for shape, key in keys.items()}
        todo = [shape for shape, peak in peaks.items() if peak is None]
        if todo:
            peaks.update(peak_bytes(runner, todo,
                                    abstract_cache(plan, shardings=self.shardings)))
            for shape in todo:
                self.memo.put(keys[shape], peaks[shape])
        return peaks

    def _fit_batched_tokens(self, e: EngineConfig) -> tuple[EngineConfig, dict]:
        """(engine, peaks) with ``max_num_batched_tokens`` (unset by the user) halved while
        the largest prefill's temporaries would take more than ``TEMP_SHARE`` of the memory
        left after the weights. From one probe the halvings assume temporaries proportional
        to the tokens, and a probe confirms; from two, the line through them (a floor plus
        a share per token) predicts the budget and its peak, and the verification at the
        planned pool measures it instead of another probe (~45 s of compiles at 35B). Where
        halving stops paying (less than a quarter off), the larger budget is kept."""
        peaks = self.probe(e)
        room = TEMP_SHARE * (self.dm.capacity - self.dm.in_use)

        def prefill_peak(p):
            return max(v for s, v in p.items() if s[0] == "prefill")

        seen = {e.max_num_batched_tokens: prefill_peak(peaks)}
        while not self.asked.max_num_batched_tokens:
            prefill, tokens = prefill_peak(peaks), e.max_num_batched_tokens
            predict = _line(seen)
            while tokens > MIN_AUTO_BATCHED_TOKENS and predict(tokens) > room:
                tokens = max(MIN_AUTO_BATCHED_TOKENS, tokens // 2)
            if tokens == e.max_num_batched_tokens:
                break
            smaller = dataclasses.replace(e, max_num_batched_tokens=tokens)
            if len(seen) > 1:
                fewer = {(s[0], s[1], tokens, s[3]) if s[0] == "prefill" else s:
                         int(predict(tokens)) if s[0] == "prefill" else v
                         for s, v in peaks.items()}
            else:
                fewer = self.probe(smaller)
            if prefill_peak(fewer) > 0.75 * prefill:
                break
            log.info("max_num_batched_tokens %d -> %d: the largest prefill's temporaries "
                     "(%.2f GiB -> %.2f GiB%s) would take more than a third of the %.2f GiB "
                     "left after the weights", e.max_num_batched_tokens, tokens, prefill / GiB,
                     prefill_peak(fewer) / GiB, ", predicted" if len(seen) > 1 else "",
                     (self.dm.capacity - self.dm.in_use) / GiB)
            if len(seen) > 1:
                return smaller, fewer
            e, peaks = smaller, fewer
            seen[tokens] = prefill_peak(fewer)
        return e, peaks

    def plan(self, budget: int, e: EngineConfig) -> CachePlan:
        """``plan_cache`` of ``budget`` with ``e``'s sequences and snapshots."""
        return plan_cache(self.layout, budget, self.ps, e.max_num_seqs, e.max_model_len,
                          snapshot_memory(e, self.layout, budget))

    def verify(self, plan: CachePlan, engine: EngineConfig):
        """(runner, peak): the largest executables compiled against ``plan``'s pools, every
        variant, registered with the runner for its warm-up (one device)."""
        runner = self.new_runner(plan, engine)
        peaks = peak_bytes(runner, self._largest(runner, engine),
                           abstract_cache(plan, shardings=self.shardings), every_variant=True,
                           register=runner.tp is None)
        return runner, max(peaks.values())

    def _verified(self, e: EngineConfig, free: int):
        """(engine, plan, runner, peak): ``free`` bytes of pools planned (the context fitted
        to them) and the largest executables verified against them."""
        e = self._fit_context(e, free)
        plan = self.plan(free, e)
        runner, peak = self.verify(plan, e)
        return e, plan, runner, peak

    def size(self) -> tuple[Sizing, object]:
        """(sizing, runner or None): the runner when executables were compiled for the plan
        (reuse it: they are registered with it)."""
        e, asked = self.engine, self.asked
        max_len = context_length(self.cfg, asked.max_model_len, self.family_default)
        e = dataclasses.replace(e, max_model_len=max_len)
        given = e.kv_cache_memory
        budget0 = given or cpu_default_budget(self.layout, self.ps, max_len, e.max_num_seqs)
        if not self.dm.on_gpu and self.dm.in_use + budget0 <= self.dm.capacity / 2:
            e = self._fit_context(e, budget0)
            plan = self.plan(budget0, e)
            mem = MemoryPlan(self.dm.capacity, self.dm.in_use, None, self.dm.margin, budget0,
                             "kv_cache_memory" if given else "cpu default", total=self.dm.total)
            return Sizing(plan, mem, dataclasses.replace(e, kv_cache_memory=budget0)), None
        if given is not None:
            return self._given(e, given)
        return self._default(e, budget0)

    def _given(self, e: EngineConfig, given: int):
        e = self._fit_context(e, given)
        plan = self.plan(given, e)
        runner, peak = self.verify(plan, e)
        free = self.dm.free_for(peak)
        if given > free:
            raise ValueError(
                f"kv_cache_memory={given} bytes does not fit beside the weights "
                f"({self.dm.in_use / GiB:.2f} GiB), the step's measured peak temporaries "
                f"({peak / GiB:.2f} GiB) and the margin ({self.dm.margin / GiB:.2f} GiB) in "
                f"{self.dm.capacity / GiB:.2f} GiB (gpu_memory_utilization="
                f"{e.gpu_memory_utilization}): at most {max(free, 0)} bytes fit; lower "
                "--kv-cache-memory or leave it unset")
        mem = MemoryPlan(self.dm.capacity, self.dm.in_use, peak, self.dm.margin, given,
                         "kv_cache_memory", "verified at the pool", self.dm.total)
        return Sizing(plan, mem, e), runner

    def _default(self, e: EngineConfig, cpu_budget: int):
        if not self.dm.on_gpu:  # plans are kept on a GPU, where measuring them compiles
            return self._measure(e, cpu_budget)
        key = PeakMemo.key("plan", repr(self.cfg), repr(self.layout), self.ps, repr(e),
                           self.program_key, self.dm.capacity, self.dm.total)
        kept = self._kept(e, key)
        if kept is not None:
            return kept, None
        sizing, runner = self._measure(e, cpu_budget)
        m = sizing.memory
        self.memo.put_record(key, dict(
            pool_budget=m.pool_budget, peak=m.peak, measured=m.measured, in_use=m.in_use,
            **{k: getattr(sizing.engine, k) for k in KEPT_KNOBS}))
        return sizing, runner

    def _kept(self, e: EngineConfig, key: str) -> Sizing | None:
        """The plan an earlier start with the same program, flags and card measured, when
        its pools still fit beside its peak (weights a few MB apart borrow at most a quarter
        of the margin): the same pages give the same executables, so a second start finds
        every one in the compilation cache and compiles nothing to size the pools."""
        kept = self.memo.get_record(key)
        try:
            budget, peak = int(kept["pool_budget"]), int(kept["peak"])
            e = dataclasses.replace(e, **{k: int(kept[k]) for k in KEPT_KNOBS})
        except (TypeError, KeyError, ValueError):
            return None
        if budget > self.dm.free_for(peak) + self.dm.margin // 4:
            log.info("the memory plan of an earlier start (%.2f GiB of pools) no longer fits "
                     "(%.2f GiB in use); measuring again", budget / GiB, self.dm.in_use / GiB)
            return None
        log.info("memory plan kept from an earlier start with these flags on this card "
                 "(weights then %.2f GiB, now %.2f GiB)", int(kept.get("in_use", 0)) / GiB,
                 self.dm.in_use / GiB)
        mem = MemoryPlan(self.dm.capacity, self.dm.in_use, peak, self.dm.margin, budget,
                         "measured", f"{kept.get('measured', '')}, kept", self.dm.total)
        return Sizing(self.plan(budget, e), mem, dataclasses.replace(e, kv_cache_memory=budget))

    def _measure(self, e: EngineConfig, cpu_budget: int):
        # sequences first, from the memory after the weights and the margin (an upper bound
        # of the pools): their slots bound the probe's rows; fitted again once measured
        e = self._fit_sequences(e, self.dm.free_for(0))
        e, peaks = self._fit_batched_tokens(e)
        peak = max(peaks.values())
        what = ", ".join(f"{k} {b}x{t}" for k, b, t, _ in peaks)
        free = self.dm.free_for(peak)
        if not self.dm.on_gpu:
            free = min(free, cpu_budget)
        e, plan, runner, real = self._verified(self._fit_sequences(e, free), free)
        if real > peak:
            e, plan, free, runner, real = self._regrow(e, plan, free, peak, real)
        mem = MemoryPlan(self.dm.capacity, self.dm.in_use, real, self.dm.margin, free,
                         "measured", what, self.dm.total)
        return Sizing(plan, mem, dataclasses.replace(e, kv_cache_memory=free)), runner

    def _regrow(self, e: EngineConfig, plan: CachePlan, free: int, peak: int, real: int):
        """The verification at the planned pool measured more than the probe: the widest
        prefill and every variant (a constant), or temporaries that grow with the pool (a
        copy of a pool the compiler could not update in place). Re-planned with the measured
        peak and ``REPLAN_CUSHION`` held (the peak reported); where a second measurement at
        fewer pages shows growth, each page's share is taken from the two and the pools
        shrink so that pools and temporaries fit."""
        log.info("the step's temporaries at the planned pool (%.2f GiB: every variant, the "
                 "widest prefill) exceed the probe's (%.2f GiB); re-planning", real / GiB,
                 peak / GiB)
        points = [(2, peak), (plan.num_pages, real)]
        held = int(real * (1 + REPLAN_CUSHION))
        if self.dm.free_for(held) > 0:
            free = self.dm.free_for(held)
            e, plan, runner, again = self._verified(e, free)
            if 0.95 * real <= again <= held:  # a constant (give or take a compile): it holds
                return e, plan, free, runner, held
            if again > held:  # more at fewer pages: no growth with the pool, the compiler's
                return self._settle(e, again)  # choices differ between compiles
            points = [(plan.num_pages, again), points[1]]
        (p0, t0), (p1, t1) = points
        per_page = (t1 - t0) / max(1, p1 - p0)
        if per_page <= 0:
            return self._settle(e, max(t0, t1))
        base = t0 - per_page * p0
        page = self.layout.bytes_per_page(self.ps)
        free = int((self.dm.free_for(base) - per_page) / (1 + per_page / page))
        e, plan, runner, real = self._verified(e, free)
        if free + real > self.dm.free_for(0):
            raise ValueError(f"the step's temporaries grow with the pool ({real} bytes beside "
                             f"{free} bytes of pools) past the {self.dm.free_for(0)} bytes "
                             "free: set a smaller --kv-cache-memory")
        return e, plan, free, runner, real

    def _settle(self, e: EngineConfig, top: int, rounds: int = 3):
        """Temporaries that differ between compiles without growing with the pool (XLA's
        choices are per program): pools planned from the largest peak measured so far until
        a verification measures no more than 5% above it (the margin holds the excess)."""
        for _ in range(rounds):
            free = self.dm.free_for(top)
            self._check_room(free, e)
            e, plan, runner, again = self._verified(e, free)
            log.info("the step's temporaries measured %.2f GiB at %d pages against %.2f GiB "
                     "planned for", again / GiB, plan.num_pages, top / GiB)
            if again <= 1.05 * top:
                return e, plan, free, runner, max(top, again)
            top = again
        raise ValueError(f"the step's temporaries kept growing between compiles (last "
                         f"{top} bytes): set --kv-cache-memory (at most "
                         f"{max(self.dm.free_for(top), 0)} bytes fit beside that peak)")

    def _check_room(self, free: int, e: EngineConfig) -> None:
        if free <= 0:
            raise ValueError(
                f"nothing is left for the KV cache: the weights ({self.dm.in_use / GiB:.2f} "
                f"GiB), the step's peak temporaries and the margin fill the "
                f"{self.dm.capacity / GiB:.2f} GiB that gpu_memory_utilization="
                f"{e.gpu_memory_utilization} allows; raise --gpu-memory-utilization or lower "
                "--max-num-batched-tokens")

    def _fit_sequences(self, e: EngineConfig, free: int) -> EngineConfig:
        """Fewer running sequences (unset by the user) while their state slots would take
        more than ``SLOT_SHARE`` of ``free``."""
        self._check_room(free, e)
        per_slot = self.layout.bytes_per_slot()
        seqs = e.max_num_seqs
        if self.layout.slots and not self.asked.max_num_seqs:
            while seqs > 1 and (seqs + EXTRA_SLOTS) * per_slot > SLOT_SHARE * free:
                seqs //= 2
            if seqs != e.max_num_seqs:
                log.info("max_num_seqs %d -> %d: %d bytes of state per sequence would take "
                         "more than a quarter of the %.2f GiB of pools", e.max_num_seqs, seqs,
                         per_slot, free / GiB)
        return dataclasses.replace(e, max_num_seqs=seqs)

    def _fit_context(self, e: EngineConfig, free: int) -> EngineConfig:
        """``max_model_len`` (unset by the user) lowered to what the pages hold beside the
        state snapshots' default share (``snapshot_memory``)."""
        if self.asked.max_model_len:
            return e
        slots = (e.max_num_seqs + EXTRA_SLOTS) * self.layout.bytes_per_slot() \
            if self.layout.slots else 0
        # the snapshots' default share first: a context that adapts to the pages must not
        # take them all (a model filling most of the card would keep none: no prefix caching)
        share = snapshot_memory(dataclasses.replace(e, max_model_len=self.ps), self.layout,
                                free)
        slots += share // max(1, self.layout.bytes_per_slot()) * self.layout.bytes_per_slot()
        pages = (free - slots - self.layout.fixed_bytes()) // self.layout.bytes_per_page(self.ps)
        fits = pages * self.ps
        if fits >= e.max_model_len:
            return e
        if fits < self.ps:
            return e  # the planner refuses, naming the bytes one sequence needs
        log.warning("max_model_len %d -> %d: the pools hold %d tokens (%.3f GiB); give more "
                    "memory (--gpu-memory-utilization, --kv-cache-memory) or lower "
                    "--max-num-seqs for more", e.max_model_len, fits, fits, free / GiB)
        return dataclasses.replace(e, max_model_len=fits)
