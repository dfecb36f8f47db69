"""Scheduler and allocator: plain Python, no device."""

import collections
import random

import pytest

from jfp8kv.engine.scheduler import Scheduler, Sequence
from jfp8kv.engine.types import SamplingParams
from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.kvcache.prefix_cache import PrefixCacheStats


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
    """Page ownership is exact: every page's reference count equals its holders, held and free
    pages partition the pool, and a shared or cached page is full and computed for every
    holder (so nobody writes it)."""
    holders = collections.Counter(p for q in [*s.running, *s.waiting] for p in q.pages)
    a = s.allocator
    assert 0 not in holders, "the sink page was handed out"
    assert all(a.refcount(p) == holders[p] for p in range(1, a.num_pages)), "refcount drift"
    assert len(holders) + a.num_free == a.num_pages - 1, "a page leaked"
    for q in s.running:
        assert len(q.pages) * s.page_size >= q.num_cached
        for j, p in enumerate(q.pages):
            if holders[p] > 1 or a.is_cached(p):
                assert (j + 1) * s.page_size <= q.num_cached, "a shared page is still written"


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
    # c shares no prefix with a or b
    c = Sequence("c", list(range(100, 106)), SamplingParams(max_tokens=8), seed=0)
    for q in (a, b, c):
        s.add(q)
    chunks = lambda plan: [(c.seq.request_id, c.start, c.length) for c in plan.prefill]  # noqa
    plan = run_step(s)  # the budget in arrival order; handed over longest first
    assert chunks(plan) == [("b", 0, 5), ("a", 0, 3)]
    plan = run_step(s)  # a decodes beside; its row does not take prefill budget
    assert [r.seq.request_id for r in plan.decode] == ["a"]
    assert chunks(plan) == [("b", 5, 8)]
    plan = run_step(s)  # b's last 7 tokens first (part-way prompts before admissions), then c
    assert [r.seq.request_id for r in plan.decode] == ["a"]
    assert chunks(plan) == [("b", 13, 7), ("c", 0, 1)]
    assert sum(c.length for c in plan.prefill) <= 8
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


def test_decode_beside_prefill_takes_one_step_and_alone_takes_decode_steps():
    s = make(num_pages=40, page_size=4, max_model_len=40, budget=8, steps=8)
    assert s.step_counts == (1, 8)
    a = seq("a", 5, max_tokens=20)
    b = Sequence("b", list(range(100, 112)), SamplingParams(max_tokens=20), seed=0)
    s.add(a)
    plan = run_step(s)  # a's prompt alone: nothing decodes
    assert plan.num_steps == 1 and not plan.decode
    s.add(b)
    plan = run_step(s)  # a decodes beside b's first chunk: one token
    assert [(r.seq, r.steps) for r in plan.decode] == [(a, 1)] and plan.prefill
    assert plan.num_steps == 1
    plan = run_step(s)  # b's last chunk: still one
    assert plan.prefill and plan.num_steps == 1 and plan.decode[0].steps == 1
    plan = run_step(s)  # decode alone: the full dispatch
    assert not plan.prefill and plan.num_steps == 8
    assert sorted(r.steps for r in plan.decode) == [8, 8]
    a.params = SamplingParams(max_tokens=len(a.output_ids) + 3)  # rows shorter than 8
    plan = s.schedule()
    assert plan.num_steps == 8 and sorted(r.steps for r in plan.decode) == [3, 8]
    assert make(steps=1).step_counts == (1,)


# -- prefix caching ---------------------------------------------------------------------

def fake_model(tokens) -> int:
    """A deterministic 'greedy model': the next token is a function of the whole prefix."""
    return hash(tuple(tokens)) % 11 + 1


