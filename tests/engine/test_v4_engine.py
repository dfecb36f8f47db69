"""DeepSeek-V4 through the engine (random tiny preset, float32, CPU): greedy ``LLM.generate``
equals greedy decoding with the reference forward (no engine) whose ``storage`` is the pools'
dtype, for bf16 pools here and fp8 e4m3 pools in ``test_v4_preemption.py`` (a pool small
enough to preempt);
the planner's pages at a fixed budget are the byte model's exactly; unsupported settings
are refused at construction with a message naming what works."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv import LLM, SamplingParams
from jfp8kv.config import CacheOptions, EngineConfig
from jfp8kv.engine import builder
from jfp8kv.kvcache import v4_pools
from jfp8kv.kvcache.layout import CacheRequest
from jfp8kv.models import families
from jfp8kv.models import deepseek_v4 as dv4
from jfp8kv.models.loader import load_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# The 30-token prompt is prefilled in two chunks (max_num_batched_tokens 16), beside decode.
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], list(range(20, 50)), [70, 2, 33, 14, 51]]
STORAGE = {"bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}


@pytest.fixture(scope="module")
def loaded():
    return load_model("random:deepseek-v4-tiny", "float32")


def _llm(loaded, **kw):
    opts = dict(max_model_len=64, max_num_seqs=4, decode_buckets=(4,), attention_backend="auto",
                max_num_batched_tokens=16)
    return LLM(loaded=loaded, dtype="float32", **{**opts, **kw})


@functools.cache
def reference_greedy(storage: str) -> list[list[int]]:
    """Greedy tokens of the reference forward for PROMPTS: one batch padded to 32 with
    per-row real counts (``n_new``), then batched decode steps."""
    loaded, prompts, steps = load_model("random:deepseek-v4-tiny", "float32"), PROMPTS, \
        GREEDY.max_tokens
    cfg, params = loaded.config, loaded.params
    ids = np.zeros((len(prompts), 32), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    logits, state = dv4.forward(params, dv4.init_state(cfg, len(prompts), 64), jnp.asarray(ids),
                                cfg, storage=storage, n_new=lens)
    tok = jnp.take_along_axis(logits, (lens - 1)[:, None, None], 1)[:, 0].argmax(-1)
    out = [tok]
    for _ in range(steps - 1):
        logits, state = dv4.forward(params, state, out[-1][:, None], cfg, storage=storage)
        out.append(logits[:, 0].argmax(-1))
    return np.stack([np.asarray(t) for t in out], 1).tolist()


def test_greedy_equals_reference_forward_bf16(loaded):
    """bf16 pools, 4 decode steps per dispatch (the GPU's policy is 8); then LLM.nll through
    the scratch slot (chunks of 16) gives the generated tokens as its argmaxes."""
    llm = _llm(loaded, kv_cache_dtype="bfloat16", decode_steps=4)
    info = llm.cache_info()
    assert info["kv_layout"] == "v4" and info["enable_prefix_caching"] is True
    assert info["kv_scale_mode"] is None
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.kv_stats()["saturated_total"] == 0  # not counted for V4 yet: zeros
    assert [o.token_ids for o in outs] == reference_greedy("bfloat16")
    full = PROMPTS[1] + outs[1].token_ids
    _, logits = llm.nll(full, return_logits=True)
    assert logits[len(PROMPTS[1]) - 1:].argmax(-1).tolist() == outs[1].token_ids


def test_capacity_at_a_fixed_budget_is_the_byte_model(loaded):
    """At one budget, each dtype's pages are what V4PoolSpec's bytes say (slots first: the
    sequences', then 2 state snapshots; the padding page 0 beside the budget), the allocated
    pools are those bytes exactly, and fp8 holds more tokens by the byte ratio."""
    budget = 200_000
    tokens = {}
    for kv, name in (("bfloat16", "auto"), ("fp8_e4m3", "fp8_e4m3")):
        spec = v4_pools.V4PoolSpec.from_model(loaded.config, name, 16)
        info = _llm(loaded, kv_cache_dtype=kv, kv_cache_memory=budget,
                    state_snapshot_memory=2 * spec.bytes_per_slot()).cache_info()
        pages = (budget - 8 * spec.bytes_per_slot()) // spec.bytes_per_page()
        assert info["num_pages"] == pages and info["state_slots"] == 4
        assert info["snapshot_slots"] == 2
        want = {"compressed": (pages + 1) * spec.compressed_bytes_per_page(),
                "indexer": (pages + 1) * spec.indexer_bytes_per_page(),
                "window": 8 * spec.window_bytes_per_slot(),
                "compressor": 8 * spec.state_bytes_per_slot()}
        assert {k: p["bytes"] for k, p in info["pools"].items()} == want
        assert {k: p["kind"] for k, p in info["pools"].items()} == {
            "compressed": "paged", "indexer": "paged", "window": "slot", "compressor": "slot"}
        assert info["pool_bytes"] == sum(want.values())
        tokens[kv] = info["max_tokens"]
    assert tokens["fp8_e4m3"] > tokens["bfloat16"]


def test_refusals_name_what_works(loaded):
    cfg = loaded.config
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices"):
        load_model("random:deepseek-v4-tiny", "float32", 2)  # TP: test_tp_families.py
    with pytest.raises(ValueError, match="leave kv_scale_mode unset"):
        _llm(loaded, kv_cache_dtype="fp8_e4m3", kv_scale_mode="token")
    with pytest.raises(ValueError, match="'fp8_e4m3' or 'auto'"):
        _llm(loaded, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="'none'"):
        _llm(loaded, kv_cache_dtype="fp8_e4m3", kv_rotation="hadamard")
    layout = families.of(cfg).cache_layout(cfg, CacheRequest("bfloat16"), "reference")
    engine = builder.check_settings(layout, CacheOptions(), EngineConfig(page_size=8))
    assert engine.enable_prefix_caching is True and layout.page_size(8) == 8
    engine = builder.check_settings(layout, CacheOptions(),
                                    EngineConfig(page_size=8, state_snapshot_memory=0))
    assert engine.enable_prefix_caching is False
    from jfp8kv.models.v4_presets import v4_config

    big = v4_config("deepseek-v4-flash-4l")
    layout = families.of(big).cache_layout(big, CacheRequest("float8_e4m3fn"), "reference")
    assert layout.page_size(16) == 128 and layout.page_multiple == 128
    assert families.of(big).default_max_model_len is None  # the model's context


@pytest.mark.parametrize("limit, want", [(80 << 30, 1 << 20), (3 << 30, None)])
def test_context_is_the_models_as_far_as_the_pool_holds_it(monkeypatch, limit, want):
    """The memory plan on a fake GPU (``test_memory_plan``'s fakes: a runner whose
    executables' peak is known, nothing compiled; 1.9 GB in use) for flash-4l's fp8 pools
    (204.25 bytes per token: 1M tokens take 214 MB), max_model_len unset: the model's
    1,048,576 tokens where the pool holds them (80 GB), else what the pages hold (3 GB:
    ~0.14 GB of pools after the 1 GB margin)."""
    from jfp8kv.config import EngineConfig
    from jfp8kv.engine import capacity, memory
    from jfp8kv.engine.device_policy import device_defaults
    from jfp8kv.models.v4_presets import v4_config
    from tests.engine.test_memory_plan import FakeGPU, FakeRunner

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    cfg = v4_config("deepseek-v4-flash-4l")
    layout = families.of(cfg).cache_layout(cfg, CacheRequest("float8_e4m3fn"), "reference")
    asked = EngineConfig(page_size=128, max_num_seqs=32)
    dev = FakeGPU(limit, 1900 << 20)
    dm = memory.device_memory(dev, 0.9, 1900 << 20)
    sizer = capacity.Sizer(cfg, layout, device_defaults(asked, dev), asked, dm,
                           lambda plan, e: FakeRunner(plan, e, [], 1 << 10, 0),
                           memory.PeakMemo(None), family_default=None)
    sizing, _ = sizer.size()
    got = sizing.engine.max_model_len
    if want is None:
        assert got < cfg.max_position_embeddings and got % 128 == 0
        assert sizing.plan.max_tokens >= got
    else:
        assert got == want == cfg.max_position_embeddings


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_gpu_generates_through_the_kernels(loaded, kv):
    """On the GPU the engine attends through ``kernels.v4_paged_sparse`` / ``v4_paged_indexer``
    (backend pallas, the pools read in place) and the MoE through the grouped matmul; the
    reference forward (jnp, gathered experts) on the same device is the twin. float32 at the
    highest matmul precision; the two paths sum in different orders, so a near-tie may flip
    a greedy token and everything after it: each prompt's first token must agree and at
    least 90% of all tokens."""
    import jax

    with jax.default_matmul_precision("highest"):
        llm = _llm(loaded, kv_cache_dtype=kv)
        assert llm.cache_info()["attention_backend"] == "pallas"
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        want = reference_greedy(STORAGE[kv])
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    print(f"{kv}: {same} of {sum(map(len, want))} tokens agree")
    assert [g[0] for g in got] == [w[0] for w in want]
    assert same >= 0.9 * sum(map(len, want))
