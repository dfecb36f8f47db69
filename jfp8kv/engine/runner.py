"""Shape-bucketed calls of the device steps (``steps.py``) over the paged cache.

The runner owns the device state (params, cache) and turns host batches into three kinds of
dispatch, each a jitted pure function (``steps``) compiled once per bucket:

* ``prefill``: a padded batch of new-token chunks [B, T]; samples one token per row from
  the last real position (used only by rows whose chunk completes their prompt).
* ``decode``: ``num_steps`` decode steps in one dispatch (a ``lax.scan``), sampling on
  device and feeding each token back; slots are computed on device from the page tables.
* ``nll``: teacher-forced next-token NLL of a chunk, through the cache like ``prefill``
  (``score``: the log-prob of each next prompt token, through a prefill dispatch).

Buckets: batch sizes and chunk lengths are padded to powers of two (or the given decode
buckets). A prefill dispatch is at most ``prefill_area`` padded tokens (the bucket of one
full-budget chunk): a step's chunks are cut into consecutive groups that fit
(``prefill_groups``). The decode page-table width is fixed (max_model_len / page_size)
unless ``page_widths`` is given: then it is the smallest of those that holds every row's
pages (the reference backend reads every page in the table; the Pallas decode kernel stops
at each row's length). So the shapes are finite: ``warmup_shapes`` lists them all, and
nothing compiles after ``warmup``. On CPU the matmul weights are held in float32.

With snapshot slots every prefill row carries (restore, capture) slots and every decode row
(capture step, capture slot); ``steps`` runs the copies. Tensor parallelism: ``tp`` (a
``models.sharding.TensorParallel``; None on one device) is passed to the steps; params and
cache arrive placed on the mesh, host arrays are replicated by jit.
"""

from __future__ import annotations

import jax
import numpy as np

from jfp8kv.config import ModelConfig
from jfp8kv.engine import startup_profile, steps
from jfp8kv.engine.compile_cache import compile_fresh
from jfp8kv.engine.device_policy import cpu_float32_weights
from jfp8kv.engine.sampler import SamplingArrays
from jfp8kv.engine.variants import Variants
from jfp8kv.kvcache.cache_tree import Cache

_STATIC = ("cfg", "backend", "tp", "all_greedy", "num_steps")  # the steps' static arguments


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    b = max(minimum, 1 << max(0, (n - 1).bit_length()))
    return b if maximum is None else min(b, max(maximum, n))


