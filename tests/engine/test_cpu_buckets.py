"""CPU shape policy: page-table width buckets and a warm-up that covers every dispatch."""

import contextlib
import logging

import jax
import numpy as np
import pytest

from jfp8kv import SamplingParams
from jfp8kv.engine.llm import LLM
from jfp8kv.engine.runner import bucket
from jfp8kv.models.loader import load_model


@pytest.fixture(scope="module")
def llama_bf16(tiny_hf_checkpoint):
    return load_model(str(tiny_hf_checkpoint("llama")), "bfloat16")


@contextlib.contextmanager
def backend_compiles():
    """A list that collects the XLA compiles made inside the ``with`` block."""
    from jax._src import monitoring

    compiles = []

    def listen(event, duration, **kw):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        monitoring.unregister_event_duration_listener(listen)


def make(loaded, **kw):
    kw = {"dtype": "bfloat16", "page_size": 8, "kv_cache_memory": 1 << 22,
          "max_num_batched_tokens": 64, "max_num_seqs": 8, **kw}
    return LLM(loaded=loaded, compile_cache=False, **kw)


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_short_sequences_decode_the_same_at_any_max_model_len(llama_bf16, kv):
    rng = np.random.default_rng()
    ps = [rng.integers(3, llama_bf16.config.vocab_size, n).tolist() for n in (5, 30, 70)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    short = make(llama_bf16, kv_cache_dtype=kv, max_model_len=128)
    long = make(llama_bf16, kv_cache_dtype=kv, max_model_len=1024)
    assert short.engine.runner.page_widths == (16,)
    assert long.engine.runner.page_widths == (32, 128)
    for a, b in zip(short.generate(ps, sp), long.generate(ps, sp)):
        assert_same_greedy_up_to_a_tie(a, b)


def assert_same_greedy_up_to_a_tie(a, b, tol=0.1):
    """``a`` and ``b`` (greedy outputs with ``logprobs >= 2``) agree token for token, with
    log-probs within ``tol``, up to their first difference, where both runs must have seen a
    near-tie between the two tokens. A wider page table changes the length of attention's
    reductions, which moves bf16 logits in their last bits; a random tiny model has near-ties
    often enough for that to flip a greedy pick now and then (CI saw it once in ~20 runs;
    ``tol`` is a few bf16 ulps of a logit of magnitude 4-8)."""
    n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
             min(len(a.token_ids), len(b.token_ids)))
    assert len(a.token_ids) == len(b.token_ids)
    for ea, eb in zip(a.logprobs[:n], b.logprobs[:n]):
        assert abs(ea.logprob - eb.logprob) < tol
    if n == len(a.token_ids):
        return
    for e, other in ((a.logprobs[n], b.token_ids[n]), (b.logprobs[n], a.token_ids[n])):
        top = dict(e.top)
        assert other in top, f"step {n}: token {other} is not the runner-up"
        assert e.logprob - top[other] < tol, f"step {n}: not a near-tie"


def batched_prefill(llm):
    """Switch ``llm`` to the GPU's prefill policy (several chunks per dispatch, cut into
    groups within ``prefill_area``) before anything compiles."""
    llm.engine.runner.prefill_one_row = False
    return llm


def test_prefill_groups_stay_within_the_area(llama_bf16):
    """Groups are consecutive, within the area, and pad only chunks of one chunk bucket
    (the scheduler hands chunks over longest first, so a step's short remainder gets its own
    small dispatch instead of a row padded to the longest chunk: docs/lab/engine-notes.md)."""
    runner = batched_prefill(make(llama_bf16, max_model_len=1024)).engine.runner
    area = runner.prefill_area()
    assert area == runner.chunk_bucket(64)
    rng = np.random.default_rng()
    for _ in range(200):
        lengths = rng.integers(1, 65, rng.integers(1, 9)).tolist()
        groups = runner.prefill_groups(lengths)
        assert [i for a, b in groups for i in range(a, b)] == list(range(len(lengths)))
        cb = [runner.chunk_bucket(n) for n in lengths]
        for a, b in groups:
            assert b > a
            assert len(set(cb[a:b])) == 1, "a dispatch pads only chunks of one bucket"
            assert bucket(b - a) * cb[a] <= area
            if b < len(lengths):  # a group ends only where the next chunk would not fit
                assert cb[b] != cb[a] or bucket(b + 1 - a) * cb[a] > area
    shapes = runner.warmup_shapes(8, 64)
    assert {(b, t) for k, b, t, _ in shapes if k == "prefill"} == {
        (b, t) for b in (1, 2, 4, 8) for t in (16, 64) if b * t <= area}


