"""PageAllocator + PrefixCache against a plain reference model of page ownership (no device).

The reference keeps, per page, its holders, whether it is clean, cached-evictable (in freeing
order) or in use, and the token prefix whose K/V it holds; a simulated pool writes that
prefix into a page when a request computes it and poison when a page is handed out.
"""

import collections
import random

import pytest

from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.kvcache.prefix_cache import PrefixCache, namespace_root

PS = 4
POISON = ("poison",)


class Model:
    """The reference: page ownership and contents, the expected cache and LRU order."""

    def __init__(self, num_pages):
        self.refs = collections.Counter()
        self.clean = set(range(1, num_pages))
        self.lru: list[int] = []  # cached pages nobody holds, least recently freed first
        self.cached: dict[tuple, int] = {}  # token prefix -> page
        self.content: dict[int, tuple] = {}

    def cached_pages(self):
        return set(self.cached.values())

    def on_allocate(self, pages):
        from_clean = [p for p in pages if p in self.clean]
        assert len(from_clean) == min(len(pages), len(self.clean)), "evicted while clean left"
        evicted = [p for p in pages if p not in self.clean]
        assert evicted == self.lru[:len(evicted)], "eviction is not least recently freed"
        del self.lru[:len(evicted)]
        self.cached = {k: p for k, p in self.cached.items() if p not in evicted}
        for p in pages:
            assert self.refs[p] == 0, f"page {p} handed out while held"
            self.clean.discard(p)
            self.refs[p] = 1
            self.content[p] = POISON

    def on_share(self, pages):
        for p in pages:
            if p in self.lru:
                self.lru.remove(p)
            self.refs[p] += 1

    def on_free(self, pages):
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                (self.lru.append if p in self.cached_pages() else self.clean.add)(p)

    def on_register(self, tokens, pages, start, num_computed):
        for j in range(start, min(num_computed // PS, len(pages))):
            key = tuple(tokens[:(j + 1) * PS])
            if key not in self.cached and pages[j] not in self.cached_pages():
                self.cached[key] = pages[j]

    def expected_hits(self, tokens):
        pages = []
        for j in range((len(tokens) - 1) // PS):
            page = self.cached.get(tuple(tokens[:(j + 1) * PS]))
            if page is None:
                break
            pages.append(page)
        return pages


class Req:
    def __init__(self, tokens):
        self.tokens, self.pages, self.keys, self.computed, self.registered = tokens, [], [], 0, 0


def check(alloc: PageAllocator, cache: PrefixCache, m: Model, reqs, scratch):
    held = collections.Counter(p for r in reqs for p in r.pages)
    held.update(p for s in scratch for p in s)
    assert 0 not in held
    for p in range(1, alloc.num_pages):
        assert alloc.refcount(p) == held[p] == m.refs[p], f"page {p}: count drift"
    assert alloc.num_free == len(m.clean) + len(m.lru) == alloc.num_pages - 1 - len(held)
    assert cache.stats().cached_pages == alloc.num_cached == len(m.cached)
    for key, p in m.cached.items():
        assert alloc.is_cached(p) and m.content[p] == key, f"cached page {p} holds stale data"


def compute(alloc, m, r, upto):
    """The request computes its tokens up to ``upto`` (allocating pages, writing them)."""
    need = -(-upto // PS) - len(r.pages)
    if need > 0:
        if not alloc.can_allocate(need):
            return
        new = alloc.allocate(need)
        m.on_allocate(new)
        r.pages += new
    for pos in range(r.computed, upto):
        page = r.pages[pos // PS]
        assert alloc.refcount(page) == 1 and not alloc.is_cached(page), "write to a shared page"
        m.content[page] = tuple(r.tokens[:(pos // PS + 1) * PS]) if (pos + 1) % PS == 0 \
            else ("partial", page)
    r.computed = max(r.computed, upto)


def admit(alloc, cache, m, tokens):
    r = Req(tokens)
    hits = cache.match(tokens, r.keys)
    assert hits == m.expected_hits(tokens)
    for j, p in enumerate(hits):
        assert m.content[p] == tuple(tokens[:(j + 1) * PS]), "a hit maps stale data"
    if not alloc.can_allocate(1, sharing=hits):
        return None
    alloc.share(hits)
    m.on_share(hits)
    r.pages, r.computed, r.registered = list(hits), len(hits) * PS, len(hits)
    return r


def release(alloc, cache, m, r, register):
    if register:
        m.on_register(r.tokens, r.pages, r.registered, r.computed)
        r.registered = cache.register(r.tokens, r.keys, r.pages, r.registered, r.computed)
    alloc.free(reversed(r.pages))
    m.on_free(list(reversed(r.pages)))


@pytest.mark.parametrize("seed", range(6))
def test_random_share_finish_preempt_abort_evict_against_reference(seed):
    rng = random.Random(seed)
    num_pages = rng.choice([6, 10, 17])
    alloc = PageAllocator(num_pages)
    cache = PrefixCache(alloc, PS, namespace=("model", "fp8_e4m3", "token"))
    m = Model(num_pages)
    heads = [[rng.randint(1, 6) for _ in range(rng.randint(0, 13))] for _ in range(4)]
    reqs: list[Req] = []
    scratch: list[list[int]] = []
    counts = collections.Counter()
    for _ in range(3000):
        op = rng.choices(["admit", "compute", "grow", "register", "release", "scratch",
                          "reset"], [6, 8, 4, 3, 5, 1, 0.1])[0]
        if op == "admit" and len(reqs) < 5:
            tokens = rng.choice(heads) + [rng.randint(1, 6) for _ in range(rng.randint(1, 9))]
            r = admit(alloc, cache, m, tokens)
            if r is not None:
                reqs.append(r)
                counts["hit_pages"] += len(r.pages)
        elif op in ("compute", "grow", "register", "release") and reqs:
            r = rng.choice(reqs)
            if op == "compute":
                compute(alloc, m, r, rng.randint(r.computed, len(r.tokens)))
            elif op == "grow" and r.computed == len(r.tokens):  # a decoded token
                r.tokens = r.tokens + [rng.randint(1, 6)]
            elif op == "register":
                m.on_register(r.tokens, r.pages, r.registered, r.computed)
                r.registered = cache.register(r.tokens, r.keys, r.pages, r.registered, r.computed)
            elif op == "release":  # finish or preemption register first; an abort may not
                release(alloc, cache, m, r, register=rng.random() < 0.8)
                reqs.remove(r)
        elif op == "scratch":  # LLM.nll's pages: taken and given back directly
            n = rng.randint(1, 3)
            if alloc.can_allocate(n):
                pages = alloc.allocate(n)
                m.on_allocate(pages)
                scratch.append(pages)
        elif op == "reset":
            cache.reset()
            for p in m.lru:
                m.clean.add(p)
            m.lru, m.cached = [], {}
            for r in reqs:  # pages computed before a reset are never offered again
                r.registered = max(r.registered, r.computed // PS)
        if scratch and rng.random() < 0.3:
            pages = scratch.pop()
            alloc.free(pages)
            m.on_free(pages)
        check(alloc, cache, m, reqs, scratch)
    for r in list(reqs):
        release(alloc, cache, m, r, register=True)
        reqs.remove(r)
    for pages in scratch:
        alloc.free(pages)
        m.on_free(pages)
    check(alloc, cache, m, [], [])
    assert alloc.num_used == 0 and alloc.num_free == num_pages - 1
    st = cache.stats()
    assert counts["hit_pages"] > 0 and st.evictions > 0  # the run exercised sharing and LRU


def test_keys_depend_on_namespace_and_every_earlier_token():
    alloc = PageAllocator(9)
    a = PrefixCache(alloc, PS, namespace="bf16")
    toks = list(range(1, 13))
    keys = a.extend_keys(toks, [], 3)
    assert len(set(keys)) == 3
    assert a.extend_keys(toks[:4] + [9] + toks[5:], [], 3)[1:] != keys[1:]  # page 1 differs,
    assert a.extend_keys(toks[:4] + [9] + toks[5:], [], 3)[0] == keys[0]  # page 0 does not
    assert namespace_root("bf16") != namespace_root("fp8_e4m3/token")
    b = PrefixCache(PageAllocator(9), PS, namespace="fp8_e4m3/token")
    assert b.extend_keys(toks, [], 3) != keys


def test_a_lookup_in_another_namespace_misses():
    alloc = PageAllocator(9)
    cache = PrefixCache(alloc, PS, namespace="scales v1")
    toks = list(range(1, 10))
    pages = alloc.allocate(3)
    assert cache.register(toks, [], pages, 0, 9) == 2
    assert cache.match(toks, []) == pages[:2]
    cache.reset(namespace="scales v2")
    assert cache.match(toks, []) == [] and alloc.num_cached == 0
    alloc.free(pages)
    assert alloc.num_free == 8


def test_allocator_refuses_misuse():
    alloc = PageAllocator(5)
    cache = PrefixCache(alloc, PS)
    [p] = alloc.allocate(1)
    with pytest.raises(ValueError, match="freed 2 times"):
        alloc.free([p, p])
    alloc.free([p])
    with pytest.raises(ValueError, match="neither in use nor cached"):
        alloc.share([p])
    with pytest.raises(ValueError, match="not in use"):
        alloc.mark_cached(p)
    with pytest.raises(ValueError, match="already serves"):
        PrefixCache(alloc, PS)
    with pytest.raises(ValueError, match="full pages need"):
        cache.extend_keys([1, 2, 3], [], 1)
