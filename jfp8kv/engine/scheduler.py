"""Continuous-batching scheduler: plain Python, no arrays, testable without a device.

State of a sequence: ``tokens`` = prompt + generated; ``num_cached`` tokens have K/V in the
cache. ``remaining = len(tokens) - num_cached`` tokens must still go through the model:
remaining > 1 means prefill (chunked under the token budget), remaining == 1 means decode
(the last sampled token is the input). Preemption frees all pages and sets num_cached = 0,
so the sequence is recomputed by prefill later; its generated tokens are kept.

Overlap scheduling (``LLMEngine``): tokens sampled by a dispatched step whose values the host
has not read yet count in ``num_tokens`` as ``num_pending`` (the engine advances
``num_cached`` at dispatch), so the next step is scheduled before they are read. A pending
last token can feed a decode row (from the device); it cannot be prefilled or hashed, so a
sequence with pending tokens is neither admitted nor registered past its known tokens. A row
is not scheduled when its pending tokens already reach max_tokens or max_model_len.

Prefix caching (``enable_prefix_caching``, on by default): full computed pages are registered
in a ``PrefixCache`` at the start of each step and when a sequence releases its pages (finish,
abort, preemption). An admission maps the registered pages its tokens start with (shared,
reference-counted) and starts with ``num_cached`` at the end of them, so only the rest is
prefilled. Shared pages are full and lie below every holder's ``num_cached``: nobody writes
them. A preempted sequence usually finds its own pages still cached when readmitted.
Caches with slot pools need the state after a matched prefix too: ``snapshot_slots`` turn on
state snapshots (``jfp8kv.engine.snapshot_policy``: saved at page boundaries, restored by an
admission whose match is cut to end at one).

Each step decodes every running sequence in decode state (decode has priority, so
inter-token latency stays low while others prefill) and spends the token budget
(``max_num_batched_tokens``) on prefill chunks: first sequences part-way through their
prompt, then new admissions in arrival order, as far as the admission policy lets them start
(``jfp8kv.engine.admission``: by default only with room for the running sequences' expected
growth, so that decode rarely runs out of pages and preempts). Decode rows run in their own
dispatch and take no budget: counting them cut every prompt at budget - rows, and the short
remainders then rode in rows padded to the longest chunk (the runner pads a dispatch to
[rows, longest]). The chunks are handed over longest first, so the runner's dispatches group
chunks of one length bucket. A step without prefill decodes up to ``decode_steps`` tokens per row in
one dispatch; a step with prefill decodes one (``ScheduledStep.num_steps``): every decode
iteration reads all the weights, so iterations spent on the few rows running while the
others' prompts are prefilled would cost nearly what iterations over the full batch cost
later (on an H200, Qwen3-8B 64 x 4096 in / 256 out: docs/lab/results-history.md, offline).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from jfp8kv.config import EngineConfig
from jfp8kv.engine.admission import Admission
from jfp8kv.engine.sequence import DecodeRow, PrefillChunk, ScheduledStep, Sequence
from jfp8kv.engine.snapshot_policy import SnapshotPolicy
from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.kvcache.prefix_cache import PrefixCache, PrefixCacheStats
from jfp8kv.kvcache.snapshots import SnapshotPool, SnapshotStats


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, decode_steps: int = 1, *,
                 enable_prefix_caching: bool = True, prefix_cache_namespace="",
                 state_slots: int = 0, admission: str = "greedy",
                 snapshot_slots: tuple[int, int] = (0, 0)):
        """``prefix_cache_namespace``: anything that changes the numbers stored in a page
        (model, cache dtype, scale mode, static-scale version, rotation); pages are reused
        only within one namespace (see ``PrefixCache``). ``state_slots`` (caches with slot
        pools, ``kvcache.layout``): slots 1..state_slots (>= max_num_seqs) are handed to
        sequences at admission and taken back with their pages (finish, abort, preemption:
        the state is then recomputed by prefill, as the pages are); slot state_slots + 1 is
        ``scratch_state_slot`` (``LLM.nll``). ``admission``: when a waiting sequence may
        start, ``jfp8kv.engine.admission``. ``snapshot_slots`` (first, count): the state
        snapshot slots of prefix caching over slot pools (needed there: ValueError
        without)."""
        self.allocator = allocator
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_steps = decode_steps
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.admission = Admission(admission, allocator, page_size, max_model_len,
                                   max_num_batched_tokens, decode_steps)
        self._order = itertools.count()
        first, count = snapshot_slots
        if state_slots and state_slots < max_num_seqs:
            raise ValueError(f"state_slots={state_slots} < max_num_seqs={max_num_seqs}")
        if enable_prefix_caching and state_slots and not count:
            raise ValueError("prefix caching over state slots needs snapshot slots")
        pool = SnapshotPool(first, count) if enable_prefix_caching and count else None
        self.prefix_cache = (PrefixCache(allocator, page_size, prefix_cache_namespace, pool)
                             if enable_prefix_caching else None)
        self.snapshots = SnapshotPolicy(self.prefix_cache, page_size) if pool else None
        self._free_states = list(range(state_slots, 0, -1))
        self.scratch_state_slot = state_slots + 1 if state_slots else 0

    @classmethod
    def from_config(cls, allocator: PageAllocator, cfg: EngineConfig,
                    prefix_cache_namespace="", state_slots: int = 0,
                    snapshot_slots: tuple[int, int] = (0, 0)) -> "Scheduler":
        """A scheduler with ``cfg``'s limits; ``cfg`` must be resolved (max_model_len and
        decode_steps set, as ``jfp8kv.engine.builder`` returns it)."""
        if cfg.max_model_len is None or cfg.decode_steps is None:
            raise ValueError("Scheduler.from_config needs a resolved EngineConfig "
                             "(max_model_len and decode_steps set)")
        return cls(allocator, cfg.page_size, cfg.max_model_len, cfg.max_num_seqs,
                   cfg.max_num_batched_tokens, cfg.decode_steps,
                   enable_prefix_caching=cfg.enable_prefix_caching,
                   prefix_cache_namespace=prefix_cache_namespace, state_slots=state_slots,
                   admission=cfg.admission, snapshot_slots=snapshot_slots)

    # -- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.order = next(self._order)
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.admission.on_finish(seq)  # learns from finish reasons stop/length only
        self._release(seq)

    @property
    def step_counts(self) -> tuple[int, ...]:
        """The decode dispatch lengths ``schedule`` can choose (each compiles its own
        executable): one, and ``decode_steps``."""
        return tuple(sorted({1, self.decode_steps}))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Hit and query token counts, cached pages, evictions (all zero when disabled)."""
        return self.prefix_cache.stats() if self.prefix_cache else PrefixCacheStats()

    def snapshot_stats(self) -> SnapshotStats:
        """State snapshots' hits, saves, evictions and slots (all zero without them)."""
        return self.snapshots.pool.stats() if self.snapshots else SnapshotStats()

    def reset_prefix_cache(self, namespace=None) -> None:
        """Forget every cached page (e.g. after static scales changed); with ``namespace``,
        also key new pages under it. Needs no running sequence (their pages hold old numbers)."""
        if self.running:
            raise RuntimeError("reset_prefix_cache() needs no running sequence")
        if self.prefix_cache:
            self.prefix_cache.reset(namespace)
        for seq in self.waiting:
            seq.page_keys = []

    def _register(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly full, computed pages to the prefix cache (then its state
        snapshots that are valid)."""
        computed = min(seq.num_cached, seq.num_tokens - seq.num_pending)  # known tokens only
        if self.prefix_cache and computed // self.page_size > seq.num_registered:
            seq.num_registered = self.prefix_cache.register(
                seq.tokens, seq.page_keys, seq.pages, seq.num_registered, computed)
        if self.snapshots and seq.snap is not None:
            self.snapshots.register(seq)

    def _release(self, seq: Sequence) -> None:
        self._register(seq)
        if self.snapshots and seq.snap is not None:
            self.snapshots.release(seq)
        # Last page first: of one sequence's cached pages the tail is evicted first, so a
        # cached prefix is not cut in the middle while its continuation survives.
        self.allocator.free(reversed(seq.pages))
        seq.pages = []
        seq.num_registered = 0
        if seq.state_slot:
            self._free_states.append(seq.state_slot)
            seq.state_slot = 0

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _grow(self, seq: Sequence, num_tokens: int, protect: set) -> bool:
        """Make ``seq`` own pages for ``num_tokens`` tokens, preempting newer sequences."""
        need = self._pages_for(num_tokens) - len(seq.pages)
        while need > 0 and not self.allocator.can_allocate(need):
            victim = self._pick_victim(seq, protect)
            if victim is None:
                return False
            self._preempt(victim)
        if need > 0:
            seq.pages.extend(self.allocator.allocate(need))
        return True

    def _pick_victim(self, seq: Sequence, protect: set) -> Sequence | None:
        candidates = [s for s in self.running if s is not seq and s not in protect]
        return max(candidates, key=lambda s: s.order) if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_cached = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.admission.on_preempt()
        self._preempted.append(seq)
        self.waiting.appendleft(seq)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        self._preempted: list[Sequence] = []
        if self.snapshots:
            self.snapshots.begin_step()
        for seq in self.running:
            self._register(seq)
        budget = self.max_num_batched_tokens
        decode: list[DecodeRow] = []
        protect: set = set()
        # Oldest first, so preemption (newest first) spares the oldest.
        for seq in sorted(self.running, key=lambda s: s.order):
            if seq not in self.running or seq.remaining != 1:
                continue
            steps = min(self.decode_steps, seq.params.max_tokens - seq.num_generated,
                        self.max_model_len - seq.num_cached)
            if steps <= 0:
                continue  # its pending tokens finish it (overlap scheduling)
            if not self._grow(seq, seq.num_cached + steps, protect):
                continue
            protect.add(seq)
            decode.append(DecodeRow(seq, steps))
        decode = [r for r in decode if r.seq in self.running]

        prefill: list[PrefillChunk] = []
        partial = [s for s in sorted(self.running, key=lambda s: s.order) if s.remaining > 1]
        for seq in partial:
            if budget <= 0:
                break
            if seq not in self.running:
                continue
            chunk = self._prefill_chunk(seq, budget, protect)
            if chunk:
                prefill.append(chunk)
                budget -= chunk.length
        self._admit_waiting(budget, protect, prefill)
        if prefill:  # one decode token per row beside prefill (see the module docstring)
            decode = [dataclasses.replace(r, steps=1) for r in decode]
            prefill.sort(key=lambda c: -c.length)  # longest first: see the module docstring
        if self.snapshots:
            self.snapshots.plan_decode(decode)
        num_steps = max((r.steps for r in decode), default=1)
        num_steps = min(c for c in self.step_counts if c >= num_steps)
        self.admission.step(num_steps if decode else 1)
        return ScheduledStep(decode, prefill, self._preempted, num_steps)

    def _admit_waiting(self, budget: int, protect: set, prefill: list) -> None:
        """Admit waiting sequences in arrival order while the policy lets them start
        (never preempting to admit), appending their first chunks to ``prefill``."""
        rows = None  # the running sequences' futures (Admission.rows), computed if needed
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted with tokens in flight: prefill needs their values
            if rows is None:
                rows = self.admission.rows(self.running)
            if not self._admit(seq, budget, rows):
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunk = self._prefill_chunk(seq, budget, protect)
            prefill.append(chunk)
            budget -= chunk.length
            rows = self.admission.extend(rows, seq)

    def _admit(self, seq: Sequence, budget: int, rows) -> bool:
        """Map the cached pages ``seq``'s tokens start with, if the admission policy lets it
        start (``Admission.admits``; else change nothing and return False). ``rows``: the
        running sequences' futures, ``Admission.rows``."""
        assert not seq.pages and seq.num_cached == 0, "a waiting sequence holds no pages"
        hit = self.prefix_cache.match(seq.tokens, seq.page_keys) if self.prefix_cache else []
        run, restore = len(hit), 0
        if self.snapshots:  # the state after the pages too: the match ends at a snapshot
            hit, restore = self.snapshots.match(seq, hit)
        start = len(hit) * self.page_size
        n = min(seq.num_tokens - start, budget)
        free = self.allocator.num_free_after(sharing=hit)
        if not self.admission.admits(seq, hit, self._pages_for(start + n) - len(hit), free,
                                     rows, alone=not self.running):
            return False
        self.allocator.share(hit)
        seq.pages = list(hit)
        if self.scratch_state_slot:  # the cache has slot pools: the sequence's state slot
            seq.state_slot = self._free_states.pop()
        seq.num_cached = start
        seq.num_registered = len(hit)
        if self.snapshots:
            self.snapshots.admitted(seq, restore, run)
        if self.prefix_cache:
            self.prefix_cache.record(seq.num_tokens, start)
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = start
        return True

    def _prefill_chunk(self, seq: Sequence, budget: int, protect: set) -> PrefillChunk | None:
        n = min(seq.remaining, budget)
        if self.snapshots:  # chunks end on page boundaries (snapshot_policy)
            n = self.snapshots.chunk_length(seq, n)
        if not self._grow(seq, seq.num_cached + n, protect):
            return None
        protect.add(seq)
        chunk = PrefillChunk(seq, seq.num_cached, n)
        if self.snapshots:
            self.snapshots.on_chunk(chunk)
        return chunk
