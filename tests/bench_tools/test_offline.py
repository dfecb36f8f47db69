"""bench.offline on the CPU: the record's fields, the step anatomy's counts against the
workload, the ideal model against a hand computation, and the compile counter."""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import offline
from jfp8kv.engine.stats import StepRecord, compile_count


def test_compile_counter_sees_a_fresh_compile():
    compile_count()  # installs the listener
    n0, s0 = compile_count()
    shape = (3, int(np.random.default_rng().integers(5, 500)))  # a shape no cache holds
    jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones(shape)))
    n1, s1 = compile_count()
    assert n1 >= n0 + 1 and s1 > s0


def test_ideal_time_matches_a_hand_computation():
    rng = np.random.default_rng()
    terms = dict(matmul_params=int(rng.integers(1e6, 1e7)), logits_params=int(rng.integers(1e5, 1e6)),
                 decode_weight_bytes=int(rng.integers(1e6, 1e7)), attn_flops_per_pair=4096)
    c, s, n, start = (int(x) for x in rng.integers(1, 200, 4))
    pre = StepRecord(prefill_chunks=1, prefill_tokens=n, prefill_pairs=n * start + n * (n + 1) // 2)
    dec = StepRecord(decode_rows=2, decode_tokens=2 * s, decode_iterations=s,
                     decode_kv_tokens=2 * (s * c + s * (s + 1) // 2))
    tflops, tbps, bpt = 2.0, 0.5, 288
    got = offline.ideal_time([pre, dec], terms, bpt, tflops, tbps)
    flops = (2 * terms["matmul_params"] * n + 2 * terms["logits_params"]
             + 4096 * sum(start + j + 1 for j in range(n)))
    kv_read = 2 * sum(c + i + 1 for i in range(s))
    nbytes = s * terms["decode_weight_bytes"] + kv_read * bpt
    assert got["prefill_flops"] == flops and got["decode_bytes"] == nbytes
    assert math.isclose(got["ideal_s"], flops / 2e12 + nbytes / 0.5e12, rel_tol=1e-12)
    assert got["ideal_roofline_s"] >= got["ideal_s"] * (1 - 1e-12)


def test_prefill_only_and_sampled_lengths():
    ns = argparse.Namespace(seed=3, num_prompts=50, input_len=40, output_len=9, range_ratio=0.5,
                            prefill_only=False, dataset=None)
    prompts, outs = offline.make_prompts(ns, 100, None, 0)
    assert all(20 <= len(p) <= 40 for p in prompts) and all(4 <= o <= 9 for o in outs)
    assert len({len(p) for p in prompts}) > 1
    ns.prefill_only = True
    assert offline.make_prompts(ns, 100, None, 0)[1] == [1] * 50
    again = offline.make_prompts(ns, 100, None, 0)[0]
    assert again == offline.make_prompts(ns, 100, None, 0)[0] != offline.make_prompts(ns, 100, None, 1)[0]


@pytest.mark.timeout(900)
def test_offline_tiny_preset_record(tmp_path):
    out = tmp_path / "offline.json"
    n, lin, lout = 3, 24, 5
    assert offline.main(["--model", "random:qwen3-tiny", "--num-prompts", str(n), "--input-len",
                         str(lin), "--output-len", str(lout), "--kv-cache-dtype", "bfloat16,fp8",
                         "--warmup", "off", "--out", str(out), "--plot"]) == 0
    doc = json.loads(out.read_text())
    assert "bench.offline" in doc["commands"][0] and doc["machine"]["platform"] == "cpu"
    assert doc["versions"]["jax"] and "ideal_s" in doc["ideal_model"]
    assert [r["kv_cache_dtype"] for r in doc["runs"]] == ["bfloat16", "fp8_e4m3"]
    for r in doc["runs"]:
        a = r["anatomy"]
        assert r["total_input_tokens"] == n * lin and r["total_output_tokens"] == n * lout
        assert r["output_throughput"] > 0 and r["total_throughput"] > r["output_throughput"]
        # The step anatomy counts exactly the workload: one prefill chunk per prompt (no
        # preemption), every later token from a decode row.
        assert r["preemptions"] == 0 and a["prefill_tokens"] == n * lin
        assert a["prefill_pairs"] == n * lin * (lin + 1) // 2
        assert a["decode_tokens"] == n * (lout - 1)
        assert a["decode_kv_tokens"] == n * sum(lin + i + 1 for i in range(lout - 1))
        assert a["steps"] >= lout and a["max_decode_rows"] == n
        for k in ("schedule_ms", "device_ms", "post_ms"):
            assert a[k] >= 0
        assert r["compiles_in_run"] >= a["compiles"] >= 0
        # The roofline sums per dispatch, ideal_s per term: equal up to rounding when every
        # dispatch is bound as the model assumes.
        assert 0 < r["ideal"]["ideal_s"] <= r["ideal"]["ideal_roofline_s"] * (1 + 1e-9)
        assert math.isfinite(r["actual_over_ideal"]) and r["actual_over_ideal"] > 0
        assert r["max_ttft_ms"] >= r["median_ttft_ms"] > 0
    assert (tmp_path / "offline.png").stat().st_size > 1000
