"""FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every error a client can cause is a 4xx whose body is OpenAI's error object; FastAPI's 422
for validation errors is turned into a 400 of that shape. A request whose client goes away
is aborted (its KV pages freed): streaming responses through the generator's ``finally``,
non-streaming ones through a task that listens for ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from jfp8kv.engine.errors import EngineOverloaded
from jfp8kv.serve import protocol as P
from jfp8kv.serve.async_engine import AsyncEngine, EngineUnavailable, RequestStream, ServerDraining

logger = logging.getLogger("jfp8kv.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API
RETRY_AFTER_S = "1"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if e.status == 503 else None
    return JSONResponse(P.error_body(e.message, e.type, e.param, e.code), e.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('msg')}", None
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return f"{where}: {err.get('msg')}", param


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(async_engine: AsyncEngine, *, served_model_name: str, tokenizer: Any,
              chat_prompt: Callable[[list[dict]], str], max_model_len: int,
              vocab_size: int | None = None) -> FastAPI:
    """``chat_prompt`` renders messages with the chat template; ``vocab_size`` bounds the
    token ids accepted in a prompt."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="jfp8kv", lifespan=lifespan)
    metrics = async_engine.metrics

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error_response(ApiError(400, message, param, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        return _error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(ApiError)
    async def _on_api(request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(Exception)
    async def _on_bug(request: Request, exc: Exception):  # logged by Starlette as well
        return _error_response(ApiError(500, f"internal error: {exc!r}", None, "internal_error",
                                        "server_error"))

    def check_common(req: P._SamplingFields) -> None:
        if req.model is not None and req.model != served_model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves "
                           f"{served_model_name!r}", "model", "model_not_found")
        bad = req.unsupported()
        if bad is not None:
            raise ApiError(400, bad[1], bad[0], "unsupported")

    def sampling(req: P._SamplingFields, default_max_tokens: int, max_tokens: int | None):
        try:
            if max_tokens is not None:
                req = req.model_copy(update={"max_tokens": max_tokens})
            return req.sampling_params(default_max_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), None, "invalid_value") from None

    async def submit(rid: str, prompt, params) -> RequestStream:
        try:
            return await async_engine.submit(rid, prompt, params)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt", "invalid_value") from None
        except ServerDraining as e:
            raise ApiError(503, str(e), None, "shutting_down", "server_error") from None
        except EngineOverloaded as e:  # the waiting queue is at its bound
            raise ApiError(503, str(e), None, "server_overloaded", "server_error") from None
        except EngineUnavailable as e:  # the engine thread is down or keeps failing
            raise ApiError(503, str(e), None, "unhealthy", "server_error") from None

    async def collect(stream: RequestStream, request: Request):
        """Wait for the final update; abort if the client disconnects first."""
        final_task = asyncio.ensure_future(stream.final())
        watch_task = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({final_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch_task.cancel()
            if not final_task.done():
                final_task.cancel()
            stream.close()
        if not final_task.done() or final_task.cancelled():
            return None
        return final_task.result()

    def final_error(update) -> None:
        if update.finish_reason == "error":
            raise ApiError(500, update.error or "generation failed", None, "internal_error",
                           "server_error")

    def streaming(stream: RequestStream, rid: str, chat: bool, include_usage: bool) -> StreamingResponse:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, finish_reason: str | None, first: bool = False) -> dict:
            if not chat:
                return P.completion_chunk(rid, served_model_name, created, text, finish_reason,
                                          include_usage)
            delta = {"role": "assistant", "content": text} if first else (
                {"content": text} if text else {})
            return P.chat_chunk(rid, served_model_name, created, delta, finish_reason, include_usage)

        async def events():
            sent = ""
            last = None
            try:
                if chat:
                    yield _sse(chunk("", None, first=True))
                async for last in stream:
                    if last.finish_reason == "error":
                        yield _sse(P.error_body(last.error or "generation failed", "server_error",
                                                None, "internal_error"))
                        break
                    if last.text.startswith(sent):
                        delta = last.text[len(sent):]
                    else:  # the engine revised emitted text; it cannot be taken back
                        logger.warning("request %s: text is not an extension of what was sent", rid)
                        delta = ""
                    sent = last.text if last.text.startswith(sent) else sent
                    if delta or last.finish_reason is not None:
                        yield _sse(chunk(delta, last.finish_reason))
                if include_usage and last is not None and last.finish_reason != "error":
                    yield _sse(P.usage_chunk(rid, served_model_name, created, obj,
                                             last.num_prompt_tokens, last.num_tokens))
                yield "data: [DONE]\n\n"
            finally:
                stream.close()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(stream.close))

    def check_token_ids(ids: list[int]) -> None:
        if not ids:
            raise ApiError(400, "prompt must not be empty", "prompt", "invalid_value")
        limit = vocab_size
        bad = [t for t in ids if t < 0 or (limit is not None and t >= limit)]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is out of range [0, {limit})",
                           "prompt", "invalid_value")

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request):
        check_common(req)
        try:
            prompt = req.single_prompt()
        except ValueError as e:
            raise ApiError(400, str(e), "prompt", "invalid_value") from None
        if isinstance(prompt, list):
            check_token_ids(prompt)
        elif not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt", "invalid_value")
        params = sampling(req, COMPLETIONS_DEFAULT_MAX_TOKENS, None)
        rid = P.new_id("cmpl")
        stream = await submit(rid, prompt, params)
        if req.stream:
            return streaming(stream, rid, chat=False, include_usage=req.include_usage)
        final = await collect(stream, request)
        if final is None:
            return Response(status_code=499)
        final_error(final)
        return P.completion_response(rid, served_model_name, final.text, final.finish_reason,
                                     final.num_prompt_tokens, final.num_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        check_common(req)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise ApiError(400, str(e), "messages", "invalid_value") from None
        try:
            text = chat_prompt(messages)
        except ImportError as e:  # a dependency missing on the server: not the client's fault
            raise ApiError(500, f"chat template unavailable on this server: {e}", None,
                           "internal_error", "server_error") from None
        except Exception as e:  # template errors are caused by the messages
            raise ApiError(400, f"chat template failed: {e}", "messages", "invalid_value") from None
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= max_model_len:
            raise ApiError(400, f"prompt has {len(ids)} tokens; max_model_len is {max_model_len} "
                           "and at least one token must be generated", "messages", "context_length_exceeded")
        params = sampling(req, max_model_len - len(ids), req.effective_max_tokens())
        rid = P.new_id("chatcmpl")
        stream = await submit(rid, ids, params)
        if req.stream:
            return streaming(stream, rid, chat=True, include_usage=req.include_usage)
        final = await collect(stream, request)
        if final is None:
            return Response(status_code=499)
        final_error(final)
        return P.chat_response(rid, served_model_name, final.text, final.finish_reason,
                               final.num_prompt_tokens, final.num_tokens)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "jfp8kv", "max_model_len": max_model_len,
        }]}

    @app.get("/health")
    async def health():
        if async_engine.draining:
            return _error_response(ApiError(503, "server is shutting down", None, "shutting_down",
                                            "server_error"))
        if not async_engine.healthy:
            return _error_response(ApiError(503, async_engine.thread_error or "engine unhealthy",
                                            None, "unhealthy", "server_error"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
