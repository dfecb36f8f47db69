"""The offline API end to end on tiny random checkpoints (CPU, reference backend)."""

import dataclasses
import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest

import jfp8kv
from jfp8kv import EngineConfig, SamplingParams
from jfp8kv.engine.calibrate import calibrate_on_text
from jfp8kv.engine.llm import LLM
from jfp8kv.kvcache import calibrate
from jfp8kv.models.loader import load_model
from tests.x64 import x64 as enable_x64

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FP8_PAIRS = [(d, m) for d in ("fp8_e4m3", "fp8_e5m2") for m in ("tensor", "channel", "token", "block")]
KV_CONFIGS = [("bfloat16", None), ("float16", None)] + FP8_PAIRS
# Largest chunked-vs-one-shot NLL difference storage rounding flips can explain (see below).
FLIP_BOUND = {"bfloat16": 2e-2, "float16": 3e-3, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2}


@pytest.fixture(scope="module")
def qwen3(tiny_hf_checkpoint):
    """head_dim 32, so every scale mode (block needs head_dim % 32 == 0) applies."""
    return load_model(str(tiny_hf_checkpoint("qwen3")), "float32")


@pytest.fixture(scope="module")
def llama(tiny_hf_checkpoint):
    return load_model(str(tiny_hf_checkpoint("llama")), "float32")


def make(loaded, **kw):
    kw = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": 1 << 20,
          "max_num_batched_tokens": 64, **kw}
    return LLM(loaded=loaded, **kw)


def prompts(vocab, n=(3, 17, 40, 9), seed=None):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, k).tolist() for k in n]


def test_continuous_batching_equals_one_at_a_time(llama):
    llm = make(llama)
    ps = prompts(llama.config.vocab_size)
    together = llm.generate(ps, GREEDY)
    alone = [llm.generate([p], GREEDY)[0] for p in ps]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in together)
    assert llm.engine.scheduler.allocator.num_used == 0


