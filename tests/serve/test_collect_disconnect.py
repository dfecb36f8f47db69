"""A client that disconnects while a non-streamed request runs: ``_collect_all`` aborts every
stream and leaves no future whose exception nobody retrieved (asyncio logged one
"_GatheringFuture exception was never retrieved ... CancelledError" per such request at
ERROR level in the H100 soak of 2026-12-06)."""

from __future__ import annotations

import asyncio
import gc

from jfp8kv.serve import openai_serving


class _Stream:
    """A stream whose final update never comes; records its close."""

    def __init__(self):
        self.closed = False

    async def final(self):
        await asyncio.Event().wait()

    def close(self):
        self.closed = True


class _DisconnectingRequest:
    async def receive(self):
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}


def test_disconnect_aborts_streams_and_leaves_no_unretrieved_exception():
    reported = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        streams = [_Stream() for _ in range(3)]
        got = await openai_serving._collect_all(streams, _DisconnectingRequest())
        for _ in range(5):  # let the cancellations run to the end
            await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
        return got, streams

    got, streams = asyncio.run(main())
    gc.collect()
    assert got is None
    assert all(s.closed for s in streams)
    assert reported == [], [c.get("message") for c in reported]
