"""bench.long_request reads a stream as a client would: an in-stream error event (the server
keeps status 200 once streaming started) is recorded and the request does not count as
served; a normal stream gives its text, first-token time and usage."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx

from bench import long_request


def _sse(*events) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _patch(monkeypatch, payload: bytes):
    transport = httpx.MockTransport(lambda req: httpx.Response(
        200, content=payload, headers={"content-type": "text/event-stream"}))
    client = httpx.Client(transport=transport)
    monkeypatch.setattr(long_request.httpx, "stream",
                        lambda method, url, **kw: client.stream(
                            method, url, **{k: v for k, v in kw.items() if k != "trust_env"}))


def test_error_event_is_recorded(monkeypatch):
    err = {"message": "engine step failed: RESOURCE_EXHAUSTED", "type": "server_error",
           "param": None, "code": "internal_error"}
    _patch(monkeypatch, _sse({"error": err}))
    rec = long_request.stream_once("http://x", {"prompt": [1]}, 5.0)
    assert rec["status"] == 200 and rec["error"] == err and rec["text_chunks"] == 0
    assert rec["usage"] is None  # so main() reports served = False


def test_normal_stream(monkeypatch):
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    _patch(monkeypatch, _sse({"choices": [{"text": " a"}]}, {"choices": [{"text": " b"}]},
                             {"choices": [], "usage": usage}))
    rec = long_request.stream_once("http://x", {"prompt": [1]}, 5.0)
    assert rec["text"] == " a b" and rec["text_chunks"] == 2 and rec["usage"] == usage
    assert "error" not in rec and rec["ttft_s"] is not None


def test_memory_check_reads_the_plan_and_the_devices_peak():
    """The server's /metrics lines -> the bytes held back for temporaries (measured peak +
    margin) against what the run used of them (the allocator's peak - weights - pools)."""
    gib = 1 << 30
    lines = [f'jfp8kv_memory_plan_bytes{{part="{k}"}} {float(v)!r}' for k, v in dict(
        capacity=72 * gib, in_use=64 * gib, peak=2 * gib, margin=2 * gib, pool_budget=3 * gib,
        total=80 * gib).items()]
    lines += [f'jfp8kv_device_memory_bytes{{kind="{k}"}} {float(v)!r}' for k, v in dict(
        bytes_in_use=67 * gib, peak_bytes_in_use=int(68.5 * gib), bytes_limit=72 * gib).items()]
    got = long_request.memory_check(lines + ["jfp8kv_kv_cache_pages_used 0.0"])
    assert got["reserve_bytes"] == 4 * gib and got["used_of_reserve_bytes"] == 1.5 * gib
    assert got["over_reserve_fraction_of_card"] == 2.5 / 80
    assert got["used_beyond_reserve_fraction_of_card"] == 0.0
    assert got["plan_line"].startswith("memory plan: capacity 72.00 GiB")
    assert long_request.memory_check(lines[:2]) == {}  # nothing measured: no check


def test_decode_speed_counts_the_tokens_after_the_first(monkeypatch):
    """decode_tok_s: the usage's completion tokens after the first over the time from the
    first text chunk to the last (a chunk may hold several tokens); None when undefined."""
    usage = {"prompt_tokens": 1, "completion_tokens": 9, "total_tokens": 10}
    _patch(monkeypatch, _sse({"choices": [{"text": " a"}]}, {"choices": [{"text": " b c"}]},
                             {"choices": [{"text": " d"}]}, {"choices": [], "usage": usage}))
    clock = iter([0.0, 2.0, 2.5, 3.0, 3.5])  # start, three text chunks, the end
    monkeypatch.setattr(long_request, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    rec = long_request.stream_once("http://x", {"prompt": [1]}, 5.0)
    assert (rec["ttft_s"], rec["last_s"], rec["total_s"]) == (2.0, 3.0, 3.5)
    assert rec["decode_tok_s"] == 8 / 1.0
    assert long_request.decode_speed({"completion_tokens": 1}, 1.0, 1.0) is None
    assert long_request.decode_speed(None, 1.0, 2.0) is None


def test_summary_is_the_last_request():
    """``summarize``: served only when every request was answered with the whole prompt; the
    summary is the last (with --repeat the warm) request's TTFT and decode speed."""
    ok = {"status": 200, "usage": {"prompt_tokens": 8}, "ttft_s": 9.0, "decode_tok_s": 1.0}
    warm = dict(ok, ttft_s=2.0, decode_tok_s=3.0)
    doc = long_request.summarize({"prompt_tokens": 8, "requests": [ok, warm]})
    assert doc["served"] and doc["summary"] == dict(ttft_s=2.0, decode_tok_s=3.0, warm=True)
    assert not long_request.summarize({"prompt_tokens": 8, "requests": []})["served"]
    cut = long_request.summarize({"prompt_tokens": 8, "requests": [ok, {"status": 500}]})
    assert not cut["served"] and cut["summary"]["ttft_s"] is None
