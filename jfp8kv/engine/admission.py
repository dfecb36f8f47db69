"""Admission under capacity pressure: when a waiting sequence may start (plain Python).

``greedy`` admits the head of the queue as soon as the pages of its first prefill chunk are
free. Under a full pool that overcommits: the running sequences' decode growth (and the rest
of every admitted prompt) later needs pages nobody reserved, so ``Scheduler._grow`` preempts
the newest sequence, whose whole prefill is then thrown away and recomputed.

``reserve`` (the default) admits a sequence only if, with it, the free pages cover what the
running sequences and it are expected to need at every later moment, plus a watermark
(``Admission.admits`` is the rule). Each sequence is expected to need the rest of its known
tokens now (chunked prefill will need the whole prompt) and then ``ratio`` times the output
it may still produce (max_tokens - generated, capped by max_model_len), one token per decode
iteration once its prompt is prefilled; when it ends it hands back the pages it alone holds.
Need grows between ends, so it peaks just before one: ``peak`` checks every expected end
(it is never more than the sum of every sequence's need at its end, the bound for sequences
that all end together, and less when some end early and free their pages for the others'
growth). Prefix-cache hits count as held. The ratio adapts, as SGLang's ``new_token_ratio``
does: it decays towards a floor while nothing is preempted, and jumps back to 1 at a
preemption. Unlike SGLang's fixed floor, the floor is learned: the mean fraction of their
output budget that finished sequences used. A workload that always runs to max_tokens
(``ignore_eos`` benchmarks) so keeps the ratio at 1 and, lengths then known, does not preempt;
one whose requests stop early lets the ratio fall and admits more.

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
# a third emptier on average than 0.005 (0.30 against 0.47 of it in use).
RATIO_DECAY = 0.005
# Weight of each finished sequence in the learned floor (an exponential moving mean over the
# last ~10 finishes: a changing workload moves it within a few dozen requests).
LEARN_WEIGHT = 0.1
# Pages kept free at admission while the ratio is below 1, as a fraction of the pool (vLLM's
# watermark, 0.01): slack for an estimate that lags a workload that changed. At ratio 1 the
# need counted is the most the sequences can take (the lookahead of multi-step decode
# included), so no slack is kept: on the H200 fp8 workload 1% of the pool was the 48th row
# of 48.3 that fit: with it kept, 96 requests took three waves of decode, not two.
WATERMARK = 0.01
FINISHED = ("stop", "length")  # finish reasons that tell how long outputs run (not abort)


Row = tuple  # (finish iteration, base pages, final extra pages, own pages): Admission.row


class Admission:
    def __init__(self, policy: str, allocator, page_size: int, max_model_len: int,
                 max_num_batched_tokens: int, decode_steps: int = 1):
        if policy not in ADMISSION_POLICIES:
            raise ValueError(f"unknown admission {policy!r}; choose one of "
                             f"{list(ADMISSION_POLICIES)}")
        self.policy = policy
        self.allocator = allocator
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.budget = max_num_batched_tokens
        self.lookahead = decode_steps - 1  # a decode dispatch allocates its steps' pages first
        self.watermark = int(WATERMARK * (allocator.num_pages - 1))
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

    def expected_output(self, seq) -> int:
        """Tokens ``seq`` is expected to add: ``ratio`` of its output budget left, capped by
        max_model_len."""
        out_left = max(0, seq.params.max_tokens - seq.num_generated)
        room = max(0, self.max_model_len - seq.num_tokens)
        return min(room, math.ceil(self.ratio * out_left))

    def row(self, seq, held: int, shared: int, cached: int, queued: int) -> tuple[Row, int]:
        """``seq``'s future as admission sees it, and the prefill tokens queued up to and
        including it. It holds ``held`` pages (``shared`` of them with others: those stay
        held when it ends) and K/V for ``cached`` tokens; its prefill ends once the
        ``queued`` tokens of older prompts and its own are done, ``budget`` a step, one
        decode iteration a step; then it adds ``expected_output`` tokens, one an iteration.
        Row: (iteration it ends, pages it needs now (the rest of its known tokens), pages it
        needs at its end, beyond ``held``; pages it hands back at its end)."""
        todo = seq.num_tokens - cached
        delay = 0
        if todo > 1:  # 1: decode input, not prefill
            queued += todo
            delay = -(-queued // self.budget)
        out = self.expected_output(seq)
        pages = lambda n: -(-n // self.page_size)  # noqa: E731
        base = max(0, pages(seq.num_tokens) - held)
        final = max(0, pages(seq.num_tokens + out) - held)
        return (delay + out, base, final, held - shared), queued

    def rows(self, running) -> tuple[list[Row], int]:
        """The running sequences' rows (oldest first: the order prefill serves them) and the
        prefill tokens they queue; greedy: none (it never looks)."""
        rows, queued = [], 0
        if self.policy == "greedy":
            return rows, queued
        for s in sorted(running, key=lambda s: s.order):
            r, queued = self.row(s, len(s.pages), self._shared(s.pages), s.num_cached, queued)
            rows.append(r)
        return rows, queued

    def extend(self, running: tuple, seq) -> tuple:
        """``running`` (``rows``) with ``seq``, just admitted and its first chunk placed."""
        if self.policy == "greedy":
            return running
        rows, queued = running
        row, queued = self.row(seq, len(seq.pages), self._shared(seq.pages), seq.num_cached,
                               queued)
        return rows + [row], queued

    def _shared(self, pages) -> int:
        """Leading pages another holder also holds (only a prefix of pages is ever shared)."""
        n = 0
        while n < len(pages) and self.allocator.refcount(pages[n]) > 1:
            n += 1
        return n

    def admits(self, seq, hit: list, first_chunk: int, free: int, running: tuple,
               alone: bool) -> bool:
        """THE ADMISSION RULE. ``hit``: the prefix-cache pages ``seq`` would map (held from
        then on); ``first_chunk``: new pages its first prefill chunk allocates; ``free``:
        pages free once the hits are shared; ``running``: ``rows(running sequences)``;
        ``alone``: nothing runs."""
        if first_chunk > free:
            return False
        if self.policy == "greedy" or alone:
            return True  # alone: a request that fits always starts (no starvation)
        shared = sum(1 for p in hit if self.allocator.refcount(p) > 0)  # others hold them
        rows, queued = running
        row, _ = self.row(seq, len(hit), shared, len(hit) * self.page_size, queued)
        # At ratio 1 every sequence's reservation is the most it can ever need: no slack.
        slack = self.watermark if self.ratio < 1 else 0
        return self.peak(rows + [row]) + slack <= free

    def peak(self, rows: list[Row]) -> int:
        """The most pages ``rows`` will need beyond what they hold now, at any iteration.
        At iteration t an unfinished row needs min(final, base + pages of t + lookahead
        tokens) and a finished one has handed back its own pages; need grows between
        finishes, so it peaks just before one: checked at every row's end, O(n log n)."""
        n, ps = len(rows), self.page_size
        active, capped = [True] * n, [False] * n
        by_end = sorted(range(n), key=lambda j: rows[j][0])
        by_cap = sorted(range(n), key=lambda j: rows[j][2] - rows[j][1])  # growth to final
        count, base, at_final, handed, top, c = n, sum(r[1] for r in rows), 0, 0, 0, 0
        for k, j in enumerate(by_end):
            grow = -(-(rows[j][0] + self.lookahead) // ps)  # pages of growth by j's end
            while c < n and rows[by_cap[c]][2] - rows[by_cap[c]][1] <= grow:
                i = by_cap[c]
                c += 1
                capped[i] = True
                if active[i]:  # from now on it needs its final pages, no more
                    count, base, at_final = count - 1, base - rows[i][1], at_final + rows[i][2]
            if k == 0 or rows[by_end[k - 1]][0] < rows[j][0]:  # before equal ends hand back
                top = max(top, at_final + base + count * grow - handed)
            active[j] = False
            handed += rows[j][3]
            if capped[j]:
                at_final -= rows[j][2]
            else:
                count, base = count - 1, base - rows[j][1]
        return top
