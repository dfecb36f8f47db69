"""The state snapshot policy through the scheduler, against a model device (plain Python, no
arrays): a state slot holds the tuple of tokens its state has consumed, and the model's next
token is a function of that tuple only. Agent-like conversations (a shared system prompt;
each turn appends the last answer and new text) run on a small pool with few snapshot slots,
so pages and snapshots are evicted and sequences preempted; decode dispatches run several
steps and keep going past a stop, as the engine's do.

Checked after every step: a chunk starts from exactly the state of the tokens before it
(restored or fresh); every registered snapshot holds the tokens its page key names; snapshot
slots are free, held by a running sequence or registered, never two at once. And the
tokens equal a run without prefix caching while snapshots are restored."""

import random
import zlib

import pytest

from jfp8kv.engine.scheduler import Scheduler, Sequence
from jfp8kv.engine.types import SamplingParams
from jfp8kv.kvcache.allocator import PageAllocator

V = 200


def next_token(state: tuple) -> int:
    return zlib.crc32(bytes(state)) % (V - 3) + 3


class Device:
    """Slot -> the tokens its state consumed."""

    def __init__(self):
        self.state: dict[int, tuple] = {}

    def prefill(self, c) -> int:
        seq, slot = c.seq, c.seq.state_slot
        if c.restore:
            self.state[slot] = self.state[c.restore]
        if c.start == 0:
            self.state[slot] = ()
        assert self.state[slot] == tuple(seq.tokens[:c.start]), "a chunk began from a wrong state"
        self.state[slot] += tuple(seq.tokens[c.start:c.start + c.length])
        if c.capture:
            self.state[c.capture] = self.state[slot]
        return next_token(self.state[slot])

    def decode(self, r) -> list[int]:
        slot, tok, out = r.seq.state_slot, r.seq.last_token, []
        assert self.state[slot] == tuple(r.seq.tokens[:r.seq.num_cached])
        for i in range(r.steps):  # the device does not know where the host will stop
            self.state[slot] += (tok,)
            if r.capture is not None and r.capture[0] == i:
                self.state[r.capture[1]] = self.state[slot]
            tok = next_token(self.state[slot])
            out.append(tok)
        return out


def take(s: Scheduler, seq: Sequence, toks: list[int], base: int, eos=11) -> None:
    """The engine's stop rules: a token divisible by ``eos`` stops (kept), or max_tokens."""
    end, stop = len(toks), False
    for j, t in enumerate(toks):
        if t % eos == 0 or len(seq.output_ids) + j + 1 >= seq.params.max_tokens:
            end, stop = j + 1, True
            break
    seq.output_ids.extend(toks[:end])
    if stop:
        seq.num_cached = base + end - 1
        s.remove(seq)


def run_step(s: Scheduler, dev: Device) -> None:
    """One scheduler step on the device stand-in: decode rows, then prefill chunks, each
    row's tokens through the engine's stop rules (``take``)."""
    plan = s.schedule()
    for r in plan.decode:
        n0 = r.seq.num_cached
        toks = dev.decode(r)
        r.seq.num_cached += r.steps
        take(s, r.seq, toks, n0 + 1)
    for c in plan.prefill:
        tok = dev.prefill(c)
        c.seq.num_cached += c.length
        if c.completes:
            take(s, c.seq, [tok], c.seq.num_cached)