@pytest.mark.parametrize("kv,mode", KV_CONFIGS)
def test_every_dtype_and_mode_end_to_end(qwen3, kv, mode):
    """Serving precision (float32 compute): generation runs, every path's NLL is finite, and
    chunked and one-shot prefill agree to within one storage rounding flip.

    Both paths read K/V back from the cache, but chunking changes the float32 reduction order
    of the projections, and a last-bit difference can flip an element's rounding to the
    storage format (one ulp: 2^-8 relative in bf16, 2^-3 in e4m3), which moves every later
    token's NLL a little (seen on CI's CPU: bf16 9.5e-4, e4m3 block 4.7e-3). The exact
    agreement, and decode against prefill, are checked in float64 below, where no flip occurs.
    """
    llm = make(qwen3, kv_cache_dtype=kv, kv_scale_mode=mode)
    ps = prompts(qwen3.config.vocab_size, (5, 23))
    outs = llm.generate(ps, GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    for p, o in zip(ps, outs):
        full = p + o.token_ids
        one_shot = llm.nll(full, chunk_size=128)
        chunked = llm.nll(full, chunk_size=6)
        assert np.isfinite(one_shot).all() and np.isfinite(chunked).all()
        diff = np.abs(chunked - one_shot)
        assert diff.max() <= FLIP_BOUND[kv], (diff.max(), diff)
    info = llm.cache_info()
    assert info["storage_dtype"] == str(jnp.dtype(llm.cache_plan.layout.storage_dtype))
    assert llm.kv_stats()["nan_total"] == 0


@pytest.fixture(scope="module")
def qwen3_f64(tiny_hf_checkpoint):
    """The same checkpoint in the float64 check mode (loaded with x64 on)."""
    with enable_x64():
        return load_model(str(tiny_hf_checkpoint("qwen3")), "float64")


@pytest.fixture
def x64():
    """64-bit JAX for one test only (other tests check that float64 is refused without it)."""
    with enable_x64():
        yield


@pytest.mark.parametrize("kv,mode", KV_CONFIGS)
def test_decode_one_shot_and_chunked_read_the_same_numbers(qwen3_f64, x64, kv, mode):
    """In float64 compute the three paths store identical K/V, so chunked prefill equals
    one-shot prefill to round-off and teacher-forced argmax reproduces what decode generated."""
    llm = make(qwen3_f64, dtype="float64", kv_cache_dtype=kv, kv_scale_mode=mode)
    ps = prompts(qwen3_f64.config.vocab_size, (5, 23))
    outs = llm.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        full = p + o.token_ids
        one_shot, lg = llm.nll(full, chunk_size=128, return_logits=True)
        chunked = llm.nll(full, chunk_size=6)
        assert np.isfinite(one_shot).all()
        np.testing.assert_allclose(chunked, one_shot, rtol=1e-9, atol=1e-9)
        assert lg[len(p) - 1:].argmax(-1).tolist() == o.token_ids
    assert llm.kv_stats()["nan_total"] == 0


def test_fp8_stays_close_to_unquantized(qwen3):
    ids = prompts(qwen3.config.vocab_size, (100,))[0]
    ref = make(qwen3).nll(ids)
    for kv, mode in FP8_PAIRS:
        got = make(qwen3, kv_cache_dtype=kv, kv_scale_mode=mode).nll(ids)
        rel = abs(got.mean() - ref.mean()) / ref.mean()
        assert rel < (0.02 if kv == "fp8_e4m3" else 0.05), (kv, mode, rel)


def test_capacity_static_fp8_is_exactly_twice_bf16(qwen3):
    bf16 = make(qwen3, kv_cache_dtype="bfloat16", kv_cache_memory=1 << 22).cache_info()
    for mode in ("tensor", "channel"):
        f8 = make(qwen3, kv_cache_dtype="fp8", kv_scale_mode=mode, kv_scales=0.05,
                  kv_cache_memory=(1 << 22) + 2 * 2 * 2 * 32 * 4).cache_info()
        assert f8["max_tokens"] == 2 * bf16["max_tokens"]
        assert f8["bytes_per_token"] * 2 == bf16["bytes_per_token"]
        assert f8["kv_cache_dtype"] == "fp8_e4m3"


def test_seeded_sampling_is_reproducible_and_batch_independent(llama):
    llm = make(llama)
    ps = prompts(llama.config.vocab_size, (4, 11, 30))
    sp = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=s,
                         ignore_eos=True) for s in (1, 2, 3)]
    a = llm.generate(ps, sp)
    b = [llm.generate([p], s)[0] for p, s in zip(ps, sp)]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = llm.generate(ps[0], dataclasses.replace(sp[0], seed=99))[0]
    d = llm.generate(ps[0], dataclasses.replace(sp[0], temperature=0))[0]
    assert c.token_ids != a[0].token_ids or d.token_ids != a[0].token_ids
    k1 = llm.generate(ps[0], SamplingParams(max_tokens=10, temperature=2.0, top_k=1, seed=5,
                                            ignore_eos=True))[0]
    assert k1.token_ids == d.token_ids  # top_k=1 is greedy whatever the temperature


