"""What the scheduler hands the engine: a ``Sequence`` (one request's tokens, pages, state
slot and progress), its prefill chunks and decode rows, and one step's plan
(``ScheduledStep``). Plain Python, no arrays; the scheduler's docstring says how they move.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jfp8kv.engine.types import SamplingParams


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    prompt: str | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0
    finish_reason: str | None = None
    text: str = ""
    num_preemptions: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    order: int = 0
    # Prompt tokens whose K/V came from the prefix cache at the first admission (OpenAI's
    # usage.prompt_tokens_details.cached_tokens); readmissions after preemption don't count.
    num_cached_prompt_tokens: int = 0
    # Prefix-cache keys of the first full pages of ``tokens`` (hashed once, kept across
    # preemption since tokens only grow), and how many of ``pages`` were offered to the cache.
    page_keys: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    num_registered: int = 0
    # Sampled by dispatched steps, not read by the host yet, and the mailbox slot of the
    # last of them (overlap scheduling, see jfp8kv/engine/overlap.py).
    num_pending: int = 0
    mail_slot: int = -1
    # Caches with slot pools: the state slot held while running (0: none; Scheduler docs),
    # and the state snapshots' bookkeeping (``snapshot_policy.SeqSnapshots``, or None).
    state_slot: int = 0
    snap: Any = dataclasses.field(default=None, repr=False)
    # The engine's post-processing state: incremental detokenizer, the ids that stop the
    # sequence (stop_token_ids, EOS unless ignore_eos), text searched for stop strings.
    detok: Any = dataclasses.field(default=None, repr=False)
    stop_ids: Any = dataclasses.field(default=None, repr=False)
    stop_searched: int = 0

    @property
    def tokens(self) -> list[int]:
        """The known tokens (prompt + read output; pending ones are not included)."""
        return self.prompt_token_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """The last known token (without building ``tokens``)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, pending ones included."""
        return len(self.prompt_token_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_cached


@dataclasses.dataclass
class PrefillChunk:
    """``restore``: a snapshot slot copied into the sequence's state slot before the chunk;
    ``capture``: a snapshot slot the state is copied into after it (0: none; state
    snapshots, ``snapshot_policy``)."""

    seq: Sequence
    start: int
    length: int
    restore: int = 0
    capture: int = 0

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the last token, so a new token is sampled."""
        return self.start + self.length == self.seq.num_tokens


@dataclasses.dataclass
class DecodeRow:
    seq: Sequence
    steps: int  # tokens this row may produce in this dispatch
    # (scan step, snapshot slot): the state after that step is copied there (or None)
    capture: tuple[int, int] | None = None


@dataclasses.dataclass
class ScheduledStep:
    decode: list[DecodeRow]
    prefill: list[PrefillChunk]
    preempted: list[Sequence]
    num_steps: int = 1  # the decode dispatch's scan length (one of Scheduler.step_counts)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill
