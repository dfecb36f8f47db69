"""What the routes do: validate a request into a ``Job``, fan it out into engine requests,
and answer with one body or a stream of chunks.

A request with ``n`` choices (or ``best_of`` candidates) becomes that many engine requests
(ids ``<id>-<i>``; with a ``seed``, choice i samples with ``seed + i``); their updates are
merged into one response, choices indexed 0..n-1, usage summed over them (the prompt counted
once: its ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` are those of engine
request 0, the first admitted; the others may find more of the prompt cached). Every engine request is aborted if the client goes away or the handler fails: each
``RequestStream`` is closed in a ``finally``; the same happens past ``--request-timeout``
(``ServerLimits.request_timeout_s``): a 408, or an error event ending the stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from jfp8kv.engine.errors import EngineOverloaded
from jfp8kv.engine.types import SamplingParams, TokenLogprob
from jfp8kv.serve import protocol as P
from jfp8kv.serve.limits import ServerLimits, work_problem
from jfp8kv.serve.async_engine import (AsyncEngine, EngineUnavailable, RequestStream,
                                       ServerDraining, Update)
from jfp8kv.serve.responses import ChatFormat, Choice, CompletionFormat, usage_chunk

logger = logging.getLogger("jfp8kv.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclasses.dataclass
class Job:
    """One validated request. ``echo_text``: prepended to each choice (completions echo);
    ``num_top``: the log-probs the client asked for (None: none shown)."""

    id_prefix: str
    prompt_ids: list[int]
    params: SamplingParams
    fmt: Any  # CompletionFormat | ChatFormat
    n: int = 1
    best_of: int = 1
    stream: bool = False
    include_usage: bool = False
    echo_text: str | None = None
    num_top: int | None = None

    @property
    def chat(self) -> bool:
        return isinstance(self.fmt, ChatFormat)


@dataclasses.dataclass
class _ChoiceState:  # what one streamed choice has sent so far
    text: str = ""
    num_logprobs: int = 0
    offset: int = 0
    echoed: bool = False


@dataclasses.dataclass
class OpenAIServing:
    """Holds the engine bridge, tokenizer and names that every route needs (``model``: the
    name clients use)."""

    engine: AsyncEngine
    model: str
    tokenizer: Any
    chat_prompt: Callable[[list[dict]], str]
    max_model_len: int
    vocab_size: int | None = None
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    _token_text: dict[int, str] = dataclasses.field(default_factory=dict, repr=False)

    def token_text(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode([token_id])
        return self._token_text[token_id]

    # -- validation ---------------------------------------------------------------------
    def _check_common(self, req: P._SamplingFields) -> None:
        if req.model is not None and req.model != self.model:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves "
                           f"{self.model!r}", "model", "model_not_found")
        bad = req.unsupported()
        if bad is not None:
            raise ApiError(400, bad[1], bad[0], "unsupported")

    def _check_token_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ApiError(400, "prompt must not be empty", "prompt", "invalid_value")
        limit = self.vocab_size
        bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is out of range [0, {limit})",
                           "prompt", "invalid_value")

    def _max_tokens(self, requested: int | None, default: int, num_prompt: int, where: str,
                    param: str, allow_zero: bool = False) -> int:
        """vLLM's rule: the prompt plus max_tokens must fit in max_model_len."""
        if requested == 0 and not allow_zero:
            raise ApiError(400, f"{param} must be >= 1 (0 only with echo and logprobs on "
                           "/v1/completions, to score a prompt)", param, "invalid_value")
        if num_prompt >= self.max_model_len and requested != 0:
            raise ApiError(400, f"the prompt has {num_prompt} tokens; max_model_len is "
                           f"{self.max_model_len} and at least one token must be generated",
                           where, "context_length_exceeded")
        if requested is None:
            return min(default, self.max_model_len - num_prompt)
        if num_prompt + requested > self.max_model_len:
            raise ApiError(400, f"this model's maximum context length is {self.max_model_len} "
                           f"tokens, but {num_prompt + requested} were requested ({num_prompt} "
                           f"in the {where}, {requested} in the completion); reduce the "
                           f"{where} or {param}", param, "context_length_exceeded")
        return requested

    def _job(self, req: P._SamplingFields, prefix: str, ids: list[int], max_tokens: int,
             fmt_cls, explicit: bool, **params) -> Job:
        """``explicit``: the client set max_tokens (only then is the pool bound checked)."""
        num_top = req.num_logprobs()
        best_of = req.best_of or req.n
        try:
            sp = req.sampling_params(max_tokens, **params)
            if best_of > req.n and sp.logprobs is None:  # ranking needs the log-probs
                sp = dataclasses.replace(sp, logprobs=0)
        except ValueError as e:
            raise ApiError(400, str(e), None, "invalid_value") from None
        scored = len(ids) if sp.prompt_logprobs is not None else 0
        bad = work_problem(best_of, len(ids), max_tokens, num_top, scored,
                           self.limits.pool_tokens, explicit)
        if bad is not None:
            raise ApiError(400, bad[1], bad[0], "request_too_large")
        return Job(prefix, ids, sp, fmt_cls(self.model, self.token_text, num_top or 0),
                   n=req.n, best_of=best_of, stream=req.stream,
                   include_usage=req.include_usage, num_top=num_top)

    def completion_job(self, req: P.CompletionRequest) -> Job:
        self._check_common(req)
        try:
            prompt = req.single_prompt()
        except ValueError as e:
            raise ApiError(400, str(e), "prompt", "invalid_value") from None
        if isinstance(prompt, list):
            self._check_token_ids(prompt)
            ids, text = prompt, None
        elif not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt", "invalid_value")
        else:
            ids, text = list(self.tokenizer.encode(prompt)), prompt
        self._check_token_ids(ids)
        max_tokens = self._max_tokens(req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, len(ids),
                                      "prompt", "max_tokens", allow_zero=req.echo)
        scored = req.echo and (req.logprobs is not None or max_tokens == 0)
        job = self._job(req, "cmpl", ids, max_tokens, CompletionFormat, req.max_tokens is not None,
                        prompt_logprobs=(req.logprobs or 0) if scored else None)
        if req.echo:
            job.echo_text = text if text is not None else self.tokenizer.decode(ids)
        return job

    def chat_job(self, req: P.ChatCompletionRequest) -> Job:
        self._check_common(req)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise ApiError(400, str(e), "messages", "invalid_value") from None
        try:
            text = self.chat_prompt(messages)
        except ImportError as e:  # a dependency missing on the server: not the client's fault
            raise ApiError(500, f"chat template unavailable on this server: {e}", None,
                           "internal_error", "server_error") from None
        except Exception as e:  # template errors are caused by the messages
            raise ApiError(400, f"chat template failed: {e}", "messages", "invalid_value") from None
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(req.effective_max_tokens(), self.max_model_len, len(ids),
                                      "messages", param)
        return self._job(req, "chatcmpl", ids, max_tokens, ChatFormat,
                         req.effective_max_tokens() is not None)

    # -- running ------------------------------------------------------------------------
    async def run(self, job: Job, request: Request):
        rid = P.new_id(job.id_prefix)
        timeout = self.limits.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = await self._submit_all(rid, job)
        if job.stream:
            return self._streaming(streams, rid, job, deadline)
        finals = await _collect_all(streams, request, deadline)
        if finals is None:
            return Response(status_code=499)
        if finals == "timeout":
            self.engine.metrics.timeouts.inc()
            raise self._timeout_error()
        for f in finals:
            if f.finish_reason == "error":
                raise ApiError(500, f.error or "generation failed", None, "internal_error",
                               "server_error")
        ranked = range(len(finals))
        if job.best_of > job.n:  # the n candidates of highest cumulative log-prob
            ranked = sorted(ranked, key=lambda i: -sum(e.logprob for e in finals[i].logprobs))
        choices = [self._choice(job, i, finals[k]) for i, k in enumerate(list(ranked)[:job.n])]
        return job.fmt.response(rid, choices, finals[0].num_prompt_tokens,
                                sum(f.num_tokens for f in finals), finals[0].num_cached_tokens)

    async def _submit_all(self, rid: str, job: Job) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i in range(job.best_of):
                params = job.params
                if job.best_of > 1 and params.seed is not None:
                    params = dataclasses.replace(params, seed=params.seed + i)
                sub_id = rid if job.best_of == 1 else f"{rid}-{i}"
                streams.append(await self._submit(sub_id, job.prompt_ids, params))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    def _timeout_error(self) -> ApiError:
        return ApiError(408, f"the request ran past the server's --request-timeout of "
                        f"{self.limits.request_timeout_s:g} s and was aborted", None,
                        "request_timeout", "timeout_error")

    async def _submit(self, rid: str, prompt, params) -> RequestStream:
        try:
            return await self.engine.submit(rid, prompt, params)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt", "invalid_value") from None
        except (ServerDraining, EngineOverloaded, EngineUnavailable) as e:
            # Draining, the waiting queue at --max-queued-requests, or the engine down
            code = ("shutting_down" if isinstance(e, ServerDraining) else
                    "server_overloaded" if isinstance(e, EngineOverloaded) else "unhealthy")
            self.engine.metrics.rejected.labels(reason=code).inc()
            raise ApiError(503, str(e), None, code, "server_error") from None

    @staticmethod
    def _choice(job: Job, index: int, final: Update) -> Choice:
        entries = None
        if job.num_top is not None:
            prompt = _echoed_logprobs(job, final) if job.echo_text is not None else []
            entries = prompt + list(final.logprobs or ())
        return Choice(index, (job.echo_text or "") + final.text, final.finish_reason, entries)

    def _streaming(self, streams: list[RequestStream], rid: str, job: Job,
                   deadline: float | None) -> StreamingResponse:
        def close_all():
            for s in streams:
                s.close()

        return StreamingResponse(self._events(streams, rid, job, deadline),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(close_all))

    async def _events(self, streams: list[RequestStream], rid: str, job: Job,
                      deadline: float | None):
        created = int(time.time())
        states = [_ChoiceState() for _ in streams]
        last: list[Update | None] = [None] * len(streams)
        failed = False
        try:
            if job.chat:
                for i in range(len(streams)):
                    yield _sse(job.fmt.chunk(rid, created, Choice(i, "", None),
                                             job.include_usage, first=True))
            async for i, update in _merge(streams, deadline):
                if update is None:  # past the deadline: the finally aborts every choice
                    self.engine.metrics.timeouts.inc()
                    e = self._timeout_error()
                    yield _sse(P.error_body(e.message, e.type, None, e.code))
                    failed = True
                    break
                last[i] = update
                if update.finish_reason == "error":
                    yield _sse(P.error_body(update.error or "generation failed", "server_error",
                                            None, "internal_error"))
                    failed = True
                    break
                piece = _stream_piece(job, states[i], i, update, rid)
                if piece is not None:
                    yield _sse(job.fmt.chunk(rid, created, piece, job.include_usage,
                                             text_offset=states[i].offset - len(piece.text)))
            if job.include_usage and not failed and all(u is not None for u in last):
                yield _sse(usage_chunk(rid, self.model, created, job.fmt.chunk_object,
                                       last[0].num_prompt_tokens,
                                       sum(u.num_tokens for u in last),
                                       last[0].num_cached_tokens))
            yield "data: [DONE]\n\n"
        finally:
            for s in streams:
                s.close()


