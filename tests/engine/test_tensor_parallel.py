"""Tensor parallelism (``--tensor-parallel-size``) on 4 virtual CPU devices.

XLA reads ``--xla_force_host_platform_device_count`` once, when JAX's CPU backend starts,
and the rest of the suite runs on one device. So ``test_on_four_virtual_devices`` runs this
file again in a child pytest with ``XLA_FLAGS`` set; there the tests marked ``four_devices``
run (in the parent they are skipped, pointing at that test).

Checkpoints (tiny Llamas, reference attention):
``kv4``: 8 query heads, 4 KV heads: TP 2 and 4 shard the KV heads, no replication.
``kv3``: 12 query heads, 3 KV heads (SmolLM2's KV count): TP 2 and 4 replicate each KV head
2 and 4 times (``models/sharding.py``); its vocabulary (390) divides by 2 but not by 4, so
the vocab is sharded at TP 2, replicated at 4.
SmolLM2-135M itself (9 query heads, 3 KV heads): its valid sizes on 4 devices are 1 and 3
(2 and 4 do not divide 9 query heads and are refused); TP 3 puts one KV head per device.
Its KV-head replication would need TP 9 (``kv3`` above covers the rule).

Why float64 for some comparisons. Under TP the all-reduces of ``wo`` and ``w_down`` sum
the per-device partial sums in another order, so float32 hidden states differ from one
device's by ~1e-7 relative. Where a K/V element lies within that distance of a rounding
boundary of its storage dtype, one side rounds it up and the other down: a whole fp8 step
(1/16 to 1/8 relative) or bf16 step (1/256). Measured: on ``kv4`` with static scales, TP 2
flips exactly one of 32768 stored V elements (13 -> 14 in fp8 units), which moves the
NLL of the later tokens by 2.6e-4; bf16 flips moved ``kv3``'s NLL by 3.8e-5; on SmolLM2
(30 layers, large activations) bf16-cache NLLs at TP 3 differ by 1e-2 in float32. That is
rounding, not a layout bug: in the float64 check mode (``tests/x64.py``) the reorderings are
~1e-16, no element flips, and every case agrees within ~1e-14. So the equality tests run in
float64 and bound the NLL by 1e-5; float32 is covered by the server test (greedy text at TP 2
equals one device's) and by the calibration comparison below.

Cost (CI has two cores): engines are built once per (checkpoint, TP size, cache) and shared
by the tests here; one decode batch bucket and serialized scheduling (the overlap
scheduler's mailbox under TP is exercised by ``tests/serve/test_server_tp.py``) keep the
compiles to one prefill, one decode and one NLL program per engine.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jfp8kv import LLM, SamplingParams
from jfp8kv.config import EngineConfig
from jfp8kv.kvcache.cache import bytes_per_token
from tests.engine.virtual_devices import run_child
from tests.tiny_checkpoints import build_tiny_checkpoint, first_layers
from tests.x64 import x64

DEVICES = 4
four_devices = pytest.mark.skipif(
    jax.device_count() < DEVICES,
    reason="runs in test_on_four_virtual_devices's child pytest (XLA_FLAGS sets 4 devices)")
CHECKPOINTS = {
    "kv4": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    "kv3": dict(num_attention_heads=12, num_key_value_heads=3, head_dim=32, hidden_size=96,
                vocab_size=390),
}
# (kv_cache_dtype, kv_scale_mode, kv_scales): static modes get given scales on the tiny
# checkpoints, so that every TP size quantizes with the same numbers (calibration on the
# mesh is compared on its own below, and used as is on SmolLM2).
CACHES = [("bfloat16", None, None), ("fp8_e4m3", "tensor", 0.05), ("fp8_e4m3", "channel", 0.05),
          ("fp8_e4m3", "token", None), ("fp8_e4m3", "block", None)]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
SCORED = [int(t) for t in np.random.default_rng(0).integers(3, 300, 30)]
NLL_TOL = 1e-5
# The checkpoint x cache matrix below runs each (checkpoint, mode class) once by default.
# Under TP the cache modes take two paths only (models/sharding.py): unscaled pools, and
# scaled ones, whose scales are sharded on the KV-head axis like the pages and whose mode
# math runs per device as on one (store_and_attend on the local heads). Within the scaled
# path, static scales (tensor, channel) arrive from the host, expanded to the replicated
# heads, and dynamic ones (token, block) are computed per device. So kv4 (sharded heads)
# runs bf16, tensor and token, kv3 (replicated heads) bf16, channel (per-head scales that
# the replication must copy) and block; every mode still runs under TP here and on
# SmolLM2's real layers at TP 3 below. The other four cases, each a mode of a class its
# checkpoint already runs, are ``slow`` (~90 s of CPU with the child's start-up):
# ``pytest -m slow tests/engine/test_tensor_parallel.py``.
SLOW_MATRIX = {("kv4", "channel"), ("kv4", "block"), ("kv3", "tensor"), ("kv3", "token")}


def _run_child(*args: str) -> str:
    """This file in a child pytest with ``DEVICES`` CPU devices (``args`` added); its stdout."""
    # The child's engines are all compile: it inherits tests/conftest.py's XLA_FLAGS (LLVM
    # at -O0), and every TP size is compared with TP 1 in that same child.
    return run_child(__file__, DEVICES, *args)


def test_on_four_virtual_devices():
    """Run the ``four_devices`` tests of this file in a child pytest with 4 CPU devices."""
    if jax.device_count() >= DEVICES:
        pytest.skip("this process has the devices: the tests run directly")
    out = _run_child()
    # Only the two parents (the child has the devices) and the slow matrix cases skip there.
    assert " passed" in out and f"{2 + len(SLOW_MATRIX)} skipped" in out.splitlines()[-1]


@pytest.mark.slow
def test_slow_cases_on_four_virtual_devices():
    """``pytest -m slow``: the matrix cases the default run leaves out (``SLOW_MATRIX``), in
    the child."""
    if jax.device_count() >= DEVICES:
        pytest.skip("this process has the devices: the tests run directly")
    out = _run_child("-m", "slow")
    assert f"{len(SLOW_MATRIX)} passed, 1 skipped" in out.splitlines()[-1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    return {name: build_tiny_checkpoint(tmp_path_factory.mktemp(f"tp-{name}"), "llama",
                                        tokenizer_dir=tiny_tokenizer_dir, **overrides)
            for name, overrides in CHECKPOINTS.items()}


ENGINE_OPTIONS = dict(max_model_len=64, max_num_seqs=4, attention_backend="reference",
                      decode_buckets=(4,), overlap_scheduling=False)


def make_llm(path, tp: int, kv_cache_dtype="bfloat16", kv_scale_mode=None, kv_scales=None,
             dtype="float32", **kw) -> LLM:
    return LLM(str(path), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
               kv_scale_mode=kv_scale_mode, kv_scales=kv_scales,
               kv_cache_memory=kw.pop("kv_cache_memory", 1 << 17), tensor_parallel_size=tp,
               **{**ENGINE_OPTIONS, **kw})


@pytest.fixture(scope="module")
def engine(checkpoints):
    """``engine(ckpt, tp, cache)``: one float64 LLM per configuration, shared by this file's
    tests (run it inside ``x64()``)."""
    made: dict[tuple, LLM] = {}

    def get(ckpt: str, tp: int, cache=CACHES[0]) -> LLM:
        key = (ckpt, tp, cache)
        if key not in made:
            with x64():
                made[key] = make_llm(checkpoints[ckpt], tp, *cache, dtype="float64")
        return made[key]

    return get


def run(llm: LLM, prompts=PROMPTS, scored=SCORED, max_tokens=5):
    """(greedy tokens per prompt, NLL of ``scored``, kv_stats) of one engine."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))
    return [o.token_ids for o in outs], np.asarray(llm.nll(scored)), llm.kv_stats()


