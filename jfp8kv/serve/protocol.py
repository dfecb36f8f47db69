"""Request models and response builders of the OpenAI-compatible API.

Requests are validated strictly (``"max_tokens": "5"`` or ``true`` is a 400, not a coercion).
Unknown fields are ignored, but the known OpenAI fields we do not implement (``n > 1``,
``logprobs``, ``echo``, penalties, ...) are rejected with a 400 that names them, rather
than silently producing something else than asked for.

Responses are plain dicts in OpenAI's schema (``id``, ``object``, ``created``, ``model``,
``choices``, ``usage``); errors are ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from jfp8kv.engine.types import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (vLLM's extensions included)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    # Known OpenAI fields that jfp8kv does not implement: accepted only at their defaults.
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something we cannot honour."""
        if self.n != 1:
            return "n", "only n=1 is supported; send several requests for several samples"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported (only best_of=1)"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported"
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            return "presence_penalty", "presence/frequency penalties are not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Raises ValueError (a 400) for values SamplingParams rejects."""
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``prompt``: a string, a list of token ids, or a one-element list of either."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; ValueError for a batch (list of several prompts)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if len(p) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(
                    f"batched prompts are not supported (got a list of {len(p)} prompts); "
                    "send one prompt per request"
                )
            return p[0]
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        """Content as text; list content may hold only {"type": "text", "text": ...} parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools are not supported"
        return super().unsupported()

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(rid: str, model: str, text: str, finish_reason: str | None,
                        prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     with_usage_field: bool) -> dict:
    chunk = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def chat_response(rid: str, model: str, text: str, finish_reason: str | None,
                  prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": finish_reason,
        }],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               with_usage_field: bool) -> dict:
    chunk = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The final chunk of ``stream_options.include_usage``: empty choices, usage filled."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
