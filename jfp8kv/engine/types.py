"""User-facing request types: sampling parameters and request outputs."""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (names and defaults follow vLLM's).

    ``top_k <= 0`` and ``top_p == 1`` disable those filters; ``temperature == 0`` is greedy.
    ``seed`` makes sampling reproducible per request, independent of batch composition.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer (-1 or 0 disables), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class RequestOutput:
    """State of one request. ``token_ids`` and ``text`` are cumulative (generated part only).

    ``finish_reason`` is "stop" (EOS, stop token or stop string), "length" (max_tokens or
    max_model_len) or "abort"; ``None`` while running.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt: str | None = None
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