def assert_same_as_one_device(results: dict):
    """Every TP size's greedy tokens equal TP 1's, NLL within NLL_TOL (absolute), and the
    same K/V statistics (each element counted once, also when KV heads are replicated)."""
    toks1, nll1, stats1 = results[1]
    assert np.all(np.isfinite(nll1)) and all(toks1)
    for tp, (toks, nll, stats) in results.items():
        assert toks == toks1, f"TP={tp}"
        np.testing.assert_allclose(nll, nll1, rtol=0, atol=NLL_TOL, err_msg=f"TP={tp}")
        for layer, layer1 in zip(stats["layers"], stats1["layers"]):
            for field in ("k_saturated", "v_saturated", "k_nan", "v_nan"):
                assert layer[field] == layer1[field], (tp, field)
            np.testing.assert_allclose([layer["k_amax"], layer["v_amax"]],
                                       [layer1["k_amax"], layer1["v_amax"]], rtol=1e-5)


@four_devices
@pytest.mark.parametrize("ckpt, cache", [
    pytest.param(ckpt, cache, id=f"{ckpt}-{cache[1] or cache[0]}",
                 marks=[pytest.mark.slow] if (ckpt, cache[1]) in SLOW_MATRIX else [])
    for ckpt in sorted(CHECKPOINTS) for cache in CACHES])
