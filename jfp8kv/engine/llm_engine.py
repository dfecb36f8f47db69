"""The engine step: schedule (host), run (device), post-process (host).

Not thread-safe: one thread owns the engine and alone calls add_request / abort_request /
step (the server's async bridge does exactly that).
"""

from __future__ import annotations

import itertools
import logging
import math
import time

import numpy as np

from jfp8kv.engine.detokenizer import IncrementalDetokenizer, find_stop
from jfp8kv.engine.errors import EngineOverloaded
from jfp8kv.engine.overlap import InFlight, feed
from jfp8kv.engine.overlap import host_outputs as _host, host_parts, pick_logprob as _pick
from jfp8kv.engine.runner import ModelRunner
from jfp8kv.engine.sampler import SamplingArrays, sampling_of
from jfp8kv.engine.scheduler import ScheduledStep, Scheduler, Sequence
from jfp8kv.engine.stats import StepStats
from jfp8kv.engine.types import MAX_LOGPROBS, RequestOutput, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer, *, model_name: str,
                 max_model_len: int, eos_token_ids: tuple[int, ...], seed: int = 0,
                 max_queue_len: int = 1024, overlap_scheduling: bool = True,
                 memory_plan: dict | None = None):
        """``overlap_scheduling``: schedule and dispatch step N before reading step N-1's
        samples (see ``step``); False runs the serialized path (read, then schedule).
        ``memory_plan``: ``memory.MemoryPlan.info()``, reported by ``metrics``."""
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self.max_queue_len = max_queue_len
        self.memory_plan = memory_plan or {}
        self._seqs: dict[str, Sequence] = {}
        self._counter = itertools.count()
        self._aborted: list[Sequence] = []
        self._scoring: list[Sequence] = []  # waiting for their prompt_logprobs
        self._logprobs: dict[str, list[TokenLogprob]] = {}  # request id -> per output token
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self.num_generated_tokens = 0
        self.stats = StepStats()  # per-step anatomy, off until enabled (benchmarks)
        self.overlap_scheduling = overlap_scheduling
        self._inflight: InFlight | None = None  # dispatched, samples not read yet
        self._mailbox_size = runner.decode_bucket(scheduler.max_num_seqs)
        self._mailbox_zeros = np.zeros(self._mailbox_size, np.int32)

    # -- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = None
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.runner.cfg.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty")
        scoring_only = params.max_tokens == 0
        if len(ids) > self.max_model_len or (len(ids) == self.max_model_len and not scoring_only):
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit); shorten the prompt or "
                f"raise max_model_len")
        if self.num_waiting() >= self.max_queue_len:
            raise EngineOverloaded(
                f"{self.num_waiting()} requests are waiting (max_queue_len="
                f"{self.max_queue_len}); retry later")
        n = next(self._counter)
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + n)
        seq = Sequence(request_id, ids, params, seed=seed & 0xFFFFFFFF, prompt=text)
        seq.detok = IncrementalDetokenizer(self.tokenizer)
        seq.stop_ids = np.array(sorted(set(params.stop_token_ids) | (
            set() if params.ignore_eos else self.eos_token_ids)), np.int64)
        self._seqs[request_id] = seq
        if params.logprobs is not None:
            self._logprobs[request_id] = []
        if params.prompt_logprobs is not None:
            self._scoring.append(seq)  # scored first (teacher-forced), then generated
        else:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str, report: bool = True) -> None:
        """Drop a request and free its pages; its final output (finish_reason "abort") is
        returned by the next ``step`` unless ``report`` is False. Unknown ids are ignored."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq in self._scoring:
            self._scoring.remove(seq)
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        if report:
            self._aborted.append(seq)
        else:
            self._forget(seq)

    def num_waiting(self) -> int:
        """Requests admitted and not yet running (what ``max_queue_len`` bounds)."""
        return len(self.scheduler.waiting) + len(self._scoring)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._scoring) or self._inflight is not None

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, dispatch and post-process one step; returns the outputs that changed.

        With overlap scheduling, step N is scheduled and dispatched before step N-1's
        samples are read, and the outputs returned are step N-1's: the host reads and
        post-processes them while the device runs step N. Stop rules therefore act one step
        late; a row of a sequence that finished at N-1 may have run in step N, and its
        tokens are discarded. The tokens are exactly the serialized path's."""
        changed: dict[str, Sequence] = {s.request_id: s for s in self._aborted}
        self._aborted = []
        rec = self.stats.begin()
        for seq in self._score_waiting():
            changed[seq.request_id] = seq
        prev, self._inflight = self._inflight, None
        if prev is not None and self._must_read(prev):
            self._process(prev, changed)  # the next step needs these tokens on the host
            prev = None
        plan = self.scheduler.schedule()
        rec.scheduled(plan, self.runner.prefill_slots)
        cur = None if plan.empty else self._dispatch(plan, prev)
        if self.overlap_scheduling:
            self._inflight = cur
            cur = prev
        if cur is not None:
            rec.synced(*cur.outputs)  # a no-op unless stats are enabled
            self._process(cur, changed)  # the only device->host sync of the step
        elif plan.empty:
            return [self._output(s) for s in changed.values()]
        outputs = [self._output(s) for s in changed.values()]
        self.stats.end(rec)
        return outputs

    def _must_read(self, prev: InFlight) -> bool:
        """Whether ``prev``'s samples must be read before scheduling: penalties and
        min_tokens need every row's token history on the host."""
        rows = [r.seq for r in prev.plan.decode] + [c.seq for c in prev.plan.prefill]
        return any(s.params.uses_penalties and s.finish_reason is None for s in rows)

    def _dispatch(self, plan: ScheduledStep, prev: InFlight | None) -> InFlight:
        """Dispatch ``plan``'s decode and prefill (asynchronously) and advance each
        sequence's ``num_cached`` and ``num_pending`` past what the device will compute."""
        f = InFlight(plan)
        if plan.decode:
            seqs = [r.seq for r in plan.decode]
            rows = [(s.last_token, s.num_cached, s.pages, s.num_cached + r.steps, s.state_slot,
                     *(r.capture or (-1, 0))) for s, r in zip(seqs, plan.decode)]
            fed = None
            if any(s.num_pending for s in seqs):  # inputs still on the device
                b = self.runner.decode_bucket(len(rows))
                src, host = np.full(b, -1, np.int32), np.zeros(b, np.int32)
                for i, s in enumerate(seqs):
                    src[i] = s.mail_slot if s.num_pending else -1
                    host[i] = rows[i][0] if not s.num_pending else 0
                fed = feed(prev.mailbox, src, host)
            # The plan's scan length (one of Scheduler.step_counts: one compile each per
            # batch bucket); rows that need fewer steps go inactive at their limit.
            f.decode_out = self.runner.decode(rows, self._sampling(seqs), self._greedy(seqs),
                                              plan.num_steps, fed)
            for i, (s, r) in enumerate(zip(seqs, plan.decode)):
                f.decode_base.append(s.num_cached + 1)
                s.num_cached += r.steps
                s.num_pending += r.steps
                s.mail_slot = i
        if plan.prefill:
            seqs = [c.seq for c in plan.prefill]
            chunks = [(c.seq.tokens[c.start:c.start + c.length], c.start, c.seq.pages,
                       c.seq.state_slot, c.restore, c.capture) for c in plan.prefill]
            f.completes = [c.completes for c in plan.prefill]
            f.prefill_out = self.runner.prefill(chunks, self._sampling(seqs))
            for i, c in enumerate(plan.prefill):
                c.seq.num_cached += c.length
                if f.completes[i]:
                    c.seq.num_pending += 1
                    c.seq.mail_slot = len(plan.decode) + i
        if self.overlap_scheduling:
            f.make_mailbox(self._mailbox_size, self._mailbox_zeros)
        return f

    def _process(self, f: InFlight, changed: dict) -> None:
        """Read ``f``'s samples, append them and apply stop rules. Rows of sequences that
        finished (or were aborted) after ``f`` was dispatched are discarded."""
        if f.decode_out is not None:
            toks, lps = _host(f.decode_out)
            for i, row in enumerate(f.plan.decode):
                seq = row.seq
                seq.num_pending -= row.steps
                if seq.finish_reason is None:
                    self._take(seq, toks[i, :row.steps], lps, i, f.decode_base[i])
                    changed[seq.request_id] = seq
        if f.prefill_out is not None:
            toks, lps = host_parts(f.prefill_out)
            lps = None if lps is None else tuple(x[:, None] for x in lps)
            for i, chunk in enumerate(f.plan.prefill):
                seq = chunk.seq
                if f.completes[i]:
                    seq.num_pending -= 1
                    if seq.finish_reason is None:
                        self._take(seq, toks[i:i + 1], lps, i, chunk.start + chunk.length)
                        changed[seq.request_id] = seq

    def _sampling(self, seqs: list[Sequence]) -> SamplingArrays:
        return sampling_of(seqs, self.eos_token_ids,
                           self.runner.max_pages_per_seq * self.runner.page_size)

    @staticmethod
    def _greedy(seqs) -> bool:
        return all(s.params.greedy for s in seqs)

    def _take(self, seq: Sequence, toks: np.ndarray, lps, row: int, base: int) -> None:
        """Append a row's sampled tokens up to the first stop rule, in order: a stop token
        (stop_token_ids, EOS unless ignore_eos; not before min_tokens), a stop string in the
        text (not before min_tokens), max_tokens or max_model_len. ``base``: ``num_cached``
        once the first token is appended (the sequence finished after token j keeps
        ``base + j``). Token rules are vectorized; text is decoded once per row unless stop
        strings need a check after each token."""
        p = seq.params
        gen0, known = len(seq.output_ids), seq.num_tokens - seq.num_pending
        end = min(len(toks), p.max_tokens - gen0, self.max_model_len - known)
        reason = ("length" if gen0 + end >= p.max_tokens or known + end >= self.max_model_len
                  else None)
        hit = np.flatnonzero(np.isin(toks[:end], seq.stop_ids)
                             & (np.arange(end) >= p.min_tokens - gen0)) if seq.stop_ids.size else ()
        if len(hit):
            end, reason = int(hit[0]) + 1, "stop"
        # A final EOS (unless ignore_eos) is not part of the text; a stop token is checked
        # before stop strings.
        token_stop = end - 1 if reason == "stop" else -1
        drop = int(token_stop >= 0 and not p.ignore_eos
                   and int(toks[token_stop]) in self.eos_token_ids)
        detok, cut = seq.detok, -1
        if p.stop:
            for j in range(end - drop):
                detok.add((int(toks[j]),))
                if gen0 + j + 1 > p.min_tokens and j != token_stop:
                    cut = find_stop(detok.text, p.stop, seq.stop_searched)
                    seq.stop_searched = len(detok.committed)
                    if cut >= 0:
                        end, reason = j + 1, "stop"
                        break
        else:
            detok.add(toks[:end - drop].tolist())
        seq.text = detok.text if cut < 0 else detok.text[:cut]
        seq.output_ids.extend(toks[:end].tolist())
        self.num_generated_tokens += end
        if seq.request_id in self._logprobs and lps is not None:
            self._logprobs[seq.request_id].extend(
                _top(_pick(lps, row, j), int(toks[j]), p.logprobs) for j in range(end))
        if reason is not None:
            if seq.pages:  # still running: the K/V it keeps ends at its last input token
                seq.num_cached = base + end - 1
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        rid = seq.request_id
        lp = self._logprobs.get(rid)
        plp = self._prompt_logprobs.get(rid)
        out = RequestOutput(rid, list(seq.prompt_token_ids), list(seq.output_ids), seq.text,
                            seq.finish_reason, seq.prompt, seq.num_preemptions,
                            None if lp is None else list(lp), plp,
                            seq.num_cached_prompt_tokens)
        if seq.finish_reason is not None:
            self._forget(seq)
        return out

    def _forget(self, seq: Sequence) -> None:
        self._logprobs.pop(seq.request_id, None)
        self._prompt_logprobs.pop(seq.request_id, None)

    # -- teacher-forced scoring ---------------------------------------------------------
    def nll_chunks(self, token_ids, chunk_size: int | None = None, step=None):
        """Teacher-forced NLL through the paged cache: a list of (nll [t], logits [t, V], n)
        device arrays per chunk of ``chunk_size`` (default max_num_batched_tokens), valid in
        their first n rows; nll[i] = -log p(ids[s+i+1] | ids[:s+i+1]). Takes pages for the
        whole sequence from the allocator (it must have them free) and gives them back.
        ``step``: the ``ModelRunner`` method run on each chunk (default ``nll``; ``score``:
        prompt scoring, (log-probs, top values, top ids, n) per chunk)."""
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ValueError("nll needs at least 2 tokens")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed max_model_len={self.max_model_len}")
        sched = self.scheduler
        chunk_size = chunk_size or sched.max_num_batched_tokens
        pages = sched.allocator.allocate(math.ceil(len(ids) / sched.page_size))
        out = []
        try:
            for s in range(0, len(ids) - 1, chunk_size):
                part = ids[s:min(s + chunk_size, len(ids) - 1)]
                tgt = ids[s + 1:s + 1 + len(part)]
                out.append((*(step or self.runner.nll)(part, tgt, s, pages,
                                                       sched.scratch_state_slot), len(part)))
        finally:
            sched.allocator.free(pages)
        return out

    def _score_waiting(self) -> list[Sequence]:
        """Score the prompts of requests that asked for prompt_logprobs (in arrival order, as
        long as their pages are free), then queue them for generation or finish them
        (max_tokens=0). Returns the finished ones."""
        done = []
        while self._scoring:
            seq = self._scoring[0]
            if not self.scheduler.allocator.can_allocate(
                    math.ceil(seq.num_tokens / self.scheduler.page_size)):
                break  # running requests hold the pages: retry after a step
            self._scoring.pop(0)
            self._prompt_logprobs[seq.request_id] = self._prompt_logprobs_of(
                seq.prompt_token_ids, seq.params.prompt_logprobs)
            if seq.params.max_tokens == 0:
                self._finish(seq, "length")
                done.append(seq)
            else:
                self.scheduler.add(seq)
        return done

    def _prompt_logprobs_of(self, ids: list[int], k: int) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None]
        if len(ids) < 2:
            return out
        for lp, vals, tops, n in self.nll_chunks(ids, step=self.runner.score):
            lp, vals, tops = (np.asarray(x)[0, :n] for x in (lp, vals, tops))  # on the host
            for i in range(n):
                top = tuple(zip(tops[i, :k].tolist(), vals[i, :k].tolist())) if k else ()
                out.append(TokenLogprob(ids[len(out)], float(lp[i]), top))
        return out

    # -- introspection ----------------------------------------------------------------
    def metrics(self) -> dict:
        """Pool, queue and fp8 counts, the state snapshots' (``snapshot_*``: hits, saves,
        evictions, registered now and their bytes), the memory plan and the device's."""
        alloc, stats = self.scheduler.allocator, np.asarray(self.runner.cache.stats)
        snap = self.scheduler.snapshot_stats()
        per_slot = self.runner.cache.plan.layout.bytes_per_slot()
        return dict(
            pages_used=alloc.num_used, pages_total=alloc.num_pages - 1,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions_total=self.scheduler.num_preemptions,
            kv_saturated_total=float(stats[:, 0].sum() + stats[:, 1].sum()),
            kv_nan_total=float(stats[:, 2].sum() + stats[:, 3].sum()),
            generated_tokens_total=self.num_generated_tokens, time=time.time(),
            snapshot_hits_total=snap.hits, snapshot_saves_total=snap.saves,
            snapshot_evictions_total=snap.evictions, snapshots_cached=snap.cached,
            snapshot_bytes=snap.cached * per_slot, snapshot_pool_bytes=snap.slots * per_slot,
            **{f"memory_plan_{k}": v for k, v in self.memory_plan.items()
               if isinstance(v, int) and not isinstance(v, bool)},
            **self.runner.device_memory())


def _top(entry: TokenLogprob, token: int, k: int) -> TokenLogprob:
    """The entry of sampled ``token`` keeping its k most likely alternatives."""
    assert k <= MAX_LOGPROBS
    return TokenLogprob(token, entry.logprob, entry.top[:k])
