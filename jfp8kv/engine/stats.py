"""Per-step anatomy of the engine: where each ``LLMEngine.step`` spends its time, and what it
computed; and a process-wide count of XLA compilations.

``StepStats`` is off by default (``begin`` then hands out a record whose methods do nothing,
so the step pays one attribute test). Enabled, each step that runs something appends one
``StepRecord``:

* ``schedule_ms``: the scheduler's host work (``Scheduler.schedule``);
* ``device_ms``: from the end of scheduling until every output of the step is ready on the
  device (host-side dispatch, i.e. padding and copying the batch, is included: it is on
  the critical path until host work overlaps the device); with overlap scheduling, until
  the previous step's outputs are ready (the ones this step reads), so it holds this step's
  dispatch and the wait for the device;
* ``post_ms``: host post-processing after that (copies to the host, appending tokens, stop
  rules, detokenization, outputs);
* what the step computed: decode rows, decode tokens (useful ones: rows stop at their
  limit), decode iterations (the longest row's steps; the scan may run more, inactive),
  ``decode_kv_tokens`` (K/V tokens read over the decode iterations, a row at position p
  reading p + 1), prefill chunks and tokens, ``prefill_pairs`` (causal (query, key) pairs
  of the chunks), ``prefill_calls`` and ``prefill_slots`` (the runner's prefill dispatches
  and the padded [rows, chunk] token slots they compute: ``ModelRunner.prefill_slots``),
  and ``compiles`` (XLA compilations that happened inside the step).

``compile_count()`` counts backend compilations (persistent-cache hits included: they are
stalls too) through ``jax.monitoring``, from the first call on.
"""

from __future__ import annotations

import dataclasses
import threading
import time

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = {"count": 0, "seconds": 0.0}
_listener_lock = threading.Lock()
_listener_installed = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        _compiles["count"] += 1
        _compiles["seconds"] += float(duration)


def compile_count() -> tuple[int, float]:
    """(XLA compilations, their seconds) in this process since the first call of this
    function; the first call installs a ``jax.monitoring`` listener and returns (0, 0.0)."""
    global _listener_installed
    with _listener_lock:
        if not _listener_installed:
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listener_installed = True
    return _compiles["count"], _compiles["seconds"]


def causal_pairs(queries: int, prefix: int) -> int:
    """(query, key) pairs of a causal chunk of ``queries`` after ``prefix`` cached keys."""
    return queries * prefix + queries * (queries + 1) // 2


@dataclasses.dataclass
class StepRecord:
    """One engine step (see the module docstring for each field)."""

    schedule_ms: float = 0.0
    device_ms: float = 0.0
    post_ms: float = 0.0
    decode_rows: int = 0
    decode_tokens: int = 0
    decode_iterations: int = 0
    decode_kv_tokens: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    prefill_calls: int = 0
    prefill_slots: int = 0
    compiles: int = 0
    _t: float = dataclasses.field(default=0.0, repr=False)
    _compiles0: int = dataclasses.field(default=0, repr=False)

    def scheduled(self, plan, prefill_slots=None) -> None:
        """Call right after ``Scheduler.schedule`` returned ``plan``; ``prefill_slots``: the
        runner's ``prefill_slots`` (chunk lengths -> (dispatches, padded slots))."""
        now = time.perf_counter()
        self.schedule_ms = (now - self._t) * 1e3
        self._t = now
        for row in plan.decode:
            c, s = row.seq.num_cached, row.steps
            self.decode_tokens += s
            self.decode_kv_tokens += s * c + s * (s + 1) // 2
            self.decode_iterations = max(self.decode_iterations, s)
        self.decode_rows = len(plan.decode)
        for ch in plan.prefill:
            n = ch.length
            self.prefill_tokens += n
            self.prefill_pairs += causal_pairs(n, ch.start)
        self.prefill_chunks = len(plan.prefill)
        if prefill_slots is not None and plan.prefill:
            self.prefill_calls, self.prefill_slots = prefill_slots(
                [ch.length for ch in plan.prefill])

    def synced(self, *outputs) -> None:
        """Call after the step's device calls were dispatched: waits for ``outputs`` (device
        arrays or None) to be ready."""
        import jax

        jax.block_until_ready([o for o in outputs if o is not None])
        now = time.perf_counter()
        self.device_ms = (now - self._t) * 1e3
        self._t = now


class _NullRecord:
    def scheduled(self, plan, prefill_slots=None) -> None:
        pass

    def synced(self, *outputs) -> None:
        pass


_NULL = _NullRecord()


class StepStats:
    """Collects a ``StepRecord`` per engine step while enabled. Not thread-safe: the engine's
    thread alone calls ``begin``/``end``."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.records: list[StepRecord] = []

    def enable(self, on: bool = True) -> None:
        self.enabled = on
        if on:
            compile_count()  # the listener must exist before the first recorded step

    def reset(self) -> None:
        self.records = []

    def begin(self):
        """Call at the start of a step, before scheduling."""
        if not self.enabled:
            return _NULL
        return StepRecord(_t=time.perf_counter(), _compiles0=compile_count()[0])

    def end(self, rec) -> None:
        """Call when the step's outputs are built; records it (nothing when disabled)."""
        if rec is _NULL:
            return
        rec.post_ms = (time.perf_counter() - rec._t) * 1e3
        rec.compiles = compile_count()[0] - rec._compiles0
        self.records.append(rec)

    def summary(self) -> dict:
        """Totals over the recorded steps: steps, the three times in ms, and every count."""
        out = {"steps": len(self.records)}
        for f in dataclasses.fields(StepRecord):
            if not f.name.startswith("_"):
                out[f.name] = sum(getattr(r, f.name) for r in self.records)
        for k in ("schedule_ms", "device_ms", "post_ms"):
            out[k] = round(out[k], 3)
        out["decode_dispatches"] = sum(1 for r in self.records if r.decode_rows)
        out["prefill_dispatches"] = sum(1 for r in self.records if r.prefill_chunks)
        return out
