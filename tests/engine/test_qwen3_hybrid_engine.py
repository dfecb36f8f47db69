"""Qwen3.5/3.6 hybrid MoE through the engine: paged K/V for the attention layers beside
per-sequence DeltaNet state slots. Greedy generation equals transformers (float32 cache) and
the engine's own teacher-forced path (fp8 e4m3 and bf16 caches, float64 check mode); a pool
small enough to force preemption gives the same tokens; the planner's capacity is the byte
model exactly (snapshot slots included); the scheduler's state slots follow the pages;
unsupported settings are refused at construction (prefix caching over state snapshots:
``test_state_snapshots.py``). The in-place DeltaNet decode step (``kernels.deltanet`` on a
Pallas backend): interpret mode's greedy tokens equal the reference backend's with every
state slot NaN-poisoned, the slots no sequence used keep their NaN, and the engine's decode
step, lowered for CUDA, touches each state pool only through the kernels' aliased operand."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.engine import builder
from jfp8kv.kernels import delta_decode
from jfp8kv.kvcache.cache import bytes_per_token
from jfp8kv.kvcache.state_pool import DeltaState, bytes_per_slot, state_config
from jfp8kv.models.loader import load_model
from tests.models.test_parity import GREEDY, assert_llm_matches_transformers, small_llm
from tests.models.test_qwen3_hybrid import hybrid_checkpoint  # noqa: F401 (fixture)
from tests.x64 import x64


def _llm(loaded, **kw):
    return small_llm(loaded, **{"max_num_seqs": 4, **kw})


def test_float32_cache_matches_transformers(hybrid_checkpoint):  # noqa: F811
    llm = _llm(load_model(str(hybrid_checkpoint), "float32"))
    info = llm.cache_info()
    assert info["enable_prefix_caching"] is True and info["snapshot_slots"] == 4 * 4
    assert_llm_matches_transformers(llm, hybrid_checkpoint)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
def test_decode_equals_teacher_forcing_in_float64(hybrid_checkpoint, kv):  # noqa: F811
    """fp8 (token scales) and bf16 caches in the float64 check mode: greedy decode equals
    the argmax of the engine's teacher-forced logits, chunked prefill equals one-shot."""
    with x64():
        loaded = load_model(str(hybrid_checkpoint), "float64")
        cfg = loaded.config  # a float64 state too: no float32 rounding between chunks
        cfg = dataclasses.replace(cfg, hybrid=dataclasses.replace(cfg.hybrid,
                                                                  state_dtype="float64"))
        llm = _llm(dataclasses.replace(loaded, config=cfg), dtype="float64", kv_cache_dtype=kv)
        assert llm.cache_info()["kv_scale_mode"] == ("token" if kv == "fp8_e4m3" else None)
        rng = np.random.default_rng()
        prompts = [rng.integers(3, 320, n).tolist() for n in (5, 23)]
        for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
            full = p + o.token_ids
            one_shot, lg = llm.nll(full, chunk_size=128, return_logits=True)
            np.testing.assert_allclose(llm.nll(full, chunk_size=6), one_shot, rtol=1e-9,
                                       atol=1e-9)
            assert lg[len(p) - 1:].argmax(-1).tolist() == o.token_ids


def test_preemption_recomputes_the_state(hybrid_checkpoint):  # noqa: F811
    loaded = load_model(str(hybrid_checkpoint), "float32")
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 320, n).tolist() for n in (30, 41, 26, 35)]
    want = [o.token_ids for o in _llm(loaded).generate(prompts, GREEDY)]
    # 2 attention layers x 2 KV heads x 32 dims x 4 bytes x (K, V) = 1024 bytes per token;
    # 4 sequences of ~50 tokens need ~13 pages of 16; give the pages 8 (and the state).
    # Greedy admission starts them all (reserve admission would mostly avoid preempting).
    state = 6 * bytes_per_slot(state_config(loaded.config.hybrid, 6))  # max_num_seqs + 2
    small = _llm(loaded, kv_cache_memory=state + 8 * 16 * 1024, max_model_len=64,
                 admission="greedy", enable_prefix_caching=False)
    assert small.cache_info()["num_pages"] == 8
    outs = small.generate(prompts, GREEDY)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("dtype,mode", [("fp8_e4m3", "token"), ("fp8_e4m3", "block"),
                                        ("auto", None)])
