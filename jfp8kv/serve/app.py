"""FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and
/tokenize, /detokenize, /tokenizer_info (``tokenize.py``).

Thin routes over ``OpenAIServing`` (validation, fan-out, formatting). Every error a client
can cause is a 4xx whose body is OpenAI's error object; FastAPI's 422 for validation errors is
turned into a 400 of that shape. A request whose client goes away is aborted (its KV pages
freed): streaming responses through the generator's ``finally``, non-streaming ones through a
task that listens for ``http.disconnect``. ``limits.Guard`` wraps the app: API key (401) and
body size (413) are checked before any route runs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jfp8kv.serve import protocol as P
from jfp8kv.serve.async_engine import AsyncEngine
from jfp8kv.serve.limits import Guard, ServerLimits
from jfp8kv.serve.openai_serving import ApiError, OpenAIServing
from jfp8kv.serve.tokenize import add_tokenize_routes

RETRY_AFTER_S = "1"


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


def _add_error_handlers(app: FastAPI) -> None:
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


def _health(async_engine: AsyncEngine):
    if async_engine.draining:
        return _error_response(ApiError(503, "server is shutting down", None, "shutting_down",
                                        "server_error"))
    if not async_engine.healthy:
        return _error_response(ApiError(503, async_engine.thread_error or "engine unhealthy",
                                        None, "unhealthy", "server_error"))
    return {"status": "ok"}


def build_app(async_engine: AsyncEngine, *, served_model_name: str, tokenizer: Any,
              chat_prompt: Callable[[list[dict]], str], max_model_len: int,
              vocab_size: int | None = None, limits: ServerLimits | None = None) -> FastAPI:
    """``chat_prompt`` renders messages with the chat template; ``vocab_size`` bounds the
    token ids accepted in a prompt; ``limits``: API key, body size, deadline, pool bound
    (``jfp8kv.serve.limits``; default: no key, 4 MiB bodies, no deadline)."""
    limits = limits or ServerLimits()
    serving = OpenAIServing(async_engine, model=served_model_name,
                            tokenizer=tokenizer, chat_prompt=chat_prompt,
                            max_model_len=max_model_len, vocab_size=vocab_size, limits=limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="jfp8kv", lifespan=lifespan)
    app.add_middleware(Guard, limits=limits)  # outermost: refusals cost no parsing
    _add_error_handlers(app)
    add_tokenize_routes(app, model=served_model_name, tokenizer=tokenizer, chat_prompt=chat_prompt,
                        max_model_len=max_model_len, vocab_size=vocab_size)

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request):
        return await serving.run(serving.completion_job(req), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        return await serving.run(serving.chat_job(req), request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "jfp8kv", "max_model_len": max_model_len,
        }]}

    @app.get("/health")
    async def health():
        return _health(async_engine)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