def test_tp_sizes_agree_with_one_device(engine, ckpt, cache):
    """TP 1, 2, 4: identical greedy tokens, NLL within 1e-5, the same K/V statistics, in
    float64 (in float32 an all-reduce ordering difference flips whole fp8/bf16 steps:
    module docstring)."""
    with x64():
        assert_same_as_one_device({tp: run(engine(ckpt, tp, cache)) for tp in (1, 2, 4)})


@four_devices
def test_overlap_decode_compiles_once_per_shape_under_tp(checkpoints):
    """With overlap scheduling a decode input is either host tokens or device tokens fed
    from the previous step; under TP both are placed replicated on the mesh, so TP 2
    compiles exactly the decode programs TP 1 does (not a second one per shape)."""
    from jfp8kv.engine import steps

    decode = steps.DECODE_JITS["default"]
    compiled = {}
    for tp in (1, 2):
        before = decode._cache_size()
        llm = make_llm(checkpoints["kv4"], tp, overlap_scheduling=True, max_model_len=48)
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=9, temperature=0,
                                                   ignore_eos=True))
        assert all(len(o.token_ids) == 9 for o in out)
        compiled[tp] = decode._cache_size() - before
    assert compiled[2] == compiled[1] >= 1, compiled


@four_devices
def test_pool_and_weights_live_on_their_shards(engine):
    """Each device holds its KV heads' pages and scales, and a column/row slice of the
    projections; kv_cache_memory and bytes_per_token are per device."""
    token = ("fp8_e4m3", "token", None)
    one, two = engine("kv4", 1, token), engine("kv4", 2, token)
    cache = two.engine.runner.cache["kv"]
    for arr in (cache.k[0], cache.v[1], cache.k_scale[0], cache.v_scale[1]):
        assert arr.sharding.spec == P("tp")
        assert {s.data.shape[0] for s in arr.addressable_shards} == {2}  # 4 KV heads / 2
    layer = two.engine.runner.params["layers"][0]
    assert layer["wq"].addressable_shards[0].data.shape == (64, 8 * 32 // 2)
    assert layer["wk"].addressable_shards[0].data.shape == (64, 4 * 32 // 2)
    assert layer["wo"].addressable_shards[0].data.shape == (8 * 32 // 2, 64)
    assert layer["w_down"].sharding.spec == P("tp", None)
    info1, info2 = one.cache_info(), two.cache_info()
    assert info2["bytes_per_token"] * 2 == info1["bytes_per_token"]
    assert info2["kv_cache_memory"] == info1["kv_cache_memory"]
    assert info2["num_pages"] == 2 * info1["num_pages"]  # half the heads per device
    for info in (info1, info2):  # per device: its pages (with the sink) of its heads
        assert info["pool_bytes"] == (info["num_pages"] + 1) * 16 * info["bytes_per_token"]
    assert (info2["tensor_parallel_size"], info2["kv_heads_per_device"],
            info2["kv_head_replication"], info2["kv_replication_bytes_per_token"]) == (2, 2, 1, 0)


@four_devices
@pytest.mark.parametrize("tp, repeat", [(2, 2), (4, 4)])
def test_replicated_kv_heads_cost_is_stated(engine, tp, repeat):
    """3 KV heads over 2 or 4 devices: lcm(3, n) cache heads, 3 per device; cache_info
    states the bytes the copies add."""
    info = engine("kv3", tp).cache_info()
    per_head = bytes_per_token(2, 1, 32, "bfloat16", None)
    assert info["kv_head_replication"] == repeat and info["kv_heads_per_device"] == 3
    assert info["bytes_per_token"] == 3 * per_head
    assert info["kv_replication_bytes_per_token"] == (tp * 3 - 3) * per_head


@four_devices
def test_calibrated_static_scales_agree(checkpoints):
    """Start-up calibration on the mesh (replicated heads measured once each) finds the
    scales one device finds, up to the all-reduce's float32 rounding."""
    one = make_llm(checkpoints["kv3"], 1, "fp8_e4m3", "channel")
    four = make_llm(checkpoints["kv3"], 4, "fp8_e4m3", "channel")
    for layer in range(2):
        for attr in ("k_scale", "v_scale"):
            s1 = np.asarray(getattr(one.engine.runner.cache["kv"], attr)[layer])
            s4 = np.asarray(getattr(four.engine.runner.cache["kv"], attr)[layer])
            np.testing.assert_allclose(s4, np.repeat(s1, 4, axis=0), rtol=1e-5)


@four_devices
def test_random_preset_generated_on_its_shards():
    """The same weights as one device's (same random bits; the jitted generator may round
    the last bit differently from the eager one)."""
    from jfp8kv.models.loader import load_model

    one = load_model("random:qwen3-tiny", "float32")
    two = load_model("random:qwen3-tiny", "float32", tensor_parallel_size=2)
    wq = two.params["layers"][1]["wq"]
    assert wq.sharding.spec == P(None, "tp") and len(wq.sharding.device_set) == 2
    assert two.params["embed"].sharding.spec == P("tp", None)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


@four_devices
def test_invalid_sizes_each_raise_one_clear_error(checkpoints, smollm2_gguf_path):
    with pytest.raises(ValueError, match=r"needs 8 devices, but JAX sees 4 cpu"):
        make_llm(checkpoints["kv4"], 8)
    with pytest.raises(ValueError, match=r"does not divide the model's 8 attention heads; "
                                         r"valid sizes on 4 device\(s\): \[1, 2, 4\]"):
        make_llm(checkpoints["kv4"], 3)
    # SmolLM2: 9 heads. Refused from its config, before any weight is read.
    with pytest.raises(ValueError, match=r"9 attention heads; valid sizes .*: \[1, 3\]"):
        LLM(str(smollm2_gguf_path), tensor_parallel_size=2)


# ---------------------------------------------------------------------- SmolLM2

SMOLLM2_LAYERS = 2  # the first layers of the real model, for the all-modes matrix
SMOLLM2_PROMPTS = ["The capital of France is", "Two plus two is"]  # one prefill bucket
SMOLLM2_TEXT = "The old lighthouse stood at the end of a narrow spit of land."


@pytest.fixture(scope="module")
def smollm2_f64(smollm2_gguf_path):
    """The default model in the float64 check mode, loaded once."""
    from jfp8kv.models.loader import load_model

    with x64():
        return load_model(str(smollm2_gguf_path), "float64")


def smollm2_results(loaded, cache, sizes=(1, 3)) -> dict:
    """``run`` of ``loaded`` (float64) at each TP size on short prompts and text;
    static fp8 modes calibrate at start-up, on each mesh (kv_scales=None)."""
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in SMOLLM2_PROMPTS]
    scored = tok.encode(SMOLLM2_TEXT)
    results = {}
    for tp in sizes:
        llm = LLM(loaded=loaded, dtype="float64", kv_cache_dtype=cache[0],
                  kv_scale_mode=cache[1], kv_cache_memory=4 << 20, tensor_parallel_size=tp,
                  **ENGINE_OPTIONS)
        results[tp] = run(llm, prompts, scored, max_tokens=4)
        assert llm.cache_info()["kv_heads_per_device"] == 3 // tp
    return results


@four_devices
@pytest.mark.parametrize("cache", CACHES, ids=lambda c: c[1] or c[0])
def test_smollm2_layers_tp3_agrees_with_one_device(smollm2_f64, cache):
    """SmolLM2's first layers (real weights), every cache mode: TP 3 gives TP 1's greedy
    tokens and NLL within 1e-5, in float64 (in float32 its bf16-cache NLL already differs
    by ~1e-2 from rounding flips: module docstring)."""
    with x64():
        results = smollm2_results(first_layers(smollm2_f64, SMOLLM2_LAYERS), cache)
    assert_same_as_one_device(results)


def test_size_below_one_is_refused():
    for bad in (0, -2):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
            EngineConfig(tensor_parallel_size=bad)
