"""Tensor parallelism for the MLA, hybrid and DeepSeek-V4 families on 4 virtual CPU devices
(``models/sharding.py``): each family's tiny preset at TP 2 and 4 (where its head counts
divide) gives TP 1's greedy tokens and mean NLL within 2e-3, bf16 and fp8 caches, in
float32 (the all-reduces sum in another order, so a few stored values round the other way:
``test_tensor_parallel.py``'s docstring); each device holds exactly the bytes the planner
counted (``tests/kvcache/test_tp_capacity.py`` holds the planner's per-device numbers
against the golden table); weights and pools live where the layout says; refusals name
the sizes that work. As ``test_tensor_parallel.py``, the ``four_devices`` tests run in a
child pytest with ``XLA_FLAGS`` giving 4 CPU devices.

Presets: ``deepseek-v2-tiny`` (MLA: 4 query heads, a replicated latent pool, 8 experts),
``qwen3.6-tiny`` (hybrid: 4 query heads over 2 KV heads, DeltaNet 2 q/k heads and 4 value
heads: at TP 4 both kinds of 2-head count are stored twice), ``deepseek-v4-tiny`` (4 query
heads in 2 output groups: TP 1 and 2 only; every pool replicated). The TP 2 engines place a
model loaded on one device (``place_params``), the largest size loads onto its mesh
(``load_model(..., tensor_parallel_size=N)``: the random generators on their shards).

Cost (CI has two cores): one engine per (family, size, cache), shared by the tests; the fp8
cache runs at TP 1 and the largest size by default, its middle size (the same per-device
code: MLA's and V4's pools are replicated at every size, and the hybrid's store runs per
device as at TP 4) and the Pallas kernels in interpret mode under TP are ``slow``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jfp8kv import LLM, SamplingParams
from tests.engine.virtual_devices import run_child
from tests.models.test_qwen3_hybrid import hybrid_checkpoint  # noqa: F401 (fixture)

DEVICES = 4
four_devices = pytest.mark.skipif(
    jax.device_count() < DEVICES,
    reason="runs in test_on_four_virtual_devices's child pytest (XLA_FLAGS sets 4 devices)")
PRESETS = {"mla": "random:deepseek-v2-tiny", "hybrid": "random:qwen3.6-tiny",
           "v4": "random:deepseek-v4-tiny"}
SIZES = {"mla": (1, 2, 4), "hybrid": (1, 2, 4), "v4": (1, 2)}
CACHES = ("bfloat16", "fp8_e4m3")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
SCORED = [int(t) for t in np.random.default_rng(0).integers(3, 90, 30)]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
NLL_TOL = 2e-3
ENGINE_OPTIONS = dict(dtype="float32", max_model_len=64, max_num_seqs=4, decode_buckets=(4,),
                      overlap_scheduling=False, attention_backend="reference",
                      kv_cache_memory=1 << 20)
MATRIX = [(f, kv, n) for f in PRESETS for kv in CACHES for n in SIZES[f][1:]]
SLOW = {(f, "fp8_e4m3", n) for f in PRESETS for n in SIZES[f][1:-1]}


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
    skipped = 2 + len(SLOW) + len(PRESETS)  # the parents, the slow matrix and interpret cases
    assert " passed" in out and f"{skipped} skipped" in out.splitlines()[-1]


@pytest.mark.slow
def test_slow_cases_on_four_virtual_devices():
    """``pytest -m slow``: the cases the default run leaves out, in the child."""
    if jax.device_count() >= DEVICES:
        pytest.skip("this process has the devices: the tests run directly")
    out = _run_child("-m", "slow")
    assert f"{len(SLOW) + len(PRESETS)} passed, 1 skipped" in out.splitlines()[-1]


@pytest.fixture(scope="module")
def loaded():
    """Each family's preset loaded on one device (float32), once."""
    from jfp8kv.models.loader import load_model

    made = {}

    def get(family: str):
        if family not in made:
            made[family] = load_model(PRESETS[family], "float32")
        return made[family]

    return get


