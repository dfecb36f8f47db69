"""``python -m jfp8kv.serve`` serving DeepSeek-V4 (random tiny preset, fp8 pools, CPU): the
server starts, /health answers, and a greedy completion returns the tokens ``LLM`` generates
offline for the same prompt and pool settings. A next turn (prompt + answer + more) is
served from the cache through a state snapshot: its ``cached_tokens`` is the last page
boundary of the first turn's computed tokens, and /metrics counts the snapshot."""

from __future__ import annotations

import httpx

from jfp8kv import LLM, SamplingParams

from .conftest import ServerProcess, wait_idle

FLAGS = ("--kv-cache-dtype", "fp8_e4m3", "--warmup", "off", "--max-model-len", "64",
         "--max-num-seqs", "4")
PROMPT = " ".join(f"t{(7 * i + 5) % 90 + 3}" for i in range(30))  # 30 tokens


def test_serves_v4_completion(tmp_path):
    srv = ServerProcess("random:deepseek-v4-tiny", tmp_path / "server.log", tmp_path / "jax",
                        *FLAGS)
    try:
        srv.wait_ready()
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        res = r.json()
        turn = dict(body, prompt=PROMPT + res["choices"][0]["text"] + " t7 t8 t9")
        r = httpx.post(srv.url + "/v1/completions", json=turn, timeout=180)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        m = wait_idle(srv.url)
    finally:
        srv.stop()
    assert res["usage"]["completion_tokens"] == 8 and res["usage"]["prompt_tokens"] == 30
    # 30 + 8 tokens, 37 computed: the state at 32 (pages of 16) serves the next turn
    assert usage["prompt_tokens"] == 41 and usage["prompt_tokens_details"]["cached_tokens"] == 32
    assert m["jfp8kv_state_snapshot_hits_total"] == 1 and m["jfp8kv_state_snapshots"] >= 1
    assert m["jfp8kv_state_snapshot_bytes"] > 0 and "jfp8kv_state_snapshot_evictions_total" in m
    assert m["jfp8kv_state_snapshot_pool_bytes"] >= m["jfp8kv_state_snapshot_bytes"]
    llm = LLM("random:deepseek-v4-tiny", dtype="float32", kv_cache_dtype="fp8_e4m3",
              max_model_len=64, max_num_seqs=4)
    want = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert res["choices"][0]["text"] == want[0].text
