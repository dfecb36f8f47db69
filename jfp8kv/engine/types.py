"""User-facing request types: sampling parameters and request outputs."""

from __future__ import annotations

import dataclasses
from typing import Sequence

# Most top log-probs one token may report (OpenAI's chat limit); the device computes this many.
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (names, defaults and semantics follow vLLM's).

    ``top_k <= 0`` and ``top_p == 1`` disable those filters; ``temperature == 0`` is greedy.
    ``seed`` makes sampling reproducible per request, independent of batch composition.

    Penalties change the logits before sampling: ``repetition_penalty`` (HF/vLLM: a logit
    of a token seen in the prompt or the output is divided by it if positive, multiplied if
    negative; 1 = off), then ``frequency_penalty`` (minus penalty x count of the token in
    the output) and ``presence_penalty`` (minus penalty if it occurs in the output; OpenAI's
    semantics, 0 = off). ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled (and
    stop strings do not stop) before this many tokens were generated.

    ``logprobs``: report each generated token's log-prob (log_softmax of the raw model
    logits) and the ``logprobs`` most likely alternatives (0..MAX_LOGPROBS). ``prompt_logprobs``:
    the same for each prompt token after the first (teacher-forced); with it, ``max_tokens=0``
    scores the prompt without generating.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        self._check_lengths()
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer (-1 or 0 disables), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2 <= getattr(self, name) <= 2):
                raise ValueError(f"{name} must be in [-2, 2] (0 disables), got "
                                 f"{getattr(self, name)!r}")
        if not (self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0 (1 disables), got "
                             f"{self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {k!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))

    def _check_lengths(self) -> None:
        lowest = 0 if self.prompt_logprobs is not None else 1
        if not isinstance(self.max_tokens, int) or self.max_tokens < lowest:
            raise ValueError(f"max_tokens must be an integer >= 1 (0 only with prompt_logprobs, "
                             f"to score a prompt), got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        """True when the logits need the token-count state (penalties or min_tokens)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or self.min_tokens > 0)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One token's log-prob and the ``len(top)`` most likely tokens at its position,
    as (token_id, logprob) pairs, most likely first. ``logprob`` is None only where a
    server echoes a prompt's first token (it has no context)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class RequestOutput:
    """State of one request. ``token_ids`` and ``text`` are cumulative (generated part only).

    ``finish_reason`` is "stop" (EOS, stop token or stop string), "length" (max_tokens or
    max_model_len) or "abort"; ``None`` while running. ``logprobs`` (one entry per generated
    token) and ``prompt_logprobs`` (None for the first prompt token) are filled only when the
    SamplingParams asked for them. ``num_cached_tokens``: prompt tokens whose K/V came from
    the prefix cache at the request's first admission (OpenAI's ``cached_tokens``).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt: str | None = None
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