@pytest.fixture(scope="module")
def engine(loaded):
    """``engine(family, kv_cache_dtype, tp)``: one LLM per configuration, shared."""
    from jfp8kv.models.loader import load_model

    made: dict[tuple, LLM] = {}

    def get(family: str, kv: str, tp: int, backend: str | None = None) -> LLM:
        key = (family, kv, tp, backend)
        if key not in made:
            model = loaded(family)
            if tp > 1 and tp == SIZES[family][-1]:
                model = load_model(PRESETS[family], "float32", tp)
            made[key] = LLM(loaded=model, kv_cache_dtype=kv, tensor_parallel_size=tp,
                            **ENGINE_OPTIONS)
        return made[key]

    return get


def run(llm: LLM):
    """(greedy tokens per prompt, per-position NLL of SCORED, kv_stats) of one engine."""
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs], np.asarray(llm.nll(SCORED)), llm.kv_stats()


def assert_agrees(one, other, what: str):
    toks1, nll1, stats1 = one
    toks, nll, stats = other
    assert all(toks1) and np.all(np.isfinite(nll1))
    assert toks == toks1, what
    assert abs(float(nll.mean()) - float(nll1.mean())) <= NLL_TOL, (what, nll.mean(), nll1.mean())
    for layer, layer1 in zip(stats["layers"], stats1["layers"]):
        for field in ("k_saturated", "v_saturated", "k_nan", "v_nan"):
            assert layer[field] == layer1[field], (what, field)


@four_devices
@pytest.mark.parametrize("family, kv, tp", [
    pytest.param(*c, id="-".join(map(str, c)),
                 marks=[pytest.mark.slow] if c in SLOW else []) for c in MATRIX])
def test_tp_gives_one_devices_tokens_and_nll(engine, family, kv, tp):
    assert_agrees(run(engine(family, kv, 1)), run(engine(family, kv, tp)),
                  f"{family} {kv} TP={tp}")


def _shard_shapes(x) -> set:
    return {s.data.shape for s in x.addressable_shards}


@four_devices
@pytest.mark.parametrize("family", list(PRESETS))
def test_each_device_holds_the_planned_bytes(engine, family):
    """At the largest size: every device's arrays of every pool are exactly the plan's
    per-device bytes (split pools: 1/N of each array; replicated ones: all of it), and
    cache_info reports them; what replicated rows add over the devices is stated."""
    n = SIZES[family][-1]
    llm, one = engine(family, "bfloat16", n), engine(family, "bfloat16", 1)
    cache, plan = llm.engine.runner.cache, llm.engine.runner.cache.plan
    assert cache.pool_nbytes(per_device=True) == plan.pool_bytes()
    info = llm.cache_info()
    assert {k: p["bytes"] for k, p in info["pools"].items()} == plan.pool_bytes()
    assert info["pool_bytes"] == sum(plan.pool_bytes().values())
    for pool in plan.layout.pools:
        for x in jax.tree.leaves(cache[pool.name]):
            assert len(x.sharding.device_set) == n
            per_device = [s.data.nbytes for s in x.addressable_shards]
            assert len(per_device) == n and len(set(per_device)) == 1
        assert info["pools"][pool.name]["split"] == pool.split
    split = {p.name for p in plan.layout.pools if p.split}
    assert split == {"mla": set(), "hybrid": {"kv", "deltanet"}, "v4": set()}[family]
    bpt, bpt1 = info["bytes_per_token"], one.cache_info()["bytes_per_token"]
    assert info["kv_replication_bytes_per_token"] == n * bpt - bpt1
    if family == "hybrid":  # 2 KV heads and 2 DeltaNet q/k heads, each stored twice at TP 4
        assert bpt * 2 == bpt1 and info["kv_head_replication"] == 2
        state = cache["deltanet"]
        # every slot (4 sequences, the sink, the scratch and the state snapshots) on each
        # device, 1 value head each
        assert _shard_shapes(state.recurrent[0]) == {(plan.num_slots, 1, 32, 32)}
        assert plan.num_slots == 6 + plan.num_snapshots
        assert _shard_shapes(state.conv[0]) == {(plan.num_slots, 3, 2 * 32 + 32)}  # q, k, v
    else:  # replicated pools: one device's bytes per token
        assert bpt == bpt1 and info["num_pages"] == one.cache_info()["num_pages"]