def test_stop_rules(llama):
    llm = make(llama)
    p = prompts(llama.config.vocab_size, (8,))[0]
    free = llm.generate(p, GREEDY)[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    o = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id],
                                       ignore_eos=True))[0]
    assert o.token_ids == free.token_ids[:first + 1] and o.finish_reason == "stop"
    text = free.text
    stop_str = text[len(text) // 2:len(text) // 2 + 2] if len(text) > 4 else None
    if stop_str and stop_str.strip():
        o = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, stop=stop_str,
                                           ignore_eos=True))[0]
        assert o.finish_reason == "stop" and stop_str not in o.text
        assert text.startswith(o.text)
    o = llm.generate(p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(o.token_ids) == 3 and o.finish_reason == "length"


def test_user_errors_are_clear(llama, qwen3, tmp_path):
    llm = make(llama)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 200))], GREEDY)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="kv_cache_memory"):
        make(llama, kv_cache_memory=4096)
    with pytest.raises(ValueError, match="fp8_e4m3"):
        make(llama, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="token"):
        make(llama, kv_cache_dtype="fp8", kv_scale_mode="row")
    with pytest.raises(ValueError, match="head_dim divisible by 32"):
        make(llama, kv_cache_dtype="fp8", kv_scale_mode="block")  # head_dim 16
    with pytest.raises(ValueError, match="reference"):
        make(llama, attention_backend="pallas")  # no GPU here
    with pytest.raises(ValueError, match="pallas_triton.*reference"):
        make(llama, attention_backend="pallas_triton")
    with pytest.raises(ValueError, match="page_size"):
        make(llama, page_size=12)
    with pytest.raises(ValueError, match="bfloat16"):
        make(llama, dtype="float8")
    with pytest.raises(ValueError, match="JAX_ENABLE_X64"):  # the float64 check mode
        make(llama, dtype="float64")
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_engine_config_reaches_scheduler_and_runner(llama):
    """An EngineConfig gives the same engine as the same keywords; keywords override it."""
    cfg = EngineConfig(max_model_len=128, kv_cache_memory=1 << 20, max_num_batched_tokens=64,
                       decode_steps=3, decode_buckets=(2, 8), min_prefill_chunk=32)
    llm = LLM(loaded=llama, dtype="float32", engine_config=cfg)
    sched, runner = llm.engine.scheduler, llm.engine.runner
    assert (sched.decode_steps, runner.decode_buckets, runner.min_chunk) == (3, (2, 8), 32)
    # nothing else left to resolve on CPU: the default sequences
    assert llm.engine_config == dataclasses.replace(cfg, max_num_seqs=64)
    by_kw = make(llama, decode_steps=3, decode_buckets=(2, 8), min_prefill_chunk=32)
    ps = prompts(llama.config.vocab_size, (3, 17, 9))
    assert ([o.token_ids for o in llm.generate(ps, GREEDY)]
            == [o.token_ids for o in by_kw.generate(ps, GREEDY)])
    assert make(llama).engine_config.decode_steps == 1  # CPU default
    over = LLM(loaded=llama, dtype="float32", engine_config=cfg, page_size=32, decode_steps=1)
    assert over.cache_plan.page_size == 32 and over.engine.scheduler.decode_steps == 1
    with pytest.raises(TypeError, match="unknown engine option"):
        make(llama, max_num_seq=4)


def test_start_up_logs_one_cache_line_and_warns_on_fp8_only_options(llama, caplog):
    with caplog.at_level(logging.INFO):
        make(llama, kv_cache_dtype="bfloat16", kv_scale_mode="tensor", kv_scales=0.5)
    summary = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert len(summary) == 1 and summary[0].startswith("KV cache: dtype bfloat16,")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "kv_scale_mode='tensor', kv_scales=0.5: fp8-only" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        make(llama, kv_cache_dtype="fp8", kv_scale_mode="token")
    assert not caplog.records


def test_fp8_needs_compute_capability_89(llama):
    @dataclasses.dataclass
    class FakeGPU:
        compute_capability: str
        platform: str = "gpu"
        device_kind: str = "NVIDIA A100"

    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        make(llama, kv_cache_dtype="fp8_e4m3", device=FakeGPU("8.0"), attention_backend="reference")
    from jfp8kv.engine.llm import check_fp8_support

    check_fp8_support(FakeGPU("9.0"), "float8_e4m3fn", "auto")  # Hopper: fine
    check_fp8_support(FakeGPU("8.0"), "bfloat16", "auto")  # bf16 on Ampere: fine


