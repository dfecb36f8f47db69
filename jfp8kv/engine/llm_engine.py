"""The engine step: schedule (host), run (device), post-process (host).

Not thread-safe: one thread owns the engine and alone calls add_request / abort_request /
step (the server's async bridge does exactly that).
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from jfp8kv.engine.errors import EngineOverloaded
from jfp8kv.engine.runner import ModelRunner, SamplingArrays
from jfp8kv.engine.scheduler import Scheduler, Sequence
from jfp8kv.engine.stats import StepStats
from jfp8kv.engine.types import RequestOutput, SamplingParams

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
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit); shorten the prompt or "
                f"raise max_model_len")
        if len(self.scheduler.waiting) >= self.max_queue_len:
            raise EngineOverloaded(
                f"{len(self.scheduler.waiting)} requests are waiting (max_queue_len="
                f"{self.max_queue_len}); retry later")
        n = next(self._counter)
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + n)
        seq = Sequence(request_id, ids, params, seed=seed & 0xFFFFFFFF, prompt=text)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str, report: bool = True) -> None:
        """Drop a request and free its pages; its final output (finish_reason "abort") is
        returned by the next ``step`` unless ``report`` is False. Unknown ids are ignored."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        if report:
            self._aborted.append(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        changed: dict[str, Sequence] = {s.request_id: s for s in self._aborted}
        self._aborted = []
        rec = self.stats.begin()
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
            toks = np.asarray(decode_out)
            for i, row in enumerate(plan.decode):
                seq = row.seq
                for j in range(row.steps):
                    seq.num_cached += 1
                    if self._append(seq, int(toks[i, j])):
                        break
                changed[seq.request_id] = seq
        if prefill_out is not None:
            toks = np.asarray(prefill_out)
            for i, chunk in enumerate(plan.prefill):
                seq = chunk.seq
                seq.num_cached += chunk.length
                if chunk.completes:
                    self._append(seq, int(toks[i]))
                    changed[seq.request_id] = seq
        outputs = [self._output(s) for s in changed.values()]
        self.stats.end(rec)
        return outputs

    def _sampling(self, seqs: list[Sequence]) -> SamplingArrays:
        return SamplingArrays(
            temperature=np.array([s.params.temperature for s in seqs], np.float32),
            top_k=np.array([s.params.top_k for s in seqs], np.int32),
            top_p=np.array([s.params.top_p for s in seqs], np.float32),
            seeds=np.array([s.seed for s in seqs], np.uint32),
            counters=np.array([len(s.output_ids) for s in seqs], np.int32))

    @staticmethod
    def _greedy(seqs) -> bool:
        return all(s.params.greedy for s in seqs)

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append a sampled token, apply stop rules; return True if the sequence finished."""
        p = seq.params
        seq.output_ids.append(token)
        self.num_generated_tokens += 1
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        seq.text = self._detokenize(seq)
        if reason is None and p.stop:
            cut = min((i for i in (seq.text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is None and (len(seq.output_ids) >= p.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.remove(seq)
            self._seqs.pop(seq.request_id, None)
            return True
        return False

    def _detokenize(self, seq: Sequence) -> str:
        ids = seq.output_ids
        if ids and ids[-1] in self.eos_token_ids and not seq.params.ignore_eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, list(seq.prompt_token_ids), list(seq.output_ids),
                             seq.text, seq.finish_reason, seq.prompt, seq.num_preemptions)

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
