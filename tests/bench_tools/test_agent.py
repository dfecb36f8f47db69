"""bench.agent on the CPU at toy sizes: the hybrid tiny preset with bf16 and fp8 pages, cache
on and the cache-off replay, and the dense tiny preset as the control. The record says what
was run (machine, versions, the exact command, the trace) and per turn what the cache served:
every turn after a session's first takes the state at the last page boundary of that
session's previous prompt + answer, the replay none; the sessions' conversations are still
held at the end. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from bench import agent

pytestmark = pytest.mark.timeout(300)

PS = 16  # the engine's default page size


def run(tmp_path, model, kv, *extra):
    out = tmp_path / f"{model.split(':')[-1]}.json"
    agent.main(["--model", model, "--dtype", "float32", "--sessions", "2",
                "--system-tokens", "40", "--first-tokens", "6", "--tool-tokens", "6:20",
                "--answer-tokens", "3:10", "--context-tokens", "150", "--kv-cache-dtype", kv,
                "--warmup", "off", "--out", str(out), *extra])
    return json.loads(out.read_text())


def check_turns(rec):
    turns = sorted(rec["turns"], key=lambda t: (t["session"], t["turn"]))
    prev = {}
    for t in turns:
        assert t["ttft_s"] > 0 and t["e2e_s"] >= t["ttft_s"] and t["output_tokens"] >= 3
        assert t["compile_s"] >= 0
        if t["session"] in prev:
            assert t["shared_tokens"] == prev[t["session"]]
            assert t["cached_tokens"] == (t["shared_tokens"] - 1) // PS * PS
        prev[t["session"]] = t["prompt_tokens"] + t["output_tokens"]
    assert max(t["prompt_tokens"] for t in turns) <= 150


def test_hybrid_trace_with_the_cache_on_and_off(tmp_path):
    doc = run(tmp_path, "random:qwen3.6-tiny", "bfloat16,fp8_e4m3", "--cache", "on,off",
              "--off-turns", "120")
    assert doc["machine"]["platform"] == "cpu" and "jax" in doc["versions"]
    assert "python -m bench.agent --model random:qwen3.6-tiny --dtype float32" in doc["command"]
    assert doc["trace"]["tool_tokens"] == [6, 20]
    runs = doc["runs"]
    assert [(r["kv_cache_dtype"], r["mode"]) for r in runs] == [
        ("bfloat16", "on"), ("bfloat16", "off-replay"), ("fp8_e4m3", "on"),
        ("fp8_e4m3", "off-replay")]
    for on, off in (runs[:2], runs[2:]):
        assert on["cache"]["enable_prefix_caching"] and on["cache"]["snapshot_slots"] > 0
        check_turns(on)
        assert on["summary"]["turns"] >= 6 and on["summary"]["cached_tokens"] > 0
        assert on["summary"]["reuse_min"] >= 0.6  # all but a page of >= 49 shared tokens
        assert on["end"]["sessions_held"] == 2
        assert on["turns"][-1]["snapshots_cached"] > 0
        # the replay: each session's longest prompt of at most 120 tokens, nothing cached
        assert len(off["turns"]) == 2 and off["summary"]["cached_tokens"] == 0
        replayed = {(t["session"], t["turn"]): t["prompt_tokens"] for t in off["turns"]}
        assert {(r["session"], r["turn"]): r["prompt_tokens"]
                for r in on["ttft_on_over_off"]} == replayed
        for s in (0, 1):
            fits = [t["prompt_tokens"] for t in on["turns"]
                    if t["session"] == s and t["prompt_tokens"] <= 120]
            assert max(fits) in {n for (x, _), n in replayed.items() if x == s}
    assert runs[2]["cache"]["bytes_per_token"] < runs[0]["cache"]["bytes_per_token"]


def test_dense_control(tmp_path):
    doc = run(tmp_path, "random:qwen3-tiny", "bfloat16", "--cache", "on")
    (on,) = doc["runs"]
    assert on["cache"]["model_family"] == "dense" and on["cache"]["snapshot_slots"] == 0
    check_turns(on)
    assert on["end"]["sessions_held"] == 2
