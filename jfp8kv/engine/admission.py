"""Admission under capacity pressure: when a waiting sequence may start (plain Python).

``greedy`` admits the head of the queue as soon as the pages of its first prefill chunk are
free. Under a full pool that overcommits: the running sequences' decode growth (and the rest
of every admitted prompt) later needs pages nobody reserved, so ``Scheduler._grow`` preempts
the newest sequence, whose whole prefill is then thrown away and recomputed.

``reserve`` (the default) admits a sequence only if, after it is admitted, the free pages
cover what every running sequence and it are still expected to need, plus a watermark
(``Admission.admits`` is the rule). A sequence's expected need is the rest of its prompt
(chunked prefill will need all of it) plus ``ratio`` times the output it may still produce
(max_tokens - generated, capped by max_model_len), in pages, less the pages it holds.
Prefix-cache hits count as held. The ratio adapts, as SGLang's ``new_token_ratio`` does: it
decays every step towards a floor while nothing is preempted, and jumps back to 1 at a
preemption. Unlike SGLang's fixed floor, the floor is learned: the mean fraction of their
output budget that finished sequences used. A workload that always runs to max_tokens
(``ignore_eos`` benchmarks) so keeps the ratio at 1 and never preempts; one whose requests
stop early lets the ratio fall and admits more.

Nothing starves: when nothing runs, the head is admitted as greedy would admit it (a
request that fits the pool always starts). The queue stays first come, first served: a
refused head blocks the ones behind it, as under greedy.
"""

from __future__ import annotations

import math

from jfp8kv.config import ADMISSION_POLICIES

# Ratio of a sequence's remaining output budget that admission reserves. It starts at 1,
# not at SGLang's 0.7: here a preemption throws away the victim's whole prefill (4k tokens
# in the H200 runs) and an idle row costs little (decode reads all the weights per
# iteration anyway), so the first wave is admitted without overcommitting.
INIT_RATIO = 1.0
RESET_RATIO = 1.0  # after a preemption: the estimate was too low, be exact again
# The lowest ratio whatever finished sequences suggest (SGLang's fixed floor is 0.1-0.14;
# here the learned floor, below, is the usual bound and this one only caps how far a run of
# very short outputs may talk the estimate down).
MIN_RATIO = 0.05
# Per decode iteration (a step without decode counts one): from 1 to a low floor in ~200
# iterations, 25 dispatches of 8 (SGLang decays from 0.7 to its floor over ~600 steps). The
# learned floor is what keeps the ratio high where outputs run long, so the decay can be
# quick: in tests/engine/test_scheduler.py's early-EOS workload 0.002 left the pool about
# a third emptier on average than 0.005 (0.30 against 0.46 of it in use).
RATIO_DECAY = 0.005
# Weight of each finished sequence in the learned floor (an exponential moving mean over the
# last ~10 finishes: a changing workload moves it within a few dozen requests).
LEARN_WEIGHT = 0.1
# Pages kept free at admission, as a fraction of the pool (vLLM's watermark, 0.01): slack
# for decode steps that allocate ahead (decode_steps tokens per dispatch) and for the ratio
# lagging a workload that changed.
WATERMARK = 0.01
FINISHED = ("stop", "length")  # finish reasons that tell how long outputs run (not abort)


class Admission:
    def __init__(self, policy: str, page_size: int, max_model_len: int, num_pages: int):
        if policy not in ADMISSION_POLICIES:
            raise ValueError(f"unknown admission {policy!r}; choose one of "
                             f"{list(ADMISSION_POLICIES)}")
        self.policy = policy
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.watermark = int(WATERMARK * (num_pages - 1))
        self.ratio = INIT_RATIO
        self.used: float | None = None  # learned fraction of max_tokens used; None: no finish yet

    @property
    def floor(self) -> float:
        """The ratio's lower bound: what finished sequences used (none yet: INIT_RATIO)."""
        return max(MIN_RATIO, self.used if self.used is not None else INIT_RATIO)

    def step(self, iterations: int = 1) -> None:
        """A scheduled step of ``iterations`` decode iterations (1 without decode): the
        ratio decays towards the floor (and rises to a floor that finishes raised)."""
        self.ratio = max(self.floor, self.ratio - RATIO_DECAY * iterations)

    def on_preempt(self) -> None:
        self.ratio = RESET_RATIO

    def on_finish(self, seq) -> None:
        """Learn from a finished sequence how much of its output budget it used."""
        if seq.finish_reason not in FINISHED:
            return
        budget = min(seq.params.max_tokens, self.max_model_len - len(seq.prompt_token_ids))
        if budget <= 0:
            return
        frac = min(1.0, seq.num_generated / budget)
        self.used = frac if self.used is None else self.used + LEARN_WEIGHT * (frac - self.used)

    def expected_pages(self, seq, held: int | None = None) -> int:
        """Pages ``seq`` is still expected to need beyond the ``held`` ones (default: its
        pages): the rest of its known tokens plus ``ratio`` of the output it may produce."""
        out_left = max(0, seq.params.max_tokens - seq.num_generated)
        room = max(0, self.max_model_len - seq.num_tokens)
        total = seq.num_tokens + min(room, math.ceil(self.ratio * out_left))
        held = len(seq.pages) if held is None else held
        return max(0, -(-total // self.page_size) - held)

    def reserved(self, running) -> int:
        """Pages the running sequences are expected to need on top of what they hold."""
        if self.policy == "greedy":
            return 0
        return sum(self.expected_pages(s) for s in running)

    def admits(self, seq, hit: int, first_chunk: int, free: int, reserved: int,
               alone: bool) -> bool:
        """THE ADMISSION RULE. ``hit``: prefix-cache pages ``seq`` would map (held from
        then on); ``first_chunk``: new pages its first prefill chunk allocates; ``free``:
        pages free once the hits are shared; ``reserved``: ``reserved(running)``;
        ``alone``: nothing runs."""
        if first_chunk > free:
            return False
        if self.policy == "greedy" or alone:
            return True  # alone: a request that fits always starts (no starvation)
        # At ratio 1 every sequence's reservation is the most it can ever need: no slack.
        slack = self.watermark if self.ratio < 1 else 0
        return self.expected_pages(seq, held=hit) + reserved + slack <= free