@four_devices
@pytest.mark.parametrize("family", list(PRESETS))
def test_weights_live_on_their_shards(engine, family):
    """Query heads, DeltaNet value heads and V4's output groups split; experts split on
    their intermediate axis; the latent / single-head projections replicated."""
    n = SIZES[family][-1]
    params = engine(family, "bfloat16", n).engine.runner.params
    layer = params["layers"][-1]  # a routed layer in every preset
    cfg = engine(family, "bfloat16", n).engine.runner.cfg
    for name, spec in (("experts_gate", P(None, None, "tp")), ("experts_up", P(None, None, "tp")),
                       ("experts_down", P(None, "tp", None)), ("shared_gate", P(None, "tp")),
                       ("shared_down", P("tp", None)), ("router", P())):
        assert layer[name].sharding.spec == spec, name
    want = {"mla": {"wq": P(None, "tp"), "wkv_b": P(None, "tp"), "wo": P("tp", None),
                    "wkv_a": P()},
            "hybrid": {"wq": P(None, "tp"), "wo": P("tp", None), "wk": P()},
            "v4": {"wq_b": P(None, "tp"), "wo_a": P("tp", None, None), "wo_b": P("tp", None),
                   "sinks": P("tp"), "wkv": P(), "wq_a": P()}}[family]
    for name, spec in want.items():
        assert layer[name].sharding.spec == spec, name
    if family == "v4":
        assert all(x.sharding.spec == P() for x in jax.tree.leaves(
            (layer["indexer"], layer["compressor"])))
        assert _shard_shapes(layer["wo_a"]) == {(1, 64, 16)}  # one of 2 groups each
    if family == "hybrid":
        lin = params["layers"][0]
        hy = cfg.hybrid
        stored = 2 * (4 * 32) + hy.value_dim  # 2 q/k heads stored twice: 4 of each
        assert lin["w_qkv"].shape == (cfg.hidden_size, stored)
        assert _shard_shapes(lin["w_qkv"]) == {(cfg.hidden_size, stored // n)}
        assert lin["conv_w"].sharding.spec == P("tp", None, None)
        for name in ("dt_bias", "A_log"):
            assert lin[name].sharding.spec == P("tp"), name
        assert lin["w_out"].sharding.spec == P("tp", None)


@four_devices
@pytest.mark.parametrize("family", list(PRESETS))
def test_layers_communicate_by_all_reduce_only(engine, family):
    """The compiled decode forward at the largest size: every collective is an all-reduce
    (no weight or cache is gathered or moved between devices), at most two per layer
    (attention or DeltaNet out, MLP out), two small ones per paged K/V layer (the fp8
    statistics row: counts summed, amax maximized) and one for the vocab-split embedding;
    XLA may combine neighbours."""
    import re

    import jax.numpy as jnp

    from jfp8kv.models import families

    runner = engine(family, "bfloat16", SIZES[family][-1]).engine.runner
    z, rows = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2,), jnp.int32)
    step = jax.jit(lambda params, cache, *a: families.forward(
        params, cache, *a, cfg=runner.cfg, backend=runner.backend, tp=runner.tp))
    hlo = step.lower(runner.params, runner.cache, z, z, z, jnp.zeros((2, 4), jnp.int32), rows,
                     rows).compile().as_text()
    ops = re.findall(r" (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                     r"(?:-start)?\(", hlo)
    cfg = runner.cfg
    paged_kv = len(cfg.hybrid.attention_layers) if cfg.hybrid else 0
    assert set(ops) == {"all-reduce"}
    assert cfg.num_layers <= len(ops) <= 2 * cfg.num_layers + 2 * paged_kv + 1


@four_devices
def test_hybrid_weights_are_the_models_in_their_stored_order(hybrid_checkpoint):  # noqa: F811
    """The DeltaNet q/k/v channels are stored device by device (``sharding.delta_columns``):
    a checkpoint loaded at TP 4 (each tensor sent to its shards), the same model placed on
    the mesh after loading, and the random preset generated on its shards are each the
    one-device weights in that order."""
    from jfp8kv.engine.builder import place_model
    from jfp8kv.models import sharding
    from jfp8kv.models.layers import map_named
    from jfp8kv.models.loader import load_model

    def named(params) -> list:
        out = []
        map_named(lambda k, x: out.append((k, np.asarray(x))), params)
        return out

    for source in (str(hybrid_checkpoint), PRESETS["hybrid"]):
        one = load_model(source, "float32")
        tp = sharding.plan(one.config, 4)
        placed, _ = place_model(one, 4)
        for four in (load_model(source, "float32", 4), placed):
            assert four.tensor_parallel_size == 4
            got, want = named(four.params), named(one.params)
            assert [k for k, _ in got] == [k for k, _ in want]
            for (name, b), (_, a) in zip(got, want):
                np.testing.assert_allclose(tp.unarrange(name, b, 4), a, rtol=1e-6, atol=1e-9,
                                           err_msg=name)
    cols = sharding.delta_columns(one.config, 4)
    assert sorted(set(cols.tolist())) == list(range(one.config.hybrid.conv_dim))


@four_devices
def test_refusals_name_the_sizes_that_work(loaded):
    from jfp8kv.models.loader import load_model

    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's "
                                         r"2 output groups \(o_groups\); valid sizes on 4 "
                                         r"device\(s\): \[1, 2\]"):
        load_model(PRESETS["v4"], "float32", 4)
    with pytest.raises(ValueError, match=r"does not divide the model's 4 attention heads and "
                                         r"4 DeltaNet value heads; valid sizes on 4 "
                                         r"device\(s\): \[1, 2, 4\]"):
        LLM(loaded=loaded("hybrid"), tensor_parallel_size=3, **ENGINE_OPTIONS)
    with pytest.raises(ValueError, match=r"does not divide the model's 4 attention heads; "
                                         r"valid sizes .*\[1, 2, 4\]"):
        LLM(loaded=loaded("mla"), tensor_parallel_size=3, **ENGINE_OPTIONS)


@four_devices
@pytest.mark.slow
@pytest.mark.parametrize("family", list(PRESETS))
def test_pallas_kernels_in_interpret_mode_run_per_device(engine, loaded, monkeypatch, family):
    """The Pallas backends' kernels (interpret mode: latent attention, DeltaNet's in-place
    decode, V4's sparse attention and indexer, the grouped expert matmul) inside the
    per-device sections at TP 2, fp8 cache: TP 1's reference tokens, mean NLL within 2e-3."""
    from jfp8kv.engine import builder

    want = run(engine(family, "fp8_e4m3", 1))
    monkeypatch.setattr(builder, "choose_backend", lambda *a: "pallas_interpret")
    llm = LLM(loaded=loaded(family), kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2,
              **ENGINE_OPTIONS)
    assert llm.engine.runner.backend == "pallas_interpret"
    assert_agrees(want, run(llm), f"{family} interpret TP=2")


@four_devices
@pytest.mark.parametrize("inter", [8, 6])
def test_mlp_section_sums_the_slices_or_runs_whole(inter):
    """``TensorParallel.mlp`` on a DeepSeek MoE block over 4 devices: experts and shared
    expert split on an intermediate size of 8 (partial sums added), or run whole on every
    device when it is 6 (not divisible): both equal the block on one device."""
    import jax.numpy as jnp

    from jfp8kv.models import moe, sharding
    from jfp8kv.models.loader import load_model

    cfg = load_model(PRESETS["mla"], "float32").config
    tp = sharding.plan(cfg, 4)
    rng = np.random.default_rng(0)
    d, e = 16, 4
    lp = {"router": rng.normal(size=(d, e)), "experts_gate": rng.normal(size=(e, d, inter)),
          "experts_up": rng.normal(size=(e, d, inter)),
          "experts_down": rng.normal(size=(e, inter, d)),
          "shared_gate": rng.normal(size=(d, inter)), "shared_up": rng.normal(size=(d, inter)),
          "shared_down": rng.normal(size=(inter, d))}
    lp = {k: jnp.asarray(v, jnp.float32) for k, v in lp.items()}
    h = jnp.asarray(rng.normal(size=(2, 3, d)), jnp.float32)

    def block(h, lp):
        return moe.deepseek_moe_mlp(h, lp, version=2, top_k=2)

    placed = {k: tp.put(k, np.asarray(v)) for k, v in lp.items()}
    assert (placed["experts_gate"].sharding.spec == P(None, None, "tp")) == (inter == 8)
    got = jax.jit(lambda h, lp: tp.mlp(block, h, lp))(h, placed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(block(h, lp)), rtol=1e-5, atol=1e-5)
