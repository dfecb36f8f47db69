"""Response bodies of the OpenAI-compatible API: plain dicts in OpenAI's schema (``id``,
``object``, ``created``, ``model``, ``choices``, ``usage``), for completions and chat, whole
or as stream chunks, with their two log-prob formats.

A ``Choice`` is what a route knows of one finished (or streamed) choice: its index, text,
finish reason and the ``TokenLogprob`` entries of its tokens. ``CompletionFormat`` and
``ChatFormat`` turn choices into bodies; the route does not branch on the endpoint.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from jfp8kv.engine.types import TokenLogprob


@dataclasses.dataclass
class Choice:
    index: int
    text: str
    finish_reason: str | None
    # None: log-probs not asked for; an entry's logprob is None for an echo's first token
    logprobs: Sequence[TokenLogprob] | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: of the prompt tokens, those served from the
    prefix cache (``prompt_tokens_details.cached_tokens``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The final chunk of ``stream_options.include_usage``: empty choices, usage filled."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


class _Format:
    """Shared by both endpoints; ``token_text`` maps a token id to its text."""

    object: str
    chunk_object: str

    def __init__(self, model: str, token_text, num_top: int):
        self.model = model
        self.token_text = token_text
        self.num_top = num_top

    def response(self, rid: str, choices: list[Choice], prompt_tokens: int,
                 completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {"id": rid, "object": self.object, "created": int(time.time()),
                "model": self.model, "choices": [self._choice(c) for c in choices],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def chunk(self, rid: str, created: int, choice: Choice, with_usage_field: bool,
              first: bool = False, text_offset: int = 0) -> dict:
        body = {"id": rid, "object": self.chunk_object, "created": created, "model": self.model,
                "choices": [self._chunk_choice(choice, first, text_offset)]}
        if with_usage_field:
            body["usage"] = None
        return body

    def _tok(self, token_id: int) -> str:
        return self.token_text(token_id)


class CompletionFormat(_Format):
    """Legacy completions; log-probs as {tokens, token_logprobs, top_logprobs, text_offset}."""

    object = chunk_object = "text_completion"

    def _choice(self, c: Choice) -> dict:
        return {"index": c.index, "text": c.text, "logprobs": self.logprobs(c.logprobs),
                "finish_reason": c.finish_reason}

    def _chunk_choice(self, c: Choice, first: bool, text_offset: int) -> dict:
        return {"index": c.index, "text": c.text,
                "logprobs": self.logprobs(c.logprobs, text_offset),
                "finish_reason": c.finish_reason}

    def logprobs(self, entries, text_offset: int = 0) -> dict | None:
        """``text_offset``: the character offset of the first token in the choice's text."""
        if entries is None:
            return None
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for e in entries:
            text = self._tok(e.token_id)
            top = None
            if e.logprob is not None:  # None: the first prompt token of an echo
                top = {self._tok(t): lp for t, lp in e.top[:self.num_top]}
                top.setdefault(text, e.logprob)  # OpenAI lists the chosen token too
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out


class ChatFormat(_Format):
    """Chat completions; log-probs as {"content": [{token, logprob, bytes, top_logprobs}]}."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _choice(self, c: Choice) -> dict:
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason}

    def _chunk_choice(self, c: Choice, first: bool, text_offset: int) -> dict:
        delta = {"role": "assistant", "content": c.text} if first else (
            {"content": c.text} if c.text else {})
        return {"index": c.index, "delta": delta, "logprobs": self.logprobs(c.logprobs),
                "finish_reason": c.finish_reason}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self._tok(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def logprobs(self, entries, text_offset: int = 0) -> dict | None:
        if entries is None:
            return None
        return {"content": [
            {**self._entry(e.token_id, e.logprob),
             "top_logprobs": [self._entry(t, lp) for t, lp in e.top[:self.num_top]]}
            for e in entries]}