def _stream_piece(job: Job, st: _ChoiceState, index: int, u: Update, rid: str) -> Choice | None:
    """The new part of one choice since the last chunk (None: nothing to send)."""
    if u.text.startswith(st.text):
        delta, st.text = u.text[len(st.text):], u.text
    else:  # the engine revised emitted text; it cannot be taken back
        logger.warning("request %s: text is not an extension of what was sent", rid)
        delta = ""
    entries = None
    if job.num_top is not None:
        entries = list((u.logprobs or ())[st.num_logprobs:])
        st.num_logprobs = max(st.num_logprobs, len(u.logprobs or ()))
    if job.echo_text is not None and not st.echoed:
        st.echoed = True
        delta = job.echo_text + delta
        if entries is not None:
            entries = _echoed_logprobs(job, u) + entries
    st.offset += len(delta)
    if not delta and not entries and u.finish_reason is None:
        return None
    return Choice(index, delta, u.finish_reason, entries)


def _echoed_logprobs(job: Job, u: Update) -> list[TokenLogprob]:
    """The prompt's entries, the first one (no context) as a log-prob of None."""
    if not u.prompt_logprobs:
        return []
    return [TokenLogprob(job.prompt_ids[0], None), *u.prompt_logprobs[1:]]


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


async def _collect_all(streams: list[RequestStream], request: Request,
                       deadline: float | None = None) -> list[Update] | str | None:
    """Wait for every stream's final update; None if the client disconnects, "timeout" past
    ``deadline`` (monotonic); either way every stream is aborted (its pages freed)."""
    finals = asyncio.ensure_future(asyncio.gather(*(s.final() for s in streams)))
    watch = asyncio.ensure_future(_until_disconnected(request))
    disconnected = False
    try:
        await asyncio.wait({finals, watch}, timeout=_left(deadline),
                           return_when=asyncio.FIRST_COMPLETED)
        disconnected = watch.done()
    finally:
        watch.cancel()
        if not finals.done():
            finals.cancel()
            # A cancelled gather ends with CancelledError set as its exception; retrieve
            # it, or asyncio logs "exception was never retrieved" at ERROR per request.
            finals.add_done_callback(lambda f: f.cancelled() or f.exception())
        for s in streams:
            s.close()
    if not finals.done() or finals.cancelled():
        return None if disconnected or deadline is None else "timeout"
    return finals.result()


async def _merge(streams: list[RequestStream], deadline: float | None = None):
    """(index, update) pairs from several streams as they come; each stream's updates stay
    coalesced (a slow consumer sees the newest). Past ``deadline``: one (None, None)."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, timeout=_left(deadline),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield None, None
                return
            for task in done:
                i = pending.pop(task)
                try:
                    update = task.result()
                except StopAsyncIteration:
                    continue
                yield i, update
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for task in pending:
            task.cancel()
