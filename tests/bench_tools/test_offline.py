"""bench.offline on the CPU: the record's fields, the step anatomy's counts against the
workload, the ideal model against a hand computation, its per-architecture terms (dense, MoE,
MLA) against hand-computed numbers and the parameters of the actually built random models,
and the compile counter."""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import offline
from jfp8kv.config import ModelConfig
from jfp8kv.engine.stats import StepRecord, compile_count
from jfp8kv.models.presets import PRESETS


def test_compile_counter_sees_a_fresh_compile():
    compile_count()  # installs the listener
    n0, s0 = compile_count()
    shape = (3, int(np.random.default_rng().integers(5, 500)))  # a shape no cache holds
    jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones(shape)))
    n1, s1 = compile_count()
    assert n1 >= n0 + 1 and s1 > s0


def test_ideal_time_matches_a_hand_computation():
    rng = np.random.default_rng()
    e, k, m, item = 16, 4, 3, 2
    terms = dict(matmul_params=int(rng.integers(1e6, 1e7)),
                 logits_params=int(rng.integers(1e5, 1e6)),
                 static_params=int(rng.integers(1e5, 1e6)),
                 expert_params=int(rng.integers(1e4, 1e5)),
                 moe_layers=m, num_experts=e, experts_per_tok=k, itemsize=item,
                 attn_flops_per_pair=4096)
    c, s, n, start = (int(x) for x in rng.integers(1, 200, 4))
    pre = StepRecord(prefill_chunks=1, prefill_tokens=n, prefill_pairs=n * start + n * (n + 1) // 2)
    dec = StepRecord(decode_rows=2, decode_tokens=2 * s, decode_iterations=s,
                     decode_kv_tokens=2 * (s * c + s * (s + 1) // 2))
    tflops, tbps, bpt = 2.0, 0.5, 288
    got = offline.ideal_time([pre, dec], terms, bpt, tflops, tbps)
    flops = (2 * terms["matmul_params"] * n + 2 * terms["logits_params"]
             + 4096 * sum(start + j + 1 for j in range(n)))
    kv_read = 2 * sum(c + i + 1 for i in range(s))
    # Two rows per iteration: 16 * (1 - (12/16)^2) = 7 distinct experts expected per layer.
    w2 = (terms["static_params"] + terms["logits_params"] + m * 7 * terms["expert_params"]) * item
    nbytes = s * w2 + kv_read * bpt
    assert got["prefill_flops"] == flops and math.isclose(got["decode_bytes"], nbytes,
                                                          rel_tol=1e-12)
    assert math.isclose(got["ideal_s"], flops / 2e12 + nbytes / 0.5e12, rel_tol=1e-12)
    assert got["ideal_roofline_s"] >= got["ideal_s"] * (1 - 1e-12)


def test_distinct_experts_expectation():
    for e, k in ((128, 8), (64, 6), (8, 2)):
        assert math.isclose(offline.distinct_experts(e, k, 1), k, rel_tol=1e-12)
        xs = [offline.distinct_experts(e, k, b) for b in (1, 2, 4, 16, 64, 512, 10_000)]
        assert all(a < b for a, b in zip(xs[:5], xs[1:5])) and xs[4] < e
        assert all(a <= b for a, b in zip(xs, xs[1:])) and xs[-1] <= e
        assert math.isclose(xs[-1], e, rel_tol=1e-9)
    assert offline.distinct_experts(0, 0, 5) == 0.0
    # Against a simulation of uniform routing: each token picks k distinct experts at random.
    rng = np.random.default_rng()
    e, k, b, trials = 16, 4, 5, 4000
    picks = np.argsort(rng.random((trials, b, e)), axis=-1)[..., :k].reshape(trials, -1)
    seen = np.array([len(set(row)) for row in picks.tolist()])
    want = offline.distinct_experts(e, k, b)
    assert abs(seen.mean() - want) < 4 * seen.std() / math.sqrt(trials)


# Hand-computed terms of the toy presets (matmul parameters over all layers).
# qwen3-tiny: D 128, I 256, H 4, KV 2, Dh 32, 2 dense layers: attention 2*128*128 + 2*128*64.
# qwen3-moe-tiny: layer 0 dense, layer 1 routed (router 128*8, expert 3*128*64, top-2 of 8).
# deepseek-v2-tiny: MLA attention wq 128*4*64 + wkv_a 128*96 + wkv_b 64*4*64 + wo 128*128;
#   layer 0 dense, layer 1 router 128*8 + shared 3*128*128 + top-2 of 8 experts 3*128*64.
TOY_TERMS = {
    "qwen3-tiny": dict(static_params=2 * (49152 + 98304), matmul_params=2 * (49152 + 98304),
                       total_params=2 * (49152 + 98304), expert_params=0, moe_layers=0,
                       attn_flops_per_pair=2 * 4 * 4 * 32),
    "qwen3-moe-tiny": dict(static_params=2 * 49152 + 98304 + 1024,
                           matmul_params=2 * 49152 + 98304 + 1024 + 2 * 24576,
                           total_params=2 * 49152 + 98304 + 1024 + 8 * 24576,
                           expert_params=24576, moe_layers=1, attn_flops_per_pair=1024),
    "deepseek-v2-tiny": dict(static_params=2 * 77824 + 98304 + 1024 + 49152,
                             matmul_params=2 * 77824 + 98304 + 1024 + 49152 + 2 * 24576,
                             total_params=2 * 77824 + 98304 + 1024 + 49152 + 8 * 24576,
                             expert_params=24576, moe_layers=1,
                             attn_flops_per_pair=2 * (2 * 4 * 96 + 2 * 4 * 64)),
}


def _counted(params, cfg) -> dict:
    """Matmul parameters of a built params pytree: every layer leaf but norms and the V3
    router bias; routed experts' stacks count k/E toward the active parameters."""
    static = active = total = 0
    for lp in params["layers"]:
        for name, leaf in lp.items():
            if name.endswith("norm") or name == "router_bias":
                continue
            size = math.prod(leaf.shape)
            total += size
            if name.startswith("experts_"):
                active += size * cfg.num_experts_per_tok // cfg.num_experts
            else:
                static += size
                active += size
    return dict(static_params=static, matmul_params=active, total_params=total)


@pytest.mark.parametrize("preset", sorted(TOY_TERMS))
def test_model_terms_of_the_toy_presets(preset):
    from jfp8kv.models.loader import load_model

    loaded = load_model(f"random:{preset}", "bfloat16")
    cfg = loaded.config
    terms = offline.model_terms(cfg, "bfloat16")
    assert {k: terms[k] for k in TOY_TERMS[preset]} == TOY_TERMS[preset]
    assert {k: terms[k] for k in ("static_params", "matmul_params", "total_params")} == \
        _counted(loaded.params, cfg)
    assert terms["logits_params"] == math.prod(loaded.params["embed"].shape)
    assert terms["itemsize"] == 2
    w1 = (terms["static_params"] + terms["logits_params"]
          + terms["moe_layers"] * terms["experts_per_tok"] * terms["expert_params"]) * 2
    assert math.isclose(offline.weight_bytes(terms, 1), w1, rel_tol=1e-12)
    if terms["moe_layers"]:  # a large batch reads every expert: the whole model's weights
        total = (terms["total_params"] + terms["logits_params"]) * 2
        assert math.isclose(offline.weight_bytes(terms, 10_000), total, rel_tol=1e-9)


@pytest.mark.parametrize("preset, total, active", [
    # Published: Qwen3-30B-A3B 30.5B total / 3.3B active; DeepSeek-V2-Lite 15.7B / 2.4B
    # (DeepSeek's active count leaves out the embedding lookup, a gather).
    ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("deepseek-v2-lite", 15.7e9, 2.4e9)])
def test_model_terms_of_the_real_presets(preset, total, active):
    """The shapes ``load_model("random:...")`` would build (traced, nothing allocated)
    against the terms and the published parameter counts."""
    from jfp8kv.models.families import random_params as init_random_params

    cfg = ModelConfig(**PRESETS[preset], name=preset)
    shapes = jax.eval_shape(lambda key: init_random_params(cfg, key), jax.random.PRNGKey(0))
    terms = offline.model_terms(cfg, "bfloat16")
    assert {k: terms[k] for k in ("static_params", "matmul_params", "total_params")} == \
        _counted(shapes, cfg)
    embed = math.prod(shapes["embed"].shape)
    leaves = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))
    assert abs(leaves - total) < 0.01 * total
    got_active = terms["matmul_params"] + terms["logits_params"]
    got_active += embed if preset.startswith("qwen3") else 0
    assert abs(got_active - active) < 0.03 * active


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
@pytest.mark.parametrize("preset, kvs", [  # one KV dtype for the MoE/MLA toys: ~35 s each
    ("qwen3-tiny", "bfloat16,fp8"), ("qwen3-moe-tiny", "bfloat16"), ("deepseek-v2-tiny", "fp8")])
def test_offline_tiny_preset_record(tmp_path, preset, kvs):
    out = tmp_path / "offline.json"
    n, lin, lout = 3, 24, 5
    assert offline.main(["--model", f"random:{preset}", "--num-prompts", str(n), "--input-len",
                         str(lin), "--output-len", str(lout), "--kv-cache-dtype", kvs,
                         "--warmup", "off", "--out", str(out), "--plot"]) == 0
    doc = json.loads(out.read_text())
    assert "bench.offline" in doc["commands"][0] and doc["machine"]["platform"] == "cpu"
    assert doc["versions"]["jax"] and "ideal_s" in doc["ideal_model"]
    names = {"bfloat16": "bfloat16", "fp8": "fp8_e4m3"}
    assert [r["kv_cache_dtype"] for r in doc["runs"]] == [names[k] for k in kvs.split(",")]
    cfg = ModelConfig(**PRESETS[preset], name=preset)
    for r in doc["runs"]:
        assert r["model_terms"] == offline.model_terms(cfg, "bfloat16")
        if cfg.is_mla:  # fp8 block (the MLA default): one latent row of r + d_r = 96 e4m3
            # values and 3 fp16 scales per token and layer
            assert r["kv_scale_mode"] == "block" and r["bytes_per_token"] == 2 * (96 + 3 * 2)
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


@pytest.mark.timeout(900)
def test_offline_admission_ab_on_one_load(tmp_path):
    """``--admission greedy,reserve`` runs both policies on one load. The pool holds 12
    pages of 16 tokens; each of 8 requests grows to 64 tokens (4 pages): greedy admission
    starts 6 (their 2-page prompts fit) and preempts as they grow, reserve starts 3 at a
    time and does not (host replay: 4 preemptions and none)."""
    out = tmp_path / "offline.json"
    assert offline.main(["--model", "random:qwen3-tiny", "--num-prompts", "8", "--input-len",
                         "32", "--output-len", "32", "--kv-cache-dtype", "bfloat16",
                         "--kv-cache-memory", str(12 * 16 * 512), "--admission",
                         "greedy,reserve", "--warmup", "off", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["admission"], r["num_pages"]) for r in runs] == [("greedy", 12), ("reserve", 12)]
    assert runs[0]["preemptions"] > 0 and runs[1]["preemptions"] == 0
    assert all(r["total_output_tokens"] == 8 * 32 for r in runs)
    with pytest.raises(SystemExit):
        offline.parse_args(["--admission", "greedy,fifo"])


@pytest.mark.timeout(900)
def test_offline_feature_executables_ab_on_one_load(tmp_path):
    """``--feature-executables switched,per-mix --logprobs 2`` runs both policies on one load,
    every request with log-probs (the A/B of the switched decode's cost on a GPU)."""
    out = tmp_path / "offline.json"
    assert offline.main(["--model", "random:qwen3-tiny", "--num-prompts", "3", "--input-len",
                         "24", "--output-len", "5", "--kv-cache-dtype", "bfloat16",
                         "--feature-executables", "switched,per-mix", "--logprobs", "2",
                         "--warmup", "off", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["feature_executables"], r["logprobs"]) for r in runs] == [("switched", 2),
                                                                         ("per-mix", 2)]
    assert all(r["total_output_tokens"] == 3 * 5 for r in runs)
    assert "switched logprobs 2" in offline.summary_line(runs[0])
    with pytest.raises(SystemExit):
        offline.parse_args(["--feature-executables", "switched,lazy"])


def test_ideal_model_counts_the_deltanet_flops_and_state_bytes():
    """Qwen3.6-35B-A3B's gated delta rule by hand (30 linear layers x 32 value heads, 128 x
    128 state; ``bench.deltanet``'s count per token and head, chunks of the engine's 64
    tokens) and its state slot (30 x (32 x 128 x 128 + 3 x 8192) float32, read and written
    once per decode token); the terms enter the prefill FLOPs per token, the roofline's
    decode FLOPs and the decode bytes; a model without DeltaNet layers has none."""
    from bench.deltanet import flops_per_token_head
    from jfp8kv.kernels.deltanet import PREFILL_CHUNK

    assert offline.DELTANET_CHUNK == PREFILL_CHUNK
    cfg = ModelConfig(**PRESETS["qwen3.6-35b-a3b"], name="qwen3.6-35b-a3b")
    terms = offline.model_terms(cfg, "bfloat16")
    assert flops_per_token_head(128, 128, 64) == 2 * (4 * 128 * 128 + 2 * 64 * 256)
    assert terms["deltanet_prefill_flops"] == 30 * 32 * 2 * (4 * 128 * 128 + 2 * 64 * 256)
    assert terms["deltanet_decode_flops"] == 30 * 32 * 8 * 128 * 128
    assert terms["state_rw_bytes"] == 2 * 30 * (32 * 128 * 128 + 3 * 8192) * 4
    rng = np.random.default_rng()
    n, s, rows = (int(x) for x in rng.integers(2, 3000, 3))
    pre = StepRecord(prefill_chunks=1, prefill_tokens=n, prefill_pairs=n * (n + 1) // 2)
    dec = StepRecord(decode_rows=rows, decode_tokens=rows * s, decode_iterations=s,
                     decode_kv_tokens=rows * s * n)
    bare = dict(terms, deltanet_prefill_flops=0, deltanet_decode_flops=0, state_rw_bytes=0)
    got, base = (offline.ideal_time([pre, dec], t, 10_400, 650.0, 3.0) for t in (terms, bare))
    assert got["prefill_flops"] - base["prefill_flops"] == terms["deltanet_prefill_flops"] * n
    assert got["decode_flops"] - base["decode_flops"] == terms["deltanet_decode_flops"] * rows * s
    assert math.isclose(got["decode_bytes"] - base["decode_bytes"],
                        terms["state_rw_bytes"] * rows * s, rel_tol=1e-9)
    best, best_bare = (offline.ideal_schedule([n], [2], 1, t, 10_400, 650.0, 3.0)
                       for t in (terms, bare))
    assert math.isclose((best["prefill_s"] - best_bare["prefill_s"]) * 650e12,
                        terms["deltanet_prefill_flops"] * n, rel_tol=1e-9)
    dense = offline.model_terms(ModelConfig(**PRESETS["qwen3-tiny"], name="qwen3-tiny"),
                                "bfloat16")
    assert dense["deltanet_prefill_flops"] == dense["deltanet_decode_flops"] == 0
