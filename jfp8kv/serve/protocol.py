"""Request models of the OpenAI-compatible API (response bodies: ``responses.py``).

Requests are validated strictly (``"max_tokens": "5"`` or ``true`` is a 400, not a coercion).
Unknown fields are ignored, but the known OpenAI fields we do not implement (``logit_bias``,
``suffix``, ``tools``, ``best_of`` with streaming, ...) are rejected with a 400 that names
them, rather than silently producing something else than asked for. Errors are
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from jfp8kv.engine.types import MAX_LOGPROBS, SamplingParams

MAX_N = 128  # choices per request (n, best_of)
MAX_STOP_STRINGS = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters per stop string: bounds the stream's hold-back scan


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (vLLM's extensions included)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    # Known OpenAI fields that jfp8kv does not implement: accepted only at their defaults.
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something we cannot honour."""
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"best_of ({self.best_of}) must be >= n ({self.n})"
        if self.best_of is not None and self.best_of > self.n and self.stream:
            return "best_of", "best_of > n cannot stream (the best choices are known at the end)"
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            return "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            return "stop", f"a stop string may have at most {MAX_STOP_CHARS} characters"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def num_logprobs(self) -> int | None:
        """Top log-probs per generated token (None: none asked)."""
        return None

    def sampling_params(self, max_tokens: int, **extra) -> SamplingParams:
        """Raises ValueError (a 400) for values SamplingParams rejects."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            logprobs=self.num_logprobs(), **extra)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``prompt``: a string, a list of token ids, or a one-element list of either."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()

    def num_logprobs(self) -> int | None:
        return self.logprobs

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
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools are not supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
