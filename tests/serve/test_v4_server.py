"""``python -m jfp8kv.serve`` serving DeepSeek-V4 (random tiny preset, fp8 pools, CPU): the
server starts, /health answers, and a greedy completion returns the tokens ``LLM`` generates
offline for the same prompt and pool settings."""

from __future__ import annotations

import httpx

from jfp8kv import LLM, SamplingParams

from .conftest import ServerProcess

FLAGS = ("--kv-cache-dtype", "fp8_e4m3", "--warmup", "off", "--max-model-len", "64",
         "--max-num-seqs", "4")
PROMPT = "t5 t17 t3 t88 t41 t9 t60 t12"


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
    finally:
        srv.stop()
    assert res["usage"]["completion_tokens"] == 8
    llm = LLM("random:deepseek-v4-tiny", dtype="float32", kv_cache_dtype="fp8_e4m3",
              max_model_len=64, max_num_seqs=4)
    want = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert res["choices"][0]["text"] == want[0].text
