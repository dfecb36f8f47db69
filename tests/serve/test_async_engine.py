"""Unit tests of the engine-thread bridge against a fake engine (no model, no HTTP)."""

from __future__ import annotations

import asyncio

import pytest

from jfp8kv.engine.errors import EngineOverloaded
from jfp8kv.engine.types import SamplingParams
from jfp8kv.serve.async_engine import AsyncEngine, ServerDraining, safe_text
from .fake_engine import FakeEngine


def run(coro, timeout_s: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def _with_engine(fake: FakeEngine, body):
    ae = AsyncEngine(fake, idle_wait_s=0.05)
    ae.start()
    try:
        return await body(ae)
    finally:
        await asyncio.to_thread(ae.shutdown)


async def _wait_idle(ae: AsyncEngine, fake: FakeEngine, limit_s: float = 5.0):
    for _ in range(int(limit_s / 0.01)):
        if not fake.running and not fake.waiting and ae.metrics.engine_snapshot.get("num_running") == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not become idle")


def test_safe_text_holds_back_incomplete_utf8():
    assert safe_text("ab\ufffd\ufffd", finished=False) == "ab"
    assert safe_text("ab\ufffd", finished=True) == "ab\ufffd"
    assert safe_text("a\ufffdb", finished=False) == "a\ufffdb"


def test_safe_text_holds_back_partial_stop_strings():
    stops = ("Paris", "\n\n")
    assert safe_text("It is Par", False, stops) == "It is "
    assert safe_text("It is P", False, stops) == "It is "
    assert safe_text("It is Pa!", False, stops) == "It is Pa!"
    assert safe_text("one\n", False, stops) == "one"
    assert safe_text("one\n", True, stops) == "one\n"
    assert safe_text("aaa", False, ("aab",)) == "a"  # longest suffix that starts a stop string
    for text in ["", "x", "Pari", "PaPa"]:  # never more than the text, always a prefix of it
        assert text.startswith(safe_text(text, False, stops))


def test_concurrent_requests_complete_with_expected_tokens():
    fake = FakeEngine(max_running=3)

    async def body(ae):
        async def one(i):
            stream = await ae.submit(f"r{i}", [i, 1], SamplingParams(max_tokens=5))
            final = await stream.final()
            stream.close()
            return final

        finals = await asyncio.gather(*(one(i) for i in range(8)))
        for i, f in enumerate(finals):
            expect = "".join(f"<{(i + 1 + t) % 100}>" for t in range(5))
            assert (f.text, f.num_tokens, f.num_prompt_tokens, f.finish_reason) == (expect, 5, 2, "length")
        assert ae.num_inflight == 0

    run(_with_engine(fake, body))


def test_close_before_finish_aborts_and_frees():
    fake = FakeEngine()

    async def body(ae):
        stream = await ae.submit("a", [1], SamplingParams(max_tokens=10_000))
        first = await stream.__anext__()
        assert first.num_tokens >= 1 and first.finish_reason is None
        stream.close()
        await _wait_idle(ae, fake)
        assert ae.metrics.requests.labels(finish_reason="abort")._value.get() == 1

    run(_with_engine(fake, body))


def test_add_errors_propagate_and_engine_survives():
    fake = FakeEngine(max_running=1, max_queue_len=1)

    async def body(ae):
        with pytest.raises(ValueError, match="max_model_len"):
            await ae.submit("long", list(range(100)), SamplingParams())
        s1 = await ae.submit("x1", [1], SamplingParams(max_tokens=10_000))
        await s1.__anext__()  # x1 is running, the queue is empty
        s2 = await ae.submit("x2", [1], SamplingParams(max_tokens=10_000))
        with pytest.raises(EngineOverloaded):
            await ae.submit("x3", [1], SamplingParams())
        s1.close()
        s2.close()
        s4 = await ae.submit("x4", [2], SamplingParams(max_tokens=2))
        assert (await s4.final()).finish_reason == "length"

    run(_with_engine(fake, body))


def test_one_bad_output_fails_only_that_request():
    fake = FakeEngine()
    fake.poison.add("bad")

    async def body(ae):
        bad = await ae.submit("bad", [1], SamplingParams(max_tokens=4))
        good = await ae.submit("good", [2], SamplingParams(max_tokens=4))
        fb, fg = await asyncio.gather(bad.final(), good.final())
        assert fb.finish_reason == "error" and fb.error
        assert fg.finish_reason == "length" and fg.num_tokens == 4
        await _wait_idle(ae, fake)

    run(_with_engine(fake, body))


def test_step_failure_fails_inflight_requests_then_recovers():
    fake = FakeEngine()

    async def body(ae):
        fake.fail_steps = 1
        s = await ae.submit("a", [1], SamplingParams(max_tokens=3))
        assert (await s.final()).finish_reason == "error"
        assert ae.healthy
        s = await ae.submit("b", [1], SamplingParams(max_tokens=3))
        assert (await s.final()).finish_reason == "length"

    run(_with_engine(fake, body))


def test_draining_refuses_new_requests():
    async def body(ae):
        ae.draining = True
        with pytest.raises(ServerDraining):
            await ae.submit("a", [1], SamplingParams())

    run(_with_engine(FakeEngine(), body))


def test_a_full_queue_refuses_on_the_event_loop():
    """At the queue bound, a new request is refused (EngineOverloaded, a 503) before it is
    sent to the engine thread: a burst's refusals cost the engine no work between steps.
    Once the queue drains, requests are admitted again."""
    fake = FakeEngine(max_running=1, max_queue_len=2)
    added = []
    real_add = fake.add_request

    def counting_add(rid, prompt, params):
        added.append(rid)
        return real_add(rid, prompt, params)

    fake.add_request = counting_add

    async def body(ae):
        s1 = await ae.submit("r1", [1], SamplingParams(max_tokens=10_000))
        await s1.__anext__()  # r1 runs; the queue is empty
        waiting = [await ae.submit(f"w{i}", [1], SamplingParams(max_tokens=10_000))
                   for i in range(2)]
        for _ in range(100):  # the engine thread reports the queue after its next step
            if ae._waiting_seen[0] == 2:
                break
            await asyncio.sleep(0.01)
        n = len(added)
        for i in range(20):
            with pytest.raises(EngineOverloaded, match="max_queue_len=2"):
                await ae.submit(f"x{i}", [1], SamplingParams())
        assert len(added) == n  # none of the 20 reached the engine
        assert ae._adds_sent == ae._waiting_seen[2]  # nothing arriving
        for s in [s1, *waiting]:
            s.close()
        await _wait_idle(ae, fake)
        s4 = await ae.submit("after", [2], SamplingParams(max_tokens=2))
        assert (await s4.final()).finish_reason == "length"

    run(_with_engine(fake, body))


def test_an_applied_add_counts_once_while_its_answer_is_on_the_way():
    """Between the engine thread applying an add (the request now waiting, reported) and the
    event loop seeing it accepted, the request is counted once: with room for two, a second
    request sent in that window is admitted (counting it both waiting and arriving refused
    it with a 503, about one run in five of the HTTP queue-bound test)."""
    import jfp8kv.serve.async_engine as mod

    fake = FakeEngine(max_running=0, max_queue_len=2)  # nothing runs: requests stay waiting

    async def body(ae):
        loop, post = asyncio.get_running_loop(), ae._post

        def slow_accept(fn, *args):  # the engine's answer to an add reaches the loop late
            if fn is mod._settle:
                return post(loop.call_later, 0.5, fn, *args)
            return post(fn, *args)
        ae._post = slow_accept
        first = asyncio.ensure_future(ae.submit("r1", [1], SamplingParams(max_tokens=4)))
        for _ in range(100):  # the engine thread has applied r1 and reported it waiting
            if ae._waiting_seen[0] == 1:
                break
            await asyncio.sleep(0.01)
        assert not first.done() and ae._waiting_seen[0] == 1
        second = await ae.submit("r2", [2], SamplingParams(max_tokens=4))
        for s in (await first, second):
            s.close()

    run(_with_engine(fake, body))


def test_concurrent_submits_never_exceed_the_bound():
    """Many submits at once (a burst): the adds in flight count against the bound, so no
    more than max_queue_len can be waiting, and the engine's own check refuses none of them
    on the event loop's behalf."""
    fake = FakeEngine(max_running=1, max_queue_len=3)

    async def body(ae):
        s1 = await ae.submit("r1", [1], SamplingParams(max_tokens=10_000))
        await s1.__anext__()

        async def one(i):
            try:
                return await ae.submit(f"b{i}", [1], SamplingParams(max_tokens=10_000))
            except EngineOverloaded:
                return None
        got = await asyncio.gather(*(one(i) for i in range(40)))
        admitted = [s for s in got if s is not None]
        assert 1 <= len(admitted) <= 3
        for s in [s1, *admitted]:
            s.close()
        await _wait_idle(ae, fake)

    run(_with_engine(fake, body))