def check(s: Scheduler, dev: Device) -> None:
    pool, ps = s.snapshots.pool, s.page_size
    for key, slot in pool._slot_of.items():
        got = dev.state[slot]
        assert len(got) % ps == 0 and got
        keys = s.prefix_cache.extend_keys(list(got), [], len(got) // ps)
        assert keys[-1] == key, "a snapshot holds other tokens than its key names"
    held = [x[1] for q in s.running if q.snap for x in [*q.snap.saves, q.snap.ckpt,
                                                          q.snap.staging] if x]
    assert len(set(held)) == len(held) == pool.num_held
    assert not set(held) & set(pool._key_of) and not set(held) & set(pool._free)


def converse(caching: bool, seed: int, sessions=6, turns=3, snapshots=5):
    rnd = random.Random(seed)
    ps, seqs = 4, 3
    s = Scheduler(PageAllocator(26), ps, 100, seqs, 12, 4, enable_prefix_caching=caching,
                  state_slots=seqs, snapshot_slots=(seqs + 2, snapshots) if caching else (0, 0))
    dev, system = Device(), [rnd.randrange(3, V) for _ in range(9)]
    own = [random.Random(seed * 1000 + i) for i in range(sessions)]  # any finishing order
    convs = [system + [r.randrange(3, V) for _ in range(r.randint(1, 6))] for r in own]
    done = [0] * sessions
    outputs, cached, live = [], [], {}

    def submit(i):
        q = Sequence(f"{i}.{done[i]}", list(convs[i]),
                     SamplingParams(max_tokens=own[i].randint(2, 14)), seed=0)
        live[q.request_id] = (i, q)
        s.add(q)

    for i in range(sessions):
        submit(i)
    while s.has_work():
        run_step(s, dev)
        if caching:
            check(s, dev)
        for rid, (i, q) in list(live.items()):
            if q.finish_reason is None and q not in s.running and q not in s.waiting:
                del live[rid]
                outputs.append((rid, q.output_ids))
                cached.append(q.num_cached_prompt_tokens)
                done[i] += 1
                r = own[i]
                convs[i] = q.tokens + [r.randrange(3, V) for _ in range(r.randint(1, 9))]
                if done[i] < turns:
                    submit(i)
    assert s.allocator.num_used == 0
    return sorted(outputs), cached, s


@pytest.mark.parametrize("run", range(6))
def test_conversations_restore_exact_states_and_equal_the_uncached_tokens(run):
    seed = random.randrange(1 << 30)
    got, cached, s = converse(True, seed)
    want, none, _ = converse(False, seed)
    assert got == want and not any(none)
    stats = s.snapshot_stats()
    assert stats.hits > 0 and stats.saves > 0 and sum(cached) > 0
    assert stats.evictions > 0 and s.num_preemptions + s.prefix_cache_stats().evictions > 0
    assert s.snapshots.pool.num_held == 0


@pytest.mark.parametrize("run", range(4))
def test_a_finished_turn_leaves_its_last_page_boundary(run):
    """One conversation alone on a roomy pool, answers stopped at random (so decode runs
    past the stop): each next turn restores the state at the last page boundary of the
    previous prompt + answer (its computed tokens), whether the answer crossed it (a decode
    capture) or not (the prompt's last chunk was cut there)."""
    ps, rnd = 4, random.Random()
    s = Scheduler(PageAllocator(80), ps, 300, 2, 16, 4, state_slots=2, snapshot_slots=(4, 24))
    dev, conv, prev = Device(), [rnd.randrange(3, V) for _ in range(11)], None
    for turn in range(6):
        q = Sequence(str(turn), list(conv), SamplingParams(max_tokens=rnd.randint(6, 20)),
                     seed=0)
        s.add(q)
        while s.has_work():
            run_step(s, dev)
            check(s, dev)
        if prev is not None:
            assert q.num_cached_prompt_tokens == (len(prev.tokens) - 1) // ps * ps
        prev = q
        conv = q.tokens + [rnd.randrange(3, V) for _ in range(rnd.randint(1, 5))]
    assert s.snapshot_stats().evictions == 0


@pytest.mark.parametrize("run", range(3))
def test_round_robin_sessions_keep_their_last_turn(run):
    """Four conversations take turns, one at a time, with snapshot slots for about two per
    conversation: a finished request's earlier states (the one it restored, its prompt's)
    go before other conversations' last ones, so every next turn still finds its own."""
    ps, rnd = 4, random.Random()
    s = Scheduler(PageAllocator(200), ps, 400, 1, 16, 4, state_slots=1, snapshot_slots=(3, 9))
    dev = Device()
    convs = [[rnd.randrange(3, V) for _ in range(rnd.randint(9, 30))] for _ in range(4)]
    prev: dict[int, Sequence] = {}
    for turn in range(5):
        for i in range(4):
            q = Sequence(f"{i}.{turn}", list(convs[i]), SamplingParams(
                max_tokens=rnd.randint(5, 12)), seed=0)
            s.add(q)
            while s.has_work():
                run_step(s, dev)
                check(s, dev)
            if i in prev:
                assert q.num_cached_prompt_tokens == (len(prev[i].tokens) - 1) // ps * ps
            prev[i] = q
            convs[i] = q.tokens + [rnd.randrange(3, V) for _ in range(rnd.randint(1, 6))]
    assert s.snapshot_stats().evictions > 0
