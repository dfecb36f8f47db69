"""bench.prefill_profile: one engine prefill step timed and profiled (CPU: no device kernels)."""

import json

from bench import prefill_profile


def test_step_flops_counts_causal_pairs():
    from bench.offline import prefill_flops
    from jfp8kv.engine.stats import causal_pairs

    terms = {"matmul_params": 10, "logits_params": 3, "attn_flops_per_pair": 7}
    # each row: 4 queries over 5 cached keys + a causal 4x4 triangle (10 pairs)
    assert causal_pairs(4, 5) == 20 + 10
    assert prefill_flops(terms, 8, 2, 60) == 2 * 10 * 8 + 2 * 3 * 2 + 7 * 60


def test_runs_on_a_tiny_model(tmp_path):
    out = tmp_path / "p.json"
    assert prefill_profile.main(["--model", "random:qwen3-tiny", "--rows", "2", "--chunk", "24",
                                 "--prefix", "16", "--reps", "1", "--configs",
                                 "bfloat16:,fp8_e4m3:token", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["kv_cache_dtype"] for r in doc["records"]] == ["bfloat16", "fp8_e4m3"]
    for r in doc["records"]:
        assert r["step_ms"] > 0 and r["flops"] > r["ideal_ms"] > 0 and r["ideal_ms"] > 0
        assert r["kernels"]["kernels"] == 0  # no device trace on a CPU
    assert "python -m bench" in doc["command"]


def test_runs_on_deepseek_v4_pools(tmp_path):
    """V4's window and compressed pools have no random fill: a first chunk (prefix 0) reads
    only what it writes, and a prefix is refused by name."""
    import pytest

    out = tmp_path / "v4.json"
    assert prefill_profile.main(["--model", "random:deepseek-v4-tiny", "--rows", "1", "--chunk",
                                 "32", "--reps", "1", "--configs", "fp8_e4m3:",
                                 "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["records"]
    assert r["kv_cache_dtype"] == "fp8_e4m3" and r["step_ms"] > 0 and r["flops"] > 0
    with pytest.raises(ValueError, match="--prefix needs a dense paged cache"):
        prefill_profile.main(["--model", "random:deepseek-v4-tiny", "--rows", "1", "--chunk",
                              "32", "--prefix", "16", "--reps", "1", "--configs", "bfloat16:",
                              "--out", str(out)])