class ModelRunner:
    """Owns params and the cache; turns host-side batch descriptions into device calls."""

    def __init__(self, model_cfg: ModelConfig, params, cache: Cache, backend: str,
                 max_pages_per_seq: int, decode_buckets: tuple[int, ...] | None = None,
                 min_chunk: int = 16, page_widths: tuple[int, ...] | None = None,
                 prefill_one_row: bool = False, chunk_factor: int = 2,
                 max_chunk: int | None = None, tp=None, decode_gemm_autotune: str = "default",
                 feature_executables: str = "switched"):
        """``decode_buckets``: allowed decode batch sizes (None: powers of two). Decode is
        memory-bound, so padding a batch up to a coarse bucket costs little and saves
        compiles. ``min_chunk``: the smallest prefill chunk bucket. ``page_widths``: decode
        page-table widths (None: max_pages_per_seq only). ``prefill_one_row``: dispatch each
        prefill chunk alone (batch 1), so prefill compiles once per chunk bucket.
        ``chunk_factor``: chunk buckets grow by this factor from ``min_chunk``, capped at
        the bucket of ``max_chunk``. On a CPU device the matmul weights are held in float32.
        ``cache``: the ``Cache`` (or its shapes, ``jax.eval_shape`` of one, to compile before
        the pool is allocated: set ``runner.cache`` to the allocated cache before a step runs).
        ``feature_executables``: which executables each shape compiles (``variants.Variants``;
        on a CPU device, where a compile costs more than a branch, plain decode shares the
        switched one). ``tp``: the ``models.sharding.TensorParallel`` that params and cache
        are placed on, or None. ``decode_gemm_autotune``: which of ``steps.DECODE_JITS`` runs
        the decode steps."""
        self.cfg = model_cfg
        self.on_cpu = on_cpu = all(d.platform == "cpu"
                                   for d in jax.tree_util.tree_leaves(params)[0].devices())
        self.params = cpu_float32_weights(params) if on_cpu else params
        self.cache = cache
        self.backend = backend
        self.page_size = cache.plan.page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.decode_buckets = tuple(sorted(decode_buckets)) if decode_buckets else None
        self.min_chunk = min_chunk
        widths = sorted({min(w, max_pages_per_seq) for w in page_widths or ()})
        self.page_widths = tuple(w for w in widths if w < max_pages_per_seq) + (max_pages_per_seq,)
        self.prefill_one_row = prefill_one_row
        self.chunk_factor = chunk_factor
        self.max_chunk = max_chunk
        self.variants = Variants(feature_executables, on_cpu, max_pages_per_seq * self.page_size)
        # Rows carry state slots where the layout has slot pools, snapshot copies with snapshots
        self.slotted = cache.plan.num_slots > 0
        self.snapshots = cache.plan.num_snapshots > 0
        self.tp = tp
        self._decode = steps.DECODE_JITS[decode_gemm_autotune]
        self._labels = {steps.prefill: "prefill", self._decode: f"decode:{decode_gemm_autotune}"}
        # Signature (``_signature``) -> jax.stages.Compiled: the executables ``precompile``
        # compiled or loaded from an ``ExecutableStore``; a dispatch whose signature is here
        # calls it directly, anything else goes through the jitted function.
        self._executables: dict = {}
        self.stored_loads = 0  # executables ``compile_only`` took from an ExecutableStore
        self.store = None  # the ExecutableStore of registered executables (compile_variant)

    def device_memory(self) -> dict:
        """``memory.device_counts`` of the device the params live on (the first)."""
        from jfp8kv.engine.memory import device_counts

        return device_counts(next(iter(jax.tree_util.tree_leaves(self.params)[0].devices())))

    def decode_bucket(self, n: int) -> int:
        if self.decode_buckets is None:
            return bucket(n)
        return next((b for b in self.decode_buckets if b >= n), bucket(n))

    def chunk_bucket(self, n: int) -> int:
        """The prefill chunk length bucket for ``n`` tokens."""
        t = bucket(1, self.min_chunk)
        while t < n:
            t *= self.chunk_factor
        cap = bucket(self.max_chunk, self.min_chunk) if self.max_chunk else None
        return min(t, cap) if cap and n <= cap else max(t, bucket(n, self.min_chunk))

    def prefill_area(self) -> int | None:
        """The most padded tokens (rows x chunk bucket) one prefill dispatch holds: the
        bucket of a single full-budget chunk (None without ``max_chunk``: no cap)."""
        return self.chunk_bucket(self.max_chunk) if self.max_chunk else None

    def prefill_groups(self, lengths: list[int]) -> list[tuple[int, int]]:
        """Consecutive [start, end) ranges of chunks (by their token counts), each one padded
        [bucket(rows), chunk_bucket(longest)] dispatch within ``prefill_area`` of chunks in
        one chunk bucket (so a short chunk is not padded to a long one's length; the
        scheduler hands chunks over longest first); one range per chunk with one-row
        prefill."""
        if self.prefill_one_row:
            return [(i, i + 1) for i in range(len(lengths))]
        area, groups, start = self.prefill_area(), [], 0
        for i, n in enumerate(lengths):
            cb = self.chunk_bucket(lengths[start])  # every chunk of the group has this bucket
            if i > start and (self.chunk_bucket(n) != cb
                              or (area and bucket(i + 1 - start) * cb > area)):
                groups.append((start, i))
                start = i
        return groups + [(start, len(lengths))]

    def prefill_slots(self, lengths: list[int]) -> tuple[int, int]:
        """(dispatches, padded token slots) that ``prefill`` spends on chunks of ``lengths``."""
        groups = self.prefill_groups(lengths)
        return len(groups), sum(bucket(b - a) * self.chunk_bucket(max(lengths[a:b]))
                                for a, b in groups)

    def page_width(self, num_pages: int) -> int:
        """The decode page-table width for rows owning at most ``num_pages`` pages."""
        return next(w for w in self.page_widths if w >= num_pages)

    def warmup_shapes(self, max_num_seqs: int, max_num_batched_tokens: int,
                      step_counts: tuple[int, ...] = (1,)):
        """(kind, batch, length, page-table width) of every shape ``decode`` and ``prefill``
        can dispatch: each decode bucket up to max_num_seqs at each page width and each
        scan length in ``step_counts`` (decode's "length"), and each prefill (rows bucket,
        chunk bucket) within ``prefill_area`` (rows 1 with one-row prefill, or with no area
        cap, where wider batches compile on first use)."""
        dec = sorted({self.decode_bucket(n) for n in range(1, max_num_seqs + 1)})
        lens = sorted({self.chunk_bucket(n) for n in range(1, max_num_batched_tokens + 1)})
        area = None if self.prefill_one_row else self.prefill_area()
        rows = [1 << i for i in range(bucket(max_num_seqs).bit_length())] if area else [1]
        return ([("decode", b, n, w) for b in dec for n in step_counts for w in self.page_widths]
                + [("prefill", b, t, self.max_pages_per_seq) for t in lens for b in rows
                   if b == 1 or b * t <= area])

    def _warm_call(self, kind, b, t, w, greedy, cache, switched: bool | None = None):
        """(jitted function, args, static kwargs) of one warm-up dispatch on zeros (a decode
        shape's length ``t`` is its scan length); ``switched``: its structure (None: a plain
        request's, ``Variants.switched``)."""
        v = self.variants
        switched = v.switched(kind, False) if switched is None else switched
        z = np.zeros(b, np.int32)
        pt = np.zeros((b, w), np.int32)
        zz = np.zeros((b, t), np.int32)
        sampling = v.sampling(SamplingArrays.empty(b), b, switched).args()
        kw = dict(cfg=self.cfg, backend=self.backend, all_greedy=greedy, tp=self.tp,
                  state_slots=self._state_slots([], b))
        if kind == "decode":
            return (self._decode, (self.params, cache, z, z, pt, z, *sampling),
                    dict(kw, num_steps=t, captures=self._snapshot_pairs([], b, -1)))
        return steps.prefill, (self.params, cache, zz, zz, zz, pt, z, z, *sampling,
                               v.scoring(b, t, None, switched)), dict(
                                   kw, snapshots=self._snapshot_pairs([], b, 0))

    def _state_slots(self, slots: list[int], b: int):
        """int32[b] state slots of the rows (0: the padding slot); None without slot pools."""
        if not self.slotted:
            return None
        out = np.zeros(b, np.int32)
        out[:len(slots)] = slots
        return out

    def _snapshot_pairs(self, pairs: list[tuple[int, int]], b: int, none: int):
        """(int32[b], int32[b]) of the rows' snapshot pairs (padding: (none, 0)), or None."""
        if not self.snapshots:
            return None
        out = np.zeros((2, b), np.int32)
        out[0] = none
        out[:, :len(pairs)] = np.asarray(pairs, np.int32).T.reshape(2, -1)
        return out[0], out[1]

    def warmup(self, shapes, progress: bool = True) -> None:
        """Compile (and run once, writing only to the sink page) each shape, in every
        variant (``Variants.of``)."""
        from tqdm import tqdm

        for shape in tqdm(shapes, desc="compiling buckets", disable=not progress):
            for greedy, switched in self.variants.of(shape[0]):
                fn, args, kw = self._warm_call(*shape, greedy, self.cache, switched)
                toks, self.cache = self._call(fn, args, kw)
            jax.block_until_ready(toks)

    def _signature(self, fn, args, kw):
        """What picks an executable besides params and cache (fixed per runner): the step,
        its sampler mode and scan length, and the host arguments' tree, shapes and dtypes."""
        leaves, tree = jax.tree.flatten((args[2:], {k: v for k, v in kw.items()
                                                    if k not in _STATIC}))
        return (self._labels[fn], kw.get("all_greedy"), kw.get("num_steps"), tree,
                tuple((x.shape, str(x.dtype)) for x in leaves))

    def _call(self, fn, args, kw):
        """``fn(*args, **kw)``, through the executable ``precompile`` left for this
        signature when there is one (same program: it was lowered from these arguments)."""
        if self._executables:
            ex = self._executables.get(self._signature(fn, args, kw))
            if ex is not None:
                return ex(*args, **{k: v for k, v in kw.items() if k not in _STATIC})
        return fn(*args, **kw)

    def compile_only(self, shapes, abstract, store=None, register=False) -> int:
        """Compile each shape's variants without running them or touching the cache: what
        it gains is the persistent compilation cache's entry, which the first real dispatch
        of the shape loads instead of compiling, or with ``register`` the executable that
        dispatch calls (a variant registered already is not compiled again). ``abstract``:
        the cache or its shapes; ``store``: an ``ExecutableStore`` whose entry replaces
        tracing, lowering and compiling when it has one (and gets the result when not).
        Returns the number of shapes compiled."""
        for shape in shapes:
            for greedy, switched in self.variants.of(shape[0]):
                self.compile_variant(shape, greedy, switched, abstract, store, register)
        return len(shapes)

    def compile_variant(self, shape, greedy, switched, abstract, store=None, register=False):
        """The compiled executable of one (shape, variant) against the ``abstract`` cache:
        registered already, loaded from ``store`` (with ``register``: ``self.store`` unless
        given), or traced, lowered and compiled."""
        store = self.store if store is None and register else store
        fn, args, kw = self._warm_call(*shape, greedy, abstract, switched)
        sig = self._signature(fn, args, kw)
        if register and sig in self._executables:
            return self._executables[sig]
        key = compiled = None
        clock = startup_profile.Clock(self._labels[fn], shape, greedy, switched)
        if store is not None and self.tp is None:
            dynamic = {k: v for k, v in kw.items() if k not in _STATIC}  # their structure too
            key = store.key(self._labels[fn], (args, dynamic),
                            {k: v for k, v in kw.items() if k in _STATIC})
            compiled = store.load(key)
            self.stored_loads += compiled is not None
        if compiled is None:
            compiled, fresh = compile_fresh(clock.lowered(fn.lower(*args, **kw)))
            clock.done("compiled" if fresh else "jax-cache")
            if key is not None and fresh:
                store.save(key, compiled)
        else:
            clock.done("store")
        if register:
            self._executables[sig] = compiled
        return compiled

    def precompile(self, shapes, workers: int, progress: bool = False, store=None) -> int:
        """Compile ``shapes`` on ``workers`` threads (XLA compiles, and loads executables from
        the persistent cache, outside the GIL; tracing holds it, so one thread traces while
        another compiles) without running them. Lowered from the live cache arrays, they are
        the executables the jitted calls look up, so a following ``warmup`` (or first use)
        compiles nothing (and the persistent cache, when on, gets them too); each is also
        registered for direct dispatch. ``store``: an ``ExecutableStore`` to load them from
        (no tracing) or save them to (default ``self.store``). ``progress``: a progress bar
        per shape. Returns the number of shapes compiled."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from tqdm import tqdm

        cache = self.cache  # lowered from the live arrays (read, not donated: nothing runs)
        done = 0
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="jfp8kv-precompile") as ex, \
                tqdm(total=len(shapes), desc="compiling buckets", disable=not progress) as bar:
            for fut in as_completed([ex.submit(self.compile_only, [x], cache, store=store,
                                               register=True) for x in shapes]):
                done += fut.result()
                bar.update()
        return done

    def _page_table(self, rows: list[list[int]], b: int, width: int | None = None) -> np.ndarray:
        # prefill keeps the fixed width (one compile per bucket); decode passes its width
        pt = np.zeros((b, width or self.max_pages_per_seq), np.int32)
        for i, r in enumerate(rows):
            pt[i, :len(r)] = r
        return pt

    def _chunk_arrays(self, chunks, b: int, t: int):
        """chunks: list of (token_ids, start_pos, pages[, state slot, restore, capture]).
        Returns padded host arrays."""
        ps = self.page_size
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        slots = np.zeros((b, t), np.int32)
        seq_lens = np.zeros(b, np.int32)
        last_idx = np.zeros(b, np.int32)
        for i, (ids, start, pages, *_) in enumerate(chunks):
            n = len(ids)
            pos = np.arange(start, start + n)
            tokens[i, :n] = ids
            positions[i, :n] = pos
            positions[i, n:] = start + n - 1
            slots[i, :n] = np.asarray(pages, np.int32)[pos // ps] * ps + pos % ps
            seq_lens[i] = start + n
            last_idx[i] = n - 1
        pt = self._page_table([c[2] for c in chunks], b)
        return tokens, positions, slots, pt, seq_lens, last_idx

    def prefill(self, chunks, sampling: SamplingArrays) -> list[tuple[int, object]]:
        """One dispatch per ``prefill_groups`` range, in chunk order. Returns [(rows, out)]:
        ``out`` the dispatch's device output (int32[>= rows] sampled tokens, or (tokens,
        log-probs)), whose first ``rows`` rows belong to the range's chunks."""
        parts = []
        for start, end in self.prefill_groups([len(c[0]) for c in chunks]):
            part = chunks[start:end]
            t = self.chunk_bucket(max(len(c[0]) for c in part))
            parts.append((len(part), self._prefill_call(part, bucket(len(part)), t,
                                                        sampling.rows(start, end))))
        return parts

    def _prefill_call(self, chunks, b: int, t: int, sampling: SamplingArrays, targets=None):
        """One ``steps.prefill`` dispatch of ``chunks`` padded to [b, t] -> its output; with
        ``targets`` (int32[b, t], prompt scoring) (output, scores)."""
        tokens, positions, slots, pt, seq_lens, last_idx = self._chunk_arrays(chunks, b, t)
        v = self.variants
        switched = v.switched("prefill", sampling.extras is not None or targets is not None)
        scoring = v.scoring(b, t, targets, switched)
        out, self.cache = self._call(steps.prefill, (
            self.params, self.cache, tokens, positions, slots, pt, seq_lens, last_idx,
            *v.sampling(sampling, b, switched).args(), scoring), dict(
                cfg=self.cfg, backend=self.backend, all_greedy=None, tp=self.tp,
                state_slots=self._state_slots([c[3] if len(c) > 3 else 0 for c in chunks], b),
                snapshots=self._snapshot_pairs([c[4:6] if len(c) > 4 else (0, 0)
                                                for c in chunks], b, 0)))
        return out if targets is not None or scoring is None else out[0]

    def decode(self, rows, sampling: SamplingArrays, all_greedy: bool, num_steps: int,
               input_tokens=None):
        """rows: list of (last_token, position, pages, limit[, state slot, capture step,
        capture slot]). Returns int32[B_bucket, steps].
        ``input_tokens``: a device int32[B_bucket] used instead of the rows' last tokens
        (overlap scheduling feeds tokens the host has not read yet)."""
        b = self.decode_bucket(len(rows))
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        limits = np.zeros(b, np.int32)
        for i, (tok, pos, _, lim, *_) in enumerate(rows):
            tokens[i], positions[i], limits[i] = tok, pos, lim
        pages = [r[2] for r in rows]
        pt = self._page_table(pages, b, self.page_width(max(len(p) for p in pages)))
        tokens = tokens if input_tokens is None else input_tokens
        if self.tp is not None:  # one input placement, whether host- or device-made
            tokens = self.tp.replicate(tokens)
        switched = self.variants.switched("decode", sampling.extras is not None)
        toks, self.cache = self._call(self._decode, (
            self.params, self.cache, tokens, positions, pt, limits,
            *self.variants.sampling(sampling, b, switched).args()), dict(
                cfg=self.cfg, backend=self.backend, all_greedy=None if switched else all_greedy,
                tp=self.tp, num_steps=num_steps, state_slots=self._state_slots(
                    [r[4] if len(r) > 4 else 0 for r in rows], b),
                captures=self._snapshot_pairs([r[5:7] if len(r) > 5 else (-1, 0)
                                               for r in rows], b, -1)))
        return toks

    def score(self, ids, targets, start: int, pages, state_slot: int = 0):
        """One prompt chunk through a one-row prefill dispatch, scored: device arrays
        (log-prob [1, t] of each target, top values [1, t, K], top ids [1, t, K]), t >=
        len(ids) (a chunk bucket); only the first len(ids) positions are real."""
        t = self.chunk_bucket(len(ids))
        tgt = np.zeros((1, t), np.int32)
        tgt[0, :len(targets)] = targets
        return self._prefill_call([(ids, start, pages, state_slot)], 1, t,
                                  SamplingArrays.empty(1), tgt)[1]

    def nll(self, ids, targets, start: int, pages, state_slot: int = 0):
        """One teacher-forced chunk -> device arrays (nll [t], logits [t, V]), t >= len(ids)
        (a bucket); only the first len(ids) rows are real. Nothing is copied to the host."""
        t = bucket(len(ids), 16)
        tokens, positions, slots, pt, seq_lens, _ = self._chunk_arrays([(ids, start, pages)], 1, t)
        tgt = np.zeros((1, t), np.int32)
        tgt[0, :len(targets)] = targets
        nll, logits, self.cache = steps.nll(self.params, self.cache, tokens, positions, slots, pt,
                                       seq_lens, tgt, cfg=self.cfg, backend=self.backend,
                                       tp=self.tp,
                                       state_slots=self._state_slots([state_slot], 1))
        return nll[0], logits[0]
