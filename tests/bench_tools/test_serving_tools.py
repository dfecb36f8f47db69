"""The GPU serving benchmark's host-side tools, without a server or a device."""

from __future__ import annotations

import json

from bench.serving import matrix, merge


def test_workload_spec_defaults():
    a, b, c = matrix.parse_workloads("8192:1024:32:32,512:128:1:4:1,2048:1024:64:64:0:16")
    assert (a["warm_n"], a["warm_out"]) == (32, 128)  # warm-up = concurrency, <= 128 tokens
    assert (b["warm_n"], b["warm_out"]) == (1, 128)
    assert (c["warm_n"], c["warm_out"], c["num_prompts"]) == (0, 16, 64)


def test_compile_lines_and_metrics_are_parsed():
    log = ("2026-11-30 12:00:00,000 WARNING jax._src.dispatch: Finished XLA compilation of "
           "jit(_prefill) in 12.5 sec\n... Finished XLA compilation of jit(_normal) in 1.0 sec\n"
           "... Finished XLA compilation of jit(_decode) in 3.25 sec\n")
    hits = matrix.COMPILE_RE.findall(log)
    assert [(n, float(s)) for n, s in hits] == [("_prefill", 12.5), ("_decode", 3.25)]
    text = ("# TYPE jfp8kv_preemptions counter\njfp8kv_preemptions_total 3.0\n"
            "jfp8kv_num_requests_running 0.0\n")
    assert matrix.metric(text, "jfp8kv_preemptions") == 3.0
    assert matrix.metric(text, "jfp8kv_num_requests_running") == 0.0
    assert matrix.metric(text, "jfp8kv_queue_length") is None


def _run(**kw):
    r = dict(model_shape="random:qwen3-8b", kv_cache_dtype="bfloat16", kv_scale_mode=None,
             input_len=8192, output_len=128, max_concurrency=8, num_prompts=8,
             max_num_batched_tokens=8192, date="2026-12-01T00:00:00+0000",
             median_itl_ms=80.0, completed=8)
    r.update(kw)
    return r


def test_merge_keeps_existing_records_and_is_idempotent(tmp_path):
    base = {"machine": {"device": "NVIDIA H200", "versions": {"jax": "0.11.2"}},
            "command": "old", "runs": [_run(model_shape="random:qwen3-0.6b")],
            "floor": [{"model_shape": "random:qwen3-8b", "kv_cache_dtype": "bfloat16",
                       "kv_scale_mode": None, "batch": 64, "context": 8192, "step_ms": 24.2}],
            "peer": [{"impl": "hf static", "model_shape": "random:qwen3-0.6b", "batch": 32,
                      "input_len": 512, "output_len": 128, "output_throughput": 3938}]}
    into = tmp_path / "serving.json"
    into.write_text(json.dumps(base))
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"machine": {"device": "NVIDIA H200"}, "command": "new",
                               "versions": {"jax": "0.11.2", "fastapi": "0.165.0"},
                               "runs": [_run(), _run(kv_cache_dtype="fp8_e4m3",
                                                     kv_scale_mode="token")],
                               "errors": ["one failed"]}))
    peer = tmp_path / "peer.json"
    peer.write_text(json.dumps({"versions": {"torch": "2.11", "transformers": "4.57"},
                                "command": "peer", "peer": [
                                    {"impl": "hf static", "model_shape": "random:qwen3-8b",
                                     "batch": 8, "input_len": 512, "output_len": 128,
                                     "output_throughput": 500.0, "date": "d"}]}))
    for _ in range(2):  # the second merge adds nothing
        merge.main([str(new), str(peer), "--into", str(into)])
        doc = json.loads(into.read_text())
        assert len(doc["runs"]) == 3 and len(doc["floor"]) == 1 and len(doc["peer"]) == 2
        assert doc["runs"][0]["model_shape"] == "random:qwen3-0.6b"  # existing first, kept
        assert doc["machine"]["versions"] == {"jax": "0.11.2"} and doc["command"] == "old"
        assert doc["versions"]["transformers"] == "4.57" and doc["commands"] == ["new", "peer"]
        assert doc["errors"] == ["new.json: one failed"] and len(doc["sources"]) == 2