def test_capacity_is_the_byte_model(hybrid_checkpoint, dtype, mode):  # noqa: F811
    loaded = load_model(str(hybrid_checkpoint), "float32")
    memory = 300_000
    per_slot = 2 * (3 * (2 * 2 * 16 + 4 * 16) + 4 * 16 * 16) * 4  # conv + recurrent, fp32
    info = _llm(loaded, kv_cache_dtype=dtype, kv_scale_mode=mode, kv_cache_memory=memory,
                state_snapshot_memory=3 * per_slot + per_slot // 2).cache_info()
    cfg = loaded.config
    bpt = bytes_per_token(2, cfg.num_kv_heads, cfg.head_dim, info["storage_dtype"], mode)
    # max_num_seqs sequences, the padding slot, the nll scratch slot, then 3 snapshots
    slots = 4 + 2 + 3
    kv, state = info["pools"]["kv"], info["pools"]["deltanet"]
    assert info["bytes_per_token"] == bpt and state["bytes_per_slot"] == per_slot
    assert state["kind"] == "slot" and state["bytes"] == slots * per_slot
    assert info["snapshot_slots"] == 3 and info["snapshot_bytes"] == 3 * per_slot
    assert info["num_pages"] == (memory - slots * per_slot) // (16 * bpt)
    assert kv["kind"] == "paged" and kv["bytes"] == (info["num_pages"] + 1) * 16 * bpt
    assert info["pool_bytes"] == kv["bytes"] + state["bytes"]
    assert (kv["layers"], state["layers"]) == (2, 2) and info["state_slots"] == 4


def test_refused_settings(hybrid_checkpoint):  # noqa: F811
    loaded = load_model(str(hybrid_checkpoint), "float32")
    with pytest.raises(ValueError, match="kv_scales, or use 'token' or 'block'"):
        _llm(loaded, kv_cache_dtype="fp8_e4m3", kv_scale_mode="tensor")
    with pytest.raises(ValueError, match="'none' or 'hadamard'"):
        _llm(loaded, kv_cache_dtype="fp8_e4m3", kv_rotation="smooth")
    with pytest.raises(ValueError, match="state slots of .* or max_num_seqs"):
        _llm(loaded, kv_cache_memory=10_000)


def test_scheduler_state_slots_follow_the_pages():
    """Random traffic on a tight pool: every running sequence holds one state slot of
    1..max_num_seqs, no two the same, and slots come back with the pages (finish,
    preemption), so the free list and the running slots always partition them."""
    import random

    from tests.engine.test_scheduler import check_pages, run_step, seq
    from jfp8kv.engine.scheduler import Scheduler
    from jfp8kv.kvcache.allocator import PageAllocator

    rnd = random.Random()
    s = Scheduler(PageAllocator(9), 4, 32, 3, 16, 1, enable_prefix_caching=False,
                  state_slots=3, admission="greedy")  # greedy: preemptions
    assert s.scratch_state_slot == 4
    for i in range(10):
        s.add(seq(f"r{i}", rnd.randint(12, 16), max_tokens=8))  # two outgrow the pool
    preempted = 0
    while s.has_work():
        preempted += len(run_step(s).preempted)
        held = [q.state_slot for q in s.running]
        assert all(1 <= x <= 3 for x in held) and len(set(held)) == len(held)
        assert sorted(held + s._free_states) == [1, 2, 3]
        assert all(q.state_slot == 0 for q in s.waiting)
        check_pages(s)
    assert preempted > 0
    with pytest.raises(ValueError, match="state_slots"):
        Scheduler(PageAllocator(12), 4, 32, 3, 16, 1, state_slots=2)


def _llm_on(monkeypatch, loaded, backend, **kw):
    """``_llm`` whose engine runs ``backend``: the builder takes no Pallas backend without a
    GPU ("pallas_interpret" is not a user option), so its choice is replaced. Prefix
    caching is off: its state snapshots copy slots too (``test_state_snapshots.py``), and
    these tests look at what the DeltaNet step alone writes."""
    monkeypatch.setattr(builder, "choose_backend", lambda *a: backend)
    llm = _llm(loaded, **{"enable_prefix_caching": False, **kw})
    assert llm.engine.runner.backend == backend
    return llm


def test_in_place_decode_equals_reference_with_poisoned_slots(hybrid_checkpoint,  # noqa: F811
                                                              monkeypatch):
    """pallas_interpret (the in-place decode kernels in interpret mode) against the reference
    backend (gather -> step -> scatter), float32: the same greedy tokens although every state
    slot (the sink included) starts as NaN, which a fresh sequence must not read; afterwards
    each slot a sequence held is finite and every other slot (the unused one, the scratch
    slot) still NaN: the steps wrote nothing else."""
    loaded = load_model(str(hybrid_checkpoint), "float32")
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 320, n).tolist() for n in (5, 23, 12)]
    want = [o.token_ids for o in _llm(loaded).generate(prompts, GREEDY)]
    traced = []
    for name in ("recurrent_step", "conv_step"):
        fn = getattr(delta_decode, name)
        monkeypatch.setattr(delta_decode, name,
                            lambda *a, _fn=fn, _n=name, **k: (traced.append(_n), _fn(*a, **k))[1])
    llm = _llm_on(monkeypatch, loaded, "pallas_interpret")
    runner = llm.engine.runner
    st = runner.cache["deltanet"]
    nan = [jnp.full_like(x, jnp.nan) for x in (*st.conv, *st.recurrent)]
    n = len(st.conv)
    runner.cache = runner.cache.replace(deltanet=DeltaState(nan[:n], nan[n:], st.config))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert {"recurrent_step", "conv_step"} <= set(traced), "the in-place kernels did not run"
    st = runner.cache["deltanet"]
    for pool in (*st.conv, *st.recurrent):
        per_slot = np.isnan(np.asarray(pool[1:])).reshape(pool.shape[0] - 1, -1)
        assert (per_slot.all(1) | ~per_slot.any(1)).all(), "a slot was partly written"
        assert (~per_slot.any(1)).sum() == len(prompts), "slots written: one per sequence"