def test_grouped_prefill_gives_one_row_tokens(llama_bf16):
    rng = np.random.default_rng()
    vocab = llama_bf16.config.vocab_size
    ps = [rng.integers(3, vocab, n).tolist() for n in (40, 5, 7, 3, 60, 9, 2, 11)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    one = make(llama_bf16, dtype="float32", max_model_len=256).generate(ps, sp)
    grouped = batched_prefill(make(llama_bf16, dtype="float32", max_model_len=256))
    assert [o.token_ids for o in grouped.generate(ps, sp)] == [o.token_ids for o in one]


@pytest.mark.parametrize("one_row", [True, False])
def test_no_compile_after_warmup(llama_bf16, one_row):
    # Batched prefill with 4 decode steps: both scan lengths (1 beside prefill, 4 alone)
    llm = make(llama_bf16, max_model_len=1024, decode_steps=1 if one_row else 4)
    if not one_row:
        batched_prefill(llm)
    llm.warmup(progress=False)
    with backend_compiles() as compiles:
        rng = np.random.default_rng()
        vocab = llama_bf16.config.vocab_size
        for n_req, plen, max_tokens in [(1, 3, 5), (3, 17, 30), (5, 60, 12), (8, 40, 300),
                                        (2, 200, 20)]:
            ps = [rng.integers(3, vocab, plen + i).tolist() for i in range(n_req)]
            sps = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=1, ignore_eos=True)
                   for t in ([0] * n_req if n_req % 2 else [0.8] * n_req)]
            outs = llm.generate(ps, sps)
            assert all(len(o.token_ids) == max_tokens for o in outs)
    assert compiles == []


def test_precompile_leaves_nothing_for_warmup_to_compile(llama_bf16):
    """``precompile`` compiles shapes on threads without running them; the warm-up after it
    (and the engine) find those executables and compile nothing."""
    llm = batched_prefill(make(llama_bf16, max_model_len=256))
    shapes = llm._shapes()
    assert llm.engine.runner.precompile(shapes, workers=2) == len(shapes)
    with backend_compiles() as compiles:
        llm.engine.runner.warmup(shapes, progress=False)
    assert compiles == []


def test_compile_only_entries_are_what_first_use_loads(llama_bf16, tmp_path):
    """``compile_only`` (persistent-cache entries compiled from the cache's shapes, as the
    builder compiles before the pools exist; nothing run)
    stores executables under the persistent-cache keys the real calls look up: a warm-up in
    a fresh in-memory state then loads each one instead of compiling it."""
    llm = make(llama_bf16, max_model_len=256)
    runner = llm.engine.runner
    shapes = llm._shapes()[:2]
    old = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", True)  # tests/conftest.py turns it off
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    events = []

    def listen(event, **kw):
        events.append(event)

    from jax._src import compilation_cache, monitoring

    try:
        compilation_cache.reset_cache()
        jax.clear_caches()  # executables earlier tests compiled in memory would not be stored
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), runner.cache)
        assert runner.compile_only(shapes, spec) == len(shapes)
        jax.clear_caches()  # what a later first use in this process would not have in memory
        monitoring.register_event_listener(listen)
        runner.warmup(shapes, progress=False)
    finally:
        monitoring.unregister_event_listener(listen)
        jax.config.update("jax_compilation_cache_dir", old[0])
        jax.config.update("jax_enable_compilation_cache", old[1])
        compilation_cache.reset_cache()
    assert events.count("/jax/compilation_cache/cache_hits") >= len(shapes)


def test_warmup_at_construction_leaves_nothing_to_compile(llama_bf16):
    """``LLM(warmup=True)`` (the default on a GPU) compiles every shape before it returns:
    generate then compiles nothing, whatever the batch and prompt lengths."""
    llm = make(llama_bf16, max_model_len=256, warmup=True)
    rng = np.random.default_rng()
    vocab = llama_bf16.config.vocab_size
    with backend_compiles() as compiles:
        for n_req, plen in [(1, 3), (3, 20), (8, 90)]:
            ps = [rng.integers(3, vocab, plen + i).tolist() for i in range(n_req)]
            outs = llm.generate(ps, SamplingParams(max_tokens=20, temperature=0,
                                                   ignore_eos=True))
            assert all(len(o.token_ids) == 20 for o in outs)
    assert compiles == []


def test_default_warmup_runs_on_a_gpu_and_not_on_a_cpu(llama_bf16, monkeypatch, caplog):
    """``warmup=None`` warms up when the runner is on a GPU (faked here: the flag the runner
    sets from its weights' devices); on a CPU it does not, and one INFO line says that shapes
    compile on first use. ``warmup=False`` (the server, which warms up per ``--warmup``)
    says nothing."""
    from jfp8kv.engine import runner as runner_module

    calls = []
    monkeypatch.setattr(LLM, "warmup", lambda self, *a, **kw: calls.append((a, kw)))
    with caplog.at_level(logging.INFO, logger="jfp8kv.engine.llm"):
        make(llama_bf16, max_model_len=128)
    assert calls == []
    assert [r.getMessage() for r in caplog.records if "compile on first use" in
            r.getMessage()] != []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jfp8kv.engine.llm"):
        make(llama_bf16, max_model_len=128, warmup=False)
    assert calls == [] and not [r for r in caplog.records if "first use" in r.getMessage()]

    init = runner_module.ModelRunner.__init__

    def on_a_gpu(self, *a, **kw):
        init(self, *a, **kw)
        self.on_cpu = False

    monkeypatch.setattr(runner_module.ModelRunner, "__init__", on_a_gpu)
    make(llama_bf16, max_model_len=128)
    assert calls == [((), {})]  # LLM.warmup() with its defaults: progress bar on
    make(llama_bf16, max_model_len=128, warmup=False)
    assert len(calls) == 1
