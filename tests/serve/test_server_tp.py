"""``python -m jfp8kv.serve --tensor-parallel-size 2`` on two virtual CPU devices.

The server is a child process, so it gets its own ``XLA_FLAGS`` (two CPU devices) while this
process keeps one; its greedy answer must be the one-device engine's. ``--warmup off``: the
server compiles only the shapes this one request uses (on CPU, ``auto`` would compile the
rest in the background, competing with the test for CI's two cores). The default overlap
scheduler runs, so its mailbox on the mesh is covered here.
"""

from __future__ import annotations

import os

import httpx

from tests.serve.conftest import SERVER_FLAGS, ServerProcess

PROMPT = "The quick brown fox"


def test_server_with_tensor_parallel_size_2_answers(tiny_model_dir, tmp_path, monkeypatch):
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_force_host_platform_device_count=2".strip())
    server = ServerProcess(tiny_model_dir, tmp_path / "tp2.log", tmp_path / "jax-cache",
                           *SERVER_FLAGS, "--tensor-parallel-size", "2", "--warmup", "off")
    monkeypatch.undo()
    try:
        server.wait_ready()
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["text"]
    finally:
        server.stop()

    from jfp8kv import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=512, kv_cache_memory=12 * 8192)
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))
    assert served == out.text and out.token_ids