def test_static_scales_warn_calibrate_and_round_trip(qwen3, llama, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        make(qwen3, kv_cache_dtype="fp8", kv_scale_mode="tensor", kv_scales=1.0)
    assert "scale of 1.0" in caplog.text
    amax = calibrate_on_text(qwen3, [calibrate.BUILTIN_TEXT])
    assert amax.k.shape == (2, 2, 32) and (amax.k > 0).all()
    path = str(tmp_path / "scales.json")
    amax.to_json(path)
    back = calibrate.KVAmax.from_json(path, calibrate.fingerprint(qwen3.config))
    np.testing.assert_allclose(back.k, amax.k, rtol=1e-5)
    a = make(qwen3, kv_cache_dtype="fp8", kv_scale_mode="channel", kv_scales=path)
    k_scale = np.asarray(a.engine.runner.cache["kv"].k_scale[1])
    np.testing.assert_allclose(k_scale, amax.k[1] / 448.0, rtol=1e-5)
    auto = make(qwen3, kv_cache_dtype="fp8", kv_scale_mode="channel")  # calibrates at start
    np.testing.assert_allclose(np.asarray(auto.engine.runner.cache["kv"].k_scale[1]), k_scale, rtol=1e-5)
    with pytest.raises(ValueError, match="another model"):
        make(llama, kv_cache_dtype="fp8", kv_scale_mode="channel", kv_scales=path)
    doc = json.load(open(path))
    doc["format_version"] = 99
    json.dump(doc, open(path, "w"))
    with pytest.raises(ValueError, match="not a jfp8kv scales file"):
        make(qwen3, kv_cache_dtype="fp8", kv_scale_mode="channel", kv_scales=path)


def test_kv_stats_count_saturation_and_nan(qwen3):
    llm = make(qwen3, kv_cache_dtype="fp8", kv_scale_mode="tensor", kv_scales=1e-4)
    llm.generate(prompts(qwen3.config.vocab_size, (20,)), GREEDY)
    st = llm.kv_stats()
    assert st["saturated_total"] > 0 and st["nan_total"] == 0
    assert all(layer["k_amax"] > 0 for layer in st["layers"])
    params = dict(qwen3.params)
    layers = [dict(lp) for lp in params["layers"]]
    layers[1]["wv"] = layers[1]["wv"].at[:, 0].set(jnp.nan)  # V head 0, channel 0 -> NaN
    params["layers"] = layers
    bad = dataclasses.replace(qwen3, params=params)
    llm = make(bad, kv_cache_dtype="fp8", kv_scale_mode="token")
    llm.generate(prompts(qwen3.config.vocab_size, (7,)), SamplingParams(max_tokens=2, temperature=0))
    st = llm.kv_stats()
    assert st["layers"][1]["v_nan"] >= 7 and st["layers"][0]["v_nan"] == 0


def test_generate_convenience(tiny_hf_checkpoint):
    out = jfp8kv.generate(["hello world"], model=str(tiny_hf_checkpoint("llama")), dtype="float32",
                          max_model_len=64, kv_cache_memory=1 << 20, sampling_params=GREEDY)
    assert len(out) == 1 and len(out[0].token_ids) == 12 and isinstance(out[0].text, str)


def test_calibrate_cli_writes_a_file_the_engine_loads(tiny_hf_checkpoint, tmp_path):
    from jfp8kv.calibrate import main as calibrate_main

    path = tiny_hf_checkpoint("qwen3")
    text = tmp_path / "text.txt"
    text.write_text(calibrate.BUILTIN_TEXT * 2)
    out = tmp_path / "scales.json"
    assert calibrate_main(["--model", str(path), "--text", str(text), "--out", str(out),
                           "--headroom", "1.25"]) == 0
    doc = json.load(open(out))
    assert doc["headroom"] == 1.25 and np.asarray(doc["k_amax"]).shape == (2, 2, 32)
    llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp8_e4m3", kv_scale_mode="tensor",
              kv_scales=str(out), max_model_len=64, kv_cache_memory=1 << 20)
    k = np.asarray(llm.engine.runner.cache["kv"].k_scale[0])
    np.testing.assert_allclose(k, np.asarray(doc["k_amax"])[0].max() / 448.0, rtol=1e-5)