class FakePool:
    """The device pool, simulated: the 'K/V' at a slot is the token prefix that produced it.
    A step checks that every position a sequence reads holds its own prefix (no stale or
    foreign data) and that nobody writes a shared or cached page."""

    def __init__(self, s: Scheduler):
        self.s, self.mem = s, {}

    def _slot(self, seq, pos):
        return seq.pages[pos // self.s.page_size], pos % self.s.page_size

    def write(self, seq, pos):
        page = seq.pages[pos // self.s.page_size]
        assert self.s.allocator.refcount(page) == 1 and not self.s.allocator.is_cached(page)
        self.mem[self._slot(seq, pos)] = hash(tuple(seq.tokens[:pos + 1]))

    def check_reads(self, seq, upto):
        for pos in range(upto):
            assert self.mem.get(self._slot(seq, pos)) == hash(tuple(seq.tokens[:pos + 1])), \
                f"{seq.request_id} reads stale K/V at position {pos}"


def sim_step(s: Scheduler, pool: FakePool):
    """LLMEngine.step on the fake pool and model: decode, then prefill chunks."""
    plan = s.schedule()
    for r in plan.decode:
        q = r.seq
        pool.check_reads(q, q.num_cached)
        for _ in range(r.steps):
            pool.write(q, q.num_cached)
            q.num_cached += 1
            q.output_ids.append(fake_model(q.tokens))
            if len(q.output_ids) >= q.params.max_tokens:
                s.remove(q)
                break
    for c in plan.prefill:
        q = c.seq
        pool.check_reads(q, c.start)
        for pos in range(c.start, c.start + c.length):
            pool.write(q, pos)
        q.num_cached += c.length
        if c.completes:
            q.output_ids.append(fake_model(q.tokens))
            if len(q.output_ids) >= q.params.max_tokens:
                s.remove(q)
    check_pages(s)
    return plan


def chunks(plan):
    return [(c.seq.request_id, c.start, c.length) for c in plan.prefill]


def test_shared_prefix_maps_cached_pages_and_prefills_only_the_rest():
    s = make(num_pages=33, page_size=4, budget=64)
    pool = FakePool(s)
    a = Sequence("a", list(range(1, 11)), SamplingParams(max_tokens=8), seed=0)
    s.add(a)
    sim_step(s, pool)  # a's whole prompt: pages 0 and 1 full, page 2 half
    b = Sequence("b", list(range(1, 9)) + [50, 51, 52], SamplingParams(max_tokens=8), seed=0)
    s.add(b)
    plan = sim_step(s, pool)
    assert [r.seq.request_id for r in plan.decode] == ["a"]
    assert chunks(plan) == [("b", 8, 3)]  # the first 8 tokens came from a's pages
    assert b.pages[:2] == a.pages[:2] and b.pages[2] not in a.pages
    assert [s.allocator.refcount(p) for p in b.pages] == [2, 2, 1]
    assert b.num_cached_prompt_tokens == 8 and a.num_cached_prompt_tokens == 0
    st = s.prefix_cache_stats()
    assert (st.queried_tokens, st.hit_tokens, st.cached_pages) == (10 + 11, 8, 2)
    assert st.hit_rate == 8 / 21
    while s.has_work():
        sim_step(s, pool)
    assert s.allocator.num_used == 0 and s.allocator.num_free == 32


def test_fully_cached_prompt_still_computes_its_last_token():
    s = make(num_pages=33, page_size=4, budget=64)
    pool = FakePool(s)
    s.add(seq("a", 8, max_tokens=1))
    sim_step(s, pool)  # finished: both pages stay cached
    assert s.allocator.num_used == 0 and s.prefix_cache_stats().cached_pages == 2
    b, c = seq("b", 8, max_tokens=1), seq("c", 9, max_tokens=1)
    s.add(b)
    # Only page 0 is mapped: the page holding the last token is recomputed, in a new page.
    assert chunks(sim_step(s, pool)) == [("b", 4, 4)]
    s.add(c)
    assert chunks(sim_step(s, pool)) == [("c", 8, 1)]
    assert (b.num_cached_prompt_tokens, c.num_cached_prompt_tokens) == (4, 8)


def test_finished_pages_are_evicted_least_recently_used_tail_first():
    s = make(num_pages=9, page_size=4, max_model_len=32, budget=64)
    pool = FakePool(s)
    x = Sequence("x", list(range(1, 13)), SamplingParams(max_tokens=1), seed=0)
    y = Sequence("y", list(range(101, 109)), SamplingParams(max_tokens=1), seed=0)
    for q in (x, y):
        s.add(q)
        sim_step(s, pool)
    assert s.prefix_cache_stats().cached_pages == 5 and s.allocator.num_free == 8
    z = Sequence("z", list(range(201, 217)), SamplingParams(max_tokens=1), seed=0)
    s.add(z)  # 4 pages: the 3 clean ones, then x's last page (least recently freed)
    sim_step(s, pool)
    assert s.prefix_cache_stats().evictions == 1
    # x keeps its first two pages, y all of its own (lookups change nothing).
    assert len(s.prefix_cache.match(x.prompt_token_ids + [7], [])) == 2
    assert len(s.prefix_cache.match(y.prompt_token_ids + [7], [])) == 2
    x2 = Sequence("x2", x.prompt_token_ids + [7], SamplingParams(max_tokens=1), seed=0)
    s.add(x2)
    assert chunks(sim_step(s, pool)) == [("x2", 8, 5)]


def test_abort_of_a_sharer_and_preemption_keep_counts_exact():
    s = make(num_pages=33, page_size=4, budget=64)
    pool = FakePool(s)
    a = seq("a", 10, max_tokens=20)
    s.add(a)
    sim_step(s, pool)
    b = seq("b", 10, max_tokens=20)
    s.add(b)
    sim_step(s, pool)
    shared = a.pages[:2]
    assert b.pages[:2] == shared and [s.allocator.refcount(p) for p in shared] == [2, 2]
    s.remove(b)  # abort
    check_pages(s)
    assert [s.allocator.refcount(p) for p in shared] == [1, 1]
    assert (a.num_tokens, a.num_cached) == (12, 11)  # pages 0 and 1 full, page 2 not
    s._preempted = []
    s._preempt(a)  # all of a's full computed pages stay cached for its readmission
    check_pages(s)
    assert s.allocator.num_used == 0 and s.allocator.is_cached(shared[0])
    plan = sim_step(s, pool)
    assert chunks(plan) == [("a", 8, 4)]  # only the tail is recomputed
    assert a.num_cached_prompt_tokens == 0  # readmissions don't count as prompt hits


def test_disabled_prefix_caching_recomputes_everything():
    s = Scheduler(PageAllocator(33), 4, 32, 8, 64, enable_prefix_caching=False)
    pool = FakePool(s)
    s.add(seq("a", 10, max_tokens=1))
    sim_step(s, pool)
    s.add(seq("b", 10, max_tokens=1))
    assert chunks(sim_step(s, pool)) == [("b", 0, 10)]
    assert s.prefix_cache_stats() == PrefixCacheStats() and s.allocator.num_cached == 0


def test_reset_forgets_cached_pages():
    s = make(num_pages=33, page_size=4, budget=64)
    pool = FakePool(s)
    s.add(seq("a", 10, max_tokens=1))
    sim_step(s, pool)
    s.reset_prefix_cache(namespace="new static scales")
    assert s.prefix_cache_stats().cached_pages == 0 and s.allocator.num_free == 32
    s.add(seq("b", 10, max_tokens=1))
    assert chunks(sim_step(s, pool)) == [("b", 0, 10)]


def run_workload(enable: bool, seed: int):
    rng = random.Random(seed)
    s = Scheduler(PageAllocator(15), 4, 48, 4, 12, 3, enable_prefix_caching=enable)
    pool = FakePool(s)
    heads = [[rng.randint(1, 50) for _ in range(rng.randint(5, 14))] for _ in range(3)]
    seqs = []
    for i in range(30):
        prompt = rng.choice(heads) + [rng.randint(1, 50) for _ in range(rng.randint(0, 10))]
        seqs.append(Sequence(str(i), prompt, SamplingParams(max_tokens=rng.randint(1, 12)), 0))
    aborts = {rng.randrange(30): rng.randrange(60) for _ in range(4)}
    pending = list(seqs)
    for step in range(3000):
        while pending and rng.random() < 0.5:
            s.add(pending.pop(0))
        for i, at in aborts.items():
            if at == step:
                s.remove(seqs[i])  # an abort: waiting, running or already finished
        if not s.has_work() and not pending:
            break
        sim_step(s, pool)
    assert not s.has_work() and not pending
    assert s.allocator.num_used == 0 and s.allocator.num_free == 14
    done = {q.request_id: q.output_ids for q in seqs if q.request_id not in
            {str(i) for i in aborts}}
    return done, s


@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefix_workload_matches_no_caching(seed):
    """Shared heads, aborts, preemptions and evictions: with and without caching the fake
    model produces the same tokens, no step reads stale data, and no page leaks."""
    with_cache, s = run_workload(True, seed)
    without, s0 = run_workload(False, seed)
    assert with_cache == without
    st = s.prefix_cache_stats()
    assert st.hit_tokens > 0 and st.evictions > 0
    assert s.num_preemptions > 0 and s0.num_preemptions > 0
