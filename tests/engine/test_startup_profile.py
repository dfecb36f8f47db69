"""The start-up profile: every executable obtained before /health, by phase and source."""

import json
import logging

import pytest

from jfp8kv.engine import startup_profile as sp
from jfp8kv.engine.llm import LLM
from jfp8kv.models.loader import load_model


@pytest.fixture(scope="module")
def llama(tiny_hf_checkpoint):
    return load_model(str(tiny_hf_checkpoint("llama")), "bfloat16")


def test_summary_sums_rows_by_phase_and_source():
    sp.reset()
    with sp.phase("sizing"):
        sp.record("decode:x", ("decode", 8, 1, 32), True, None, "compiled", 1.0, 2.0)
    with sp.phase("warmup"):
        sp.record("prefill", ("prefill", 1, 64, 32), False, None, "store", 0.0, 0.25)
        sp.record("prefill", ("prefill", 1, 128, 32), True, None, "jax-cache", 0.5, 0.5)
    sp.record("prefill", ("prefill", 2, 64, 32), True, None, "compiled", 0.1, 0.1)
    s = sp.summary(slowest=2)
    assert s["phases"]["sizing"]["by_source"] == {"compiled": 1}
    w = s["phases"]["warmup"]
    assert w["executables"] == 2 and w["by_source"] == {"store": 1, "jax-cache": 1}
    assert w["lower_s"] == 0.5 and w["compile_s"] == 0.75 and w["wall_s"] >= 0
    assert w["by_step"]["prefill"] == {"n": 2, "lower_s": 0.5, "compile_s": 0.75}
    assert s["phases"]["serving"]["executables"] == 1  # a compile after start-up shows
    assert [r["compile_s"] for r in s["slowest"]] == [2.0, 0.5]
    assert "warmup: 2 executables (1 jax-cache, 1 store)" in sp.log_line(s)
    sp.reset()


def test_warmup_records_every_executable_and_writes_the_profile(llama, tmp_path, monkeypatch,
                                                                 caplog):
    sp.reset()
    path = tmp_path / "profile.json"
    monkeypatch.setenv("JFP8KV_STARTUP_PROFILE", str(path))
    with caplog.at_level(logging.INFO, logger="jfp8kv.engine.llm"):
        llm = LLM(loaded=llama, dtype="bfloat16", page_size=8, kv_cache_memory=1 << 22,
                  max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                  compile_cache=False, warmup=True)
    doc = json.loads(path.read_text())
    runner = llm.engine.runner
    want = sum(len(runner.variants.of(s[0])) for s in llm._shapes())
    warm = [r for r in doc["rows"] if r["phase"] == "warmup"]
    assert len(warm) == want == doc["phases"]["warmup"]["executables"]
    assert {r["source"] for r in warm} <= {"compiled", "jax-cache"}
    assert all(r["lower_s"] > 0 and r["compile_s"] > 0 for r in warm)
    assert {tuple(r["shape"]) for r in warm} == {tuple(s) for s in llm._shapes()}
    assert any("start-up: " in m and "warmup: " in m for m in caplog.messages)
    # a second engine in the process reports its own start-up only
    LLM(loaded=llama, dtype="bfloat16", page_size=8, kv_cache_memory=1 << 22,
        max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, compile_cache=False,
        warmup=True)
    again = json.loads(path.read_text())
    assert again["phases"]["warmup"]["executables"] == want
    assert {r["source"] for r in again["rows"]} == {"jax-cache"}  # in memory from the first
    sp.reset()