def _pool_ops(llm, rows: int = 4, steps: int = 2) -> set[str]:
    """The engine's decode step (``rows`` rows, ``steps`` steps, cache donated) lowered for
    CUDA on this machine: the operations with a DeltaNet state pool among their operands or
    results (a custom call marked "aliased" when it aliases an operand to its output)."""
    from jax.extend.mlir import ir

    runner = llm.engine.runner
    fn, args, kw = runner._warm_call("decode", rows, steps, runner.max_pages_per_seq, True,
                                     runner.cache)
    lowered = fn.trace(*args, **kw).lower(lowering_platforms=("cuda",))
    st = runner.cache["deltanet"]
    pools = {x.shape for x in (*st.conv, *st.recurrent)}
    donated = re.findall(r"tensor<([\dx]+)xf32> \{tf.aliasing_output", lowered.as_text())
    assert {tuple(map(int, d.split("x"))) for d in donated} >= pools  # the cache is donated
    types = {"tensor<" + "x".join(map(str, p)) + "xf32>" for p in pools}
    ops = set()

    def visit(op):
        op = op.operation
        if any(str(v.type) in types for v in (*op.operands, *op.results)):
            aliased = "output_operand_aliases" in op.attributes
            ops.add(op.name + (" aliased" if aliased else ""))
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return ops


def test_decode_step_touches_the_pools_only_in_place(hybrid_checkpoint,  # noqa: F811
                                                     monkeypatch):
    """On the "pallas" backend (lowered for CUDA, no GPU needed), every op on a DeltaNet pool
    is the scan carrying it, the kernels' Triton custom calls with the pool as an aliased
    operand, and the calls and returns around them: no gather, scatter, slice or copy of a
    state. The reference backend's program gathers and scatters (what the check would see).
    The compiled program is checked on a GPU below: Pallas's interpret mode carries an aliased
    operand's input and output as two loop values, so on the CPU its compiled program copies
    each aliased pool once whatever the kernel does."""
    loaded = load_model(str(hybrid_checkpoint), "float32")
    ops = _pool_ops(_llm_on(monkeypatch, loaded, "pallas", max_num_seqs=5))
    assert ops == {"stablehlo.while", "stablehlo.return", "func.call", "func.return",
                   "stablehlo.custom_call aliased"}, ops
    ops = _pool_ops(_llm_on(monkeypatch, loaded, "reference", max_num_seqs=5))
    assert {"stablehlo.gather", "stablehlo.scatter"} <= ops, ops


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_decode_step_copies_no_pool_gpu():
    """The engine's compiled decode step on the GPU (Pallas kernels): no copy of a buffer
    shaped like a state pool."""
    loaded = load_model("random:qwen3.6-tiny", "bfloat16")
    llm = _llm(loaded, dtype="bfloat16", attention_backend="pallas", max_num_seqs=32,
               kv_cache_memory=16 << 20, warmup=False)
    runner = llm.engine.runner
    fn, args, kw = runner._warm_call("decode", 8, 4, runner.max_pages_per_seq, True,
                                     runner.cache)
    text = fn.lower(*args, **kw).compile().as_text()
    st = runner.cache["deltanet"]
    for pool in (*st.conv, *st.recurrent):
        shape = "[" + ",".join(map(str, pool.shape)) + "]"
        copies = [ln for ln in text.splitlines() if " copy(" in ln and shape in ln.split("=")[0]]
        assert not copies, copies
