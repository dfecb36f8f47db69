"""Bridge between the single-threaded ``LLMEngine`` and the asyncio HTTP server.

Ownership: one background thread (the *engine thread*) is the only caller of the engine.
The event loop enqueues commands (add, abort) that the engine thread drains between steps,
and receives results through per-request ``asyncio.Queue``s fed with ``call_soon_threadsafe``
(one call per step for all requests that changed).

Who frees a request's pages: the engine, when the request finishes or an abort command is
applied; a ``RequestStream`` closed before its request finished always sends that abort.

Failure isolation: an exception while handling one request's output finishes only that
request (with ``finish_reason="error"``) and aborts it in the engine; an exception from
``engine.step()`` itself cannot be attributed, so every request in flight is finished with an
error and aborted, and the thread keeps serving new requests. After
``UNHEALTHY_AFTER_FAILED_STEPS`` failed steps in a row the engine is taken as broken: new
requests get 503 and /health says 503, so that a supervisor restarts the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any

from jfp8kv.engine.errors import EngineOverloaded
from jfp8kv.serve.metrics import ServerMetrics

logger = logging.getLogger("jfp8kv.serve")

# A step failing this many times in a row marks the server unhealthy (/health -> 503).
UNHEALTHY_AFTER_FAILED_STEPS = 3
# engine.metrics() syncs with the device; while busy, refresh the snapshot at most this often.
METRICS_REFRESH_S = 0.1


class EngineUnavailable(RuntimeError):
    """New requests cannot be served now (HTTP 503): shutdown began or the engine is down."""


class ServerDraining(EngineUnavailable):
    """Raised for new requests once shutdown began."""


@dataclasses.dataclass(frozen=True)
class Update:
    """Cumulative state of one request, as seen by the HTTP layer.

    ``text`` is the text that is safe to emit: while the request runs, a trailing U+FFFD
    (an incomplete UTF-8 sequence that the next token may complete) is held back.
    ``finish_reason`` is None while running, else "stop", "length", "abort" or "error".
    ``logprobs`` / ``prompt_logprobs``: the engine output's (cumulative), when asked for.
    ``num_cached_tokens``: prompt tokens served from the prefix cache (``cached_tokens``).
    """

    text: str
    num_tokens: int
    num_prompt_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None
    num_cached_tokens: int = 0


@dataclasses.dataclass
class _ReqState:  # owned by the engine thread
    queue: asyncio.Queue
    arrival: float
    stop: tuple[str, ...] = ()
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    last_token_time: float | None = None


def safe_text(text: str, finished: bool, stop: tuple[str, ...] = ()) -> str:
    """The part of a request's cumulative text that can be streamed without retraction.

    While running, hold back (1) a trailing U+FFFD, which may be half a UTF-8 character, and
    (2) the longest suffix that is a prefix of a stop string: if the stop string completes,
    the engine cuts the text before it, and a stream must not have sent its beginning.
    """
    if finished:
        return text
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[:len(text) - hold]


class RequestStream:
    """Async iterator over the coalesced ``Update``s of one request; ``close()`` aborts it.

    Updates are cumulative, so when the consumer is slower than the engine only the newest
    queued update is yielded. Iteration ends after the update with a finish_reason.
    """

    def __init__(self, owner: "AsyncEngine", request_id: str, queue: asyncio.Queue):
        self.request_id = request_id
        self._owner = owner
        self._queue = queue
        self.finished = False
        self._closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self.finished:
            raise StopAsyncIteration
        update = await self._queue.get()
        while update.finish_reason is None and not self._queue.empty():
            update = self._queue.get_nowait()
        if update.finish_reason is not None:
            self.finished = True
        return update

    async def final(self) -> Update:
        """Consume the stream and return the last update (the finished one)."""
        last = None
        async for last in self:
            pass
        return last

    def close(self) -> None:
        """Idempotent: abort the request if it did not finish, and forget it."""
        if self._closed:
            return
        self._closed = True
        self._owner._release(self.request_id, abort=not self.finished)


class AsyncEngine:
    """Owns ``engine`` on a background thread; see the module docstring for the contract."""

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None, idle_wait_s: float = 1.0):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self._idle_wait_s = idle_wait_s
        self._cond = threading.Condition()
        self._commands: list[tuple] = []  # guarded by _cond
        self._stop = False  # guarded by _cond
        self._states: dict[str, _ReqState] = {}  # engine thread only
        self._inflight: set[str] = set()  # event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.draining = False
        self.failed_steps_in_a_row = 0
        self.thread_error: str | None = None
        self._metrics_time = 0.0  # engine thread only
        # The queue bound, checked on the event loop before a request crosses to the engine
        # thread: the waiting requests the engine last reported (written by the engine
        # thread after each command batch and step) plus the adds sent that it had not
        # applied yet: a request counts once, arriving, then waiting.
        # Under a burst the refused requests cost no round trip through the engine thread
        # (the engine's own check stays the authority). A hint older than an abort the loop
        # sent is not used (that abort may have freed a place).
        self._waiting_seen = (0, 0, 0)  # (waiting, aborts applied, adds applied): one tuple
        self._adds_sent = self._aborts_sent = 0  # event loop only
        self._adds_applied = self._aborts_applied = 0  # engine thread only

    # ---- event-loop side -------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; must be called from the event loop that will consume."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jfp8kv-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return alive and self.failed_steps_in_a_row < UNHEALTHY_AFTER_FAILED_STEPS

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def submit(self, request_id: str, prompt: str | list[int], params: Any) -> RequestStream:
        """Add a request; raises what ``engine.add_request`` raised (ValueError: a 400,
        EngineOverloaded: a 503), or EngineUnavailable (ServerDraining once shutdown began)."""
        if self.draining:
            raise ServerDraining("server is shutting down")
        if not self.healthy:
            raise EngineUnavailable(self.thread_error or "engine is unhealthy (steps keep failing)")
        bound = self.engine.max_queue_len
        waiting, aborts_seen, adds_seen = self._waiting_seen
        arriving = self._adds_sent - adds_seen
        if aborts_seen == self._aborts_sent and waiting + arriving >= bound:
            raise EngineOverloaded(f"{waiting} requests are waiting and {arriving} arriving "
                                   f"(max_queue_len={bound}); retry later")
        queue: asyncio.Queue = asyncio.Queue()
        accepted = self._loop.create_future()
        self._inflight.add(request_id)
        self._adds_sent += 1
        self._send(("add", request_id, prompt, params, queue, accepted, time.monotonic()))
        try:
            await accepted
        except asyncio.CancelledError:
            self._release(request_id, abort=True)
            raise
        except BaseException:
            self._inflight.discard(request_id)
            raise
        return RequestStream(self, request_id, queue)

    def _release(self, request_id: str, abort: bool) -> None:
        self._inflight.discard(request_id)
        if abort:
            self._aborts_sent += 1
            self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; requests still running are aborted."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- engine-thread side ----------------------------------------------------------
    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown: nobody is listening any more
            pass

    def _run(self) -> None:
        try:
            self._loop_body()
        except BaseException as e:  # the thread must not die silently
            logger.exception("engine thread crashed")
            self.thread_error = f"engine thread crashed: {e!r}"
            self._fail_all(self.thread_error)

    def _loop_body(self) -> None:
        self._refresh_engine_metrics()  # /metrics shows the pool from the first scrape on
        has_work = False
        while True:
            with self._cond:
                if not self._commands and not self._stop and not has_work:
                    self._cond.wait(self._idle_wait_s)
                commands, self._commands = self._commands, []
                stop = self._stop
            for command in commands:
                self._apply(command)
            self._publish_waiting()
            if stop:
                for rid in list(self._states):
                    self._abort(rid, "abort")
                self._refresh_engine_metrics()
                return
            has_work = self.engine.has_unfinished()
            if has_work:
                self._step()
                self._publish_waiting()
            if not has_work or time.monotonic() - self._metrics_time > METRICS_REFRESH_S:
                self._refresh_engine_metrics()

    def _publish_waiting(self) -> None:
        self._waiting_seen = (self.engine.num_waiting(), self._aborts_applied, self._adds_applied)

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self._abort(command[1], "abort")
            self._aborts_applied += 1
            return
        _, rid, prompt, params, queue, accepted, arrival = command
        self._adds_applied += 1  # waiting now, or refused: no longer arriving
        error = None
        try:
            self.engine.add_request(rid, prompt, params)
        except Exception as e:  # reported to the submitter (400 / 503 / 500)
            error = e
        else:
            self._states[rid] = _ReqState(queue=queue, arrival=arrival,
                                          stop=tuple(getattr(params, "stop", None) or ()))
        self._publish_waiting()  # before the answer: the loop counts this add once, always
        self._post(_settle, accepted, error)

    def _abort(self, rid: str, reason: str, error: str | None = None) -> None:
        try:
            self.engine.abort_request(rid)
        except Exception:
            logger.exception("abort_request(%s) failed", rid)
        state = self._states.pop(rid, None)
        if state is not None:
            self.metrics.requests.labels(finish_reason=reason).inc()
            update = Update("", state.num_tokens, state.num_prompt_tokens, reason, error,
                            num_cached_tokens=state.num_cached_tokens)
            self._post(state.queue.put_nowait, update)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.failed_steps_in_a_row += 1
            logger.exception("engine.step() failed; finishing %d requests with an error",
                             len(self._states))
            self._fail_all(f"engine step failed: {e!r}")
            return
        self.failed_steps_in_a_row = 0
        now = time.monotonic()
        batch = []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:  # aborted meanwhile
                continue
            try:
                update = self._observe(state, out, now)
            except Exception as e:
                logger.exception("handling output of %s failed", out.request_id)
                self._abort(out.request_id, "error", f"internal error: {e!r}")
                continue
            batch.append((state.queue, update))
            if update.finish_reason is not None:
                del self._states[out.request_id]
        if batch:
            self._post(_deliver, batch)

    def _observe(self, state: _ReqState, out: Any, now: float) -> Update:
        """Metrics for one output and the Update it becomes."""
        m = self.metrics
        n_new = len(out.token_ids) - state.num_tokens
        state.num_cached_tokens = getattr(out, "num_cached_tokens", 0)
        if n_new > 0:
            if state.last_token_time is None:
                m.ttft.observe(now - state.arrival)
                state.num_prompt_tokens = len(out.prompt_token_ids)
                m.prompt_tokens.inc(state.num_prompt_tokens)
                m.prompt_tokens_cached.inc(state.num_cached_tokens)
                n_itl, dt = 0, 0.0  # tokens that came with the first one have no gap
            else:
                n_itl, dt = n_new, (now - state.last_token_time) / n_new
            for _ in range(n_itl):
                m.itl.observe(dt)
            m.generated_tokens.inc(n_new)
            state.num_tokens += n_new
            state.last_token_time = now
        finished = out.finish_reason is not None
        if finished:
            state.num_prompt_tokens = len(out.prompt_token_ids)
            m.requests.labels(finish_reason=out.finish_reason).inc()
            m.e2e.observe(now - state.arrival)
        lp, plp = getattr(out, "logprobs", None), getattr(out, "prompt_logprobs", None)
        return Update(safe_text(out.text, finished, state.stop), state.num_tokens,
                      state.num_prompt_tokens, out.finish_reason,
                      logprobs=None if lp is None else tuple(lp),
                      prompt_logprobs=None if plp is None else tuple(plp),
                      num_cached_tokens=state.num_cached_tokens)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._states):
            self._abort(rid, "error", message)

    def _refresh_engine_metrics(self) -> None:
        self._metrics_time = time.monotonic()
        try:
            self.metrics.engine_snapshot = {**self.engine.metrics(),
                                            **_prefix_cache_metrics(self.engine)}
        except Exception:
            logger.exception("engine.metrics() failed")


def _prefix_cache_metrics(engine: Any) -> dict:
    """The scheduler's prefix-cache counters as engine-snapshot keys (``ServerMetrics``);
    none for an engine without a scheduler (the tests' stand-in). Engine thread only."""
    stats = getattr(getattr(engine, "scheduler", None), "prefix_cache_stats", None)
    if stats is None:
        return {}
    s = stats()
    return {"prefix_cache_queries_total": s.queried_tokens,
            "prefix_cache_hits_total": s.hit_tokens,
            "prefix_cache_pages": s.cached_pages,
            "prefix_cache_evictions_total": s.evictions}


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(batch: list[tuple[asyncio.Queue, Update]]) -> None:
    for queue, update in batch:
        queue.put_nowait(update)
