"""Scheduler and allocator: plain Python, no device."""

import random

import pytest

from jfp8kv.engine.scheduler import Scheduler, Sequence
from jfp8kv.engine.types import SamplingParams
from jfp8kv.kvcache.allocator import PageAllocator


def make(num_pages=9, page_size=4, max_model_len=32, max_num_seqs=8, budget=16, steps=1):
    return Scheduler(PageAllocator(num_pages), page_size, max_model_len, max_num_seqs, budget,
                     steps)


def seq(rid, n, max_tokens=8):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), seed=0)


def run_step(s: Scheduler, token=7):
    """Simulate the engine: apply a step's results the way LLMEngine.step does."""
    plan = s.schedule()
    for r in plan.decode:
        for _ in range(r.steps):
            r.seq.num_cached += 1
            r.seq.output_ids.append(token)
        if len(r.seq.output_ids) >= r.seq.params.max_tokens:
            s.remove(r.seq)
    for c in plan.prefill:
        c.seq.num_cached += c.length
        if c.completes:
            c.seq.output_ids.append(token)
            if len(c.seq.output_ids) >= c.seq.params.max_tokens:
                s.remove(c.seq)
    return plan


def check_pages(s: Scheduler):
    owned = [p for q in s.running for p in q.pages] + [p for q in s.waiting for p in q.pages]
    assert len(owned) == len(set(owned)), "a page has two owners"
    assert 0 not in owned, "the sink page was handed out"
    assert len(owned) + s.allocator.num_free == s.allocator.num_pages - 1
    for q in s.running:
        assert len(q.pages) * s.page_size >= q.num_cached


def test_allocator_never_hands_out_page_zero():
    a = PageAllocator(5)
    pages = a.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and a.num_free == 0
    with pytest.raises(MemoryError):
        a.allocate(1)
    a.free(pages)
    assert a.num_free == 4
    with pytest.raises(ValueError):
        a.free([0])
    with pytest.raises(ValueError):
        PageAllocator(1)


def test_chunked_prefill_respects_budget_and_decode_has_priority():
    s = make(num_pages=33, budget=8)
    a, b = seq("a", 3), seq("b", 20)
    s.add(a)
    s.add(b)
    plan = run_step(s)
    assert [(c.seq.request_id, c.start, c.length) for c in plan.prefill] == [("a", 0, 3), ("b", 0, 5)]
    plan = run_step(s)  # a decodes (1 token), b continues its prompt with the other 7
    assert [r.seq.request_id for r in plan.decode] == ["a"]
    assert [(c.seq.request_id, c.start, c.length) for c in plan.prefill] == [("b", 5, 7)]
    assert sum(c.length for c in plan.prefill) + len(plan.decode) <= 8
    check_pages(s)


def test_preemption_by_recompute_keeps_outputs_and_frees_pages():
    # 8 usable pages of 4 tokens; two sequences that each grow to 28 tokens cannot coexist.
    s = make(num_pages=9, page_size=4, max_model_len=32, budget=32)
    a, b = seq("a", 12, max_tokens=16), seq("b", 12, max_tokens=16)
    s.add(a)
    s.add(b)
    preempted = 0
    for _ in range(200):
        if not s.has_work():
            break
        plan = run_step(s)
        preempted += len(plan.preempted)
        check_pages(s)
    assert not s.has_work()
    assert preempted >= 1 and s.num_preemptions == preempted
    assert b.num_preemptions >= 1 and a.num_preemptions == 0  # newest is the victim
    assert len(a.output_ids) == 16 and len(b.output_ids) == 16
    assert s.allocator.num_free == 8


def test_random_workload_never_loses_a_request_or_a_page():
    rng = random.Random(0)
    s = make(num_pages=13, page_size=4, max_model_len=40, max_num_seqs=4, budget=12, steps=3)
    seqs = [seq(str(i), rng.randint(1, 30), max_tokens=rng.randint(1, 9)) for i in range(25)]
    for q in seqs:
        s.add(q)
    for i in range(2000):
        if not s.has_work():
            break
        if i == 5:
            s.remove(seqs[3])  # an abort
        run_step(s)
        check_pages(s)
    assert not s.has_work()
    assert all(len(q.output_ids) == q.params.max_tokens for q in seqs if q is not seqs[3])
    assert s.allocator.num_free == 12


def test_multi_step_decode_is_capped_by_max_tokens_and_model_len():
    s = make(num_pages=33, page_size=4, max_model_len=12, budget=64, steps=8)
    a = seq("a", 5, max_tokens=100)
    s.add(a)
    run_step(s)  # prefill: 5 cached, 1 output
    plan = s.schedule()
    assert plan.decode[0].steps == 12 - 5  # max_model_len bounds positions
    b = seq("b", 2, max_tokens=3)
    s2 = make(steps=8)
    s2.add(b)
    run_step(s2)
    assert s2.schedule().decode[0].steps == 2  # 3 tokens total, 1 already sampled
