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

from jfp8kv.engine.errors import EngineOverloaded
from jfp8kv.engine.runner import ModelRunner, SamplingArrays, bucket
from jfp8kv.engine.sampler import PenaltyArrays, SamplingExtras, top_logprobs
from jfp8kv.engine.scheduler import Scheduler, Sequence
from jfp8kv.engine.stats import StepStats
from jfp8kv.engine.types import MAX_LOGPROBS, RequestOutput, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer, *, model_name: str,
                 max_model_len: int, eos_token_ids: tuple[int, ...], seed: int = 0,
                 max_queue_len: int = 1024):
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self.max_queue_len = max_queue_len
        self._seqs: dict[str, Sequence] = {}
        self._counter = itertools.count()
        self._aborted: list[Sequence] = []
        self._scoring: list[Sequence] = []  # waiting for their prompt_logprobs
        self._logprobs: dict[str, list[TokenLogprob]] = {}  # request id -> per output token
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        self.num_generated_tokens = 0
        self.stats = StepStats()  # per-step anatomy, off until enabled (benchmarks)

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
        if len(self.scheduler.waiting) + len(self._scoring) >= self.max_queue_len:
            raise EngineOverloaded(
                f"{len(self.scheduler.waiting)} requests are waiting (max_queue_len="
                f"{self.max_queue_len}); retry later")
        n = next(self._counter)
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + n)
        seq = Sequence(request_id, ids, params, seed=seed & 0xFFFFFFFF, prompt=text)
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

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._scoring)

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        changed: dict[str, Sequence] = {s.request_id: s for s in self._aborted}
        self._aborted = []
        rec = self.stats.begin()
        for seq in self._score_waiting():
            changed[seq.request_id] = seq
        plan = self.scheduler.schedule()
        rec.scheduled(plan)
        if plan.empty:
            return [self._output(s) for s in changed.values()]
        decode_out = prefill_out = None
        if plan.decode:
            seqs = [r.seq for r in plan.decode]
            rows = [(s.tokens[-1], s.num_cached, s.pages, s.num_cached + r.steps)
                    for s, r in zip(seqs, plan.decode)]
            # One scan length for every dispatch (one compile per batch bucket); rows that
            # need fewer steps go inactive at their limit.
            decode_out = self.runner.decode(rows, self._sampling(seqs), self._greedy(seqs),
                                            self.scheduler.decode_steps)
        if plan.prefill:
            seqs = [c.seq for c in plan.prefill]
            chunks = [(c.seq.tokens[c.start:c.start + c.length], c.start, c.seq.pages)
                      for c in plan.prefill]
            prefill_out = self.runner.prefill(chunks, self._sampling(seqs), self._greedy(seqs))
        rec.synced(decode_out, prefill_out)  # a no-op unless stats are enabled
        # Post-process (the only device->host sync of the step).
        if decode_out is not None:
            toks, lps = _host(decode_out)
            for i, row in enumerate(plan.decode):
                seq = row.seq
                for j in range(row.steps):
                    seq.num_cached += 1
                    if self._append(seq, int(toks[i, j]), _pick(lps, i, j)):
                        break
                changed[seq.request_id] = seq
        if prefill_out is not None:
            toks, lps = _host(prefill_out)
            for i, chunk in enumerate(plan.prefill):
                seq = chunk.seq
                seq.num_cached += chunk.length
                if chunk.completes:
                    self._append(seq, int(toks[i]), _pick(lps, i))
                    changed[seq.request_id] = seq
        outputs = [self._output(s) for s in changed.values()]
        self.stats.end(rec)
        return outputs

    def _sampling(self, seqs: list[Sequence]) -> SamplingArrays:
        extras = None
        penalized = any(s.params.uses_penalties for s in seqs)
        logprobs = any(s.params.logprobs is not None for s in seqs)
        if penalized or logprobs:
            extras = SamplingExtras(self._penalty_arrays(seqs) if penalized else None, logprobs)
        return SamplingArrays(
            temperature=np.array([s.params.temperature for s in seqs], np.float32),
            top_k=np.array([s.params.top_k for s in seqs], np.int32),
            top_p=np.array([s.params.top_p for s in seqs], np.float32),
            seeds=np.array([s.seed for s in seqs], np.uint32),
            counters=np.array([len(s.output_ids) for s in seqs], np.int32),
            extras=extras)

    def _penalty_arrays(self, seqs: list[Sequence]) -> PenaltyArrays:
        """The token history at a fixed width (one compile per batch bucket) and the ids
        min_tokens masks (EOS unless ignore_eos, and stop_token_ids), bucketed in width."""
        width = self.runner.max_pages_per_seq * self.runner.page_size
        history = np.full((len(seqs), width), -1, np.int32)
        stops = [sorted(set(s.params.stop_token_ids)
                        | (set() if s.params.ignore_eos else self.eos_token_ids))
                 if s.params.min_tokens > 0 else [] for s in seqs]
        stop_ids = np.full((len(seqs), bucket(max(map(len, stops)), 8)), -1, np.int32)
        for i, s in enumerate(seqs):
            history[i, :s.num_tokens] = s.tokens
            stop_ids[i, :len(stops[i])] = stops[i]
        p = [s.params for s in seqs]
        return PenaltyArrays(
            history=history,
            num_prompt=np.array([len(s.prompt_token_ids) for s in seqs], np.int32),
            presence=np.array([x.presence_penalty for x in p], np.float32),
            frequency=np.array([x.frequency_penalty for x in p], np.float32),
            repetition=np.array([x.repetition_penalty for x in p], np.float32),
            min_tokens=np.array([x.min_tokens for x in p], np.int32),
            stop_ids=stop_ids)

    @staticmethod
    def _greedy(seqs) -> bool:
        return all(s.params.greedy for s in seqs)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Append a sampled token, apply stop rules; return True if the sequence finished."""
        p = seq.params
        seq.output_ids.append(token)
        if seq.request_id in self._logprobs and logprob is not None:
            self._logprobs[seq.request_id].append(_top(logprob, token, p.logprobs))
        self.num_generated_tokens += 1
        reason = None
        may_stop = len(seq.output_ids) > p.min_tokens
        if may_stop and (token in p.stop_token_ids
                         or (not p.ignore_eos and token in self.eos_token_ids)):
            reason = "stop"
        seq.text = self._detokenize(seq)
        if reason is None and p.stop and may_stop:
            cut = min((i for i in (seq.text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is None and (len(seq.output_ids) >= p.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
            return True
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)

    def _detokenize(self, seq: Sequence) -> str:
        ids = seq.output_ids
        if ids and ids[-1] in self.eos_token_ids and not seq.params.ignore_eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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
    def nll_chunks(self, token_ids, chunk_size: int | None = None):
        """Teacher-forced NLL through the paged cache: a list of (nll [t], logits [t, V], n)
        device arrays per chunk of ``chunk_size`` (default max_num_batched_tokens), valid in
        their first n rows; nll[i] = -log p(ids[s+i+1] | ids[:s+i+1]). Takes pages for the
        whole sequence from the allocator (it must have them free) and gives them back."""
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
                out.append((*self.runner.nll(part, tgt, s, pages), len(part)))
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
        for nll, logits, n in self.nll_chunks(ids):
            nll = np.asarray(nll[:n])
            vals, tops = (np.asarray(x[:n]) for x in top_logprobs(logits)) if k else (None, None)
            for i in range(n):
                top = tuple(zip(tops[i, :k].tolist(), vals[i, :k].tolist())) if k else ()
                out.append(TokenLogprob(ids[len(out)], -float(nll[i]), top))
        return out

    # -- introspection ----------------------------------------------------------------
    def metrics(self) -> dict:
        alloc = self.scheduler.allocator
        stats = np.asarray(self.runner.cache.stats)
        return dict(
            pages_used=alloc.num_used,
            pages_total=alloc.num_pages - 1,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions_total=self.scheduler.num_preemptions,
            kv_saturated_total=float(stats[:, 0].sum() + stats[:, 1].sum()),
            kv_nan_total=float(stats[:, 2].sum() + stats[:, 3].sum()),
            generated_tokens_total=self.num_generated_tokens,
            time=time.time(),
        )


def _host(out):
    """A step's device output -> (tokens, log-prob arrays or None) on the host."""
    if isinstance(out, tuple):
        toks, (lp, vals, ids) = out
        return np.asarray(toks), (np.asarray(lp), np.asarray(vals), np.asarray(ids))
    return np.asarray(out), None


def _pick(lps, *index) -> TokenLogprob | None:
    """Row (and step) ``index`` of the host log-prob arrays, with all MAX_LOGPROBS tops."""
    if lps is None:
        return None
    lp, vals, ids = (x[index] for x in lps)
    return TokenLogprob(-1, float(lp), tuple(zip(ids.tolist(), vals.tolist())))


def _top(entry: TokenLogprob, token: int, k: int) -> TokenLogprob:
    """The entry of sampled ``token`` keeping its k most likely alternatives."""
    assert k <= MAX_LOGPROBS
    return TokenLogprob(token, entry.logprob, entry.top[:k])
