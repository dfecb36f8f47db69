"""A tiny stand-in for ``LLMEngine`` to unit-test the thread bridge without a model.

Token t of a request is ``(sum(prompt) + t) % 100``; its text is ``f"<{id}>"``. Every
``step()`` advances each running request by one token. It keeps the real engine's contract:
not thread-safe (it asserts that one thread calls it), cumulative outputs, ValueError for long
prompts, EngineOverloaded past ``max_queue_len``. ``fail_steps`` makes the next steps raise;
``poison`` names requests (or ``poison_token`` marks prompts) whose output is malformed
(``token_ids=None``).
"""

from __future__ import annotations

import threading

from jfp8kv.engine.errors import EngineOverloaded
from jfp8kv.engine.types import RequestOutput


class FakeEngine:
    model_name = "fake"
    max_model_len = 64

    def __init__(self, max_running: int = 4, max_queue_len: int = 8):
        self.max_running, self.max_queue_len = max_running, max_queue_len
        self.running: dict[str, RequestOutput] = {}
        self.waiting: dict[str, RequestOutput] = {}
        self.max_tokens: dict[str, int] = {}
        self.fail_steps = 0
        self.poison: set[str] = set()
        self.poison_token = 666
        self.steps = 0
        self._thread = None

    def _check_thread(self):
        if self._thread is None:
            self._thread = threading.get_ident()
        assert self._thread == threading.get_ident(), "engine called from two threads"

    def add_request(self, request_id, prompt, params):
        self._check_thread()
        ids = list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}")
        if len(self.waiting) >= self.max_queue_len:
            raise EngineOverloaded("queue full")
        self.waiting[request_id] = RequestOutput(request_id, ids)
        self.max_tokens[request_id] = params.max_tokens

    def abort_request(self, request_id):
        self._check_thread()
        self.running.pop(request_id, None)
        self.waiting.pop(request_id, None)

    def num_waiting(self):
        return len(self.waiting)

    def has_unfinished(self):
        self._check_thread()
        return bool(self.running or self.waiting)

    def step(self):
        self._check_thread()
        self.steps += 1
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        while self.waiting and len(self.running) < self.max_running:
            rid = next(iter(self.waiting))
            self.running[rid] = self.waiting.pop(rid)
        outs = []
        for rid, out in list(self.running.items()):
            tok = (sum(out.prompt_token_ids) + len(out.token_ids)) % 100
            out.token_ids.append(tok)
            out.text += f"<{tok}>"
            if len(out.token_ids) >= self.max_tokens[rid]:
                out.finish_reason = "length"
                del self.running[rid]
            snapshot = RequestOutput(rid, out.prompt_token_ids, list(out.token_ids), out.text,
                                     out.finish_reason)
            if rid in self.poison or self.poison_token in out.prompt_token_ids:
                snapshot.token_ids = None
            outs.append(snapshot)
        return outs

    def metrics(self):
        return {"pages_used": len(self.running), "pages_total": 16,
                "num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_preemptions_total": 0, "kv_saturated_total": 0, "kv_nan_total": 0}
