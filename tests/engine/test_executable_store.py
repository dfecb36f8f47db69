"""``compile_cache.ExecutableStore``: a warm start loads the step executables a cold start
compiled, without tracing, lowering or compiling (issue 38), and dispatches through them
with the same tokens and no compile afterwards; only freshly compiled executables are
stored (XLA:CPU re-serializes a deserialized one without some kernels)."""

import contextlib

import jax
import pytest

from jfp8kv import SamplingParams
from jfp8kv.engine import compile_cache, runner as runner_mod
from jfp8kv.engine.compile_cache import ExecutableStore

from test_cpu_buckets import backend_compiles, batched_prefill, llama_bf16, make  # noqa: F401


@contextlib.contextmanager
def persistent_cache(path):
    """JAX's persistent cache on in ``path`` (tests/conftest.py turns it off), starting from
    empty in-memory caches so the first compile of each step is a real one."""
    from jax._src import compilation_cache

    old = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()
    jax.clear_caches()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", old[0])
        jax.config.update("jax_enable_compilation_cache", old[1])
        compilation_cache.reset_cache()
        jax.clear_caches()


def generate(llm):
    prompts = [[3 + i for i in range(n)] for n in (5, 40, 17)]
    sps = [SamplingParams(max_tokens=12, temperature=t, seed=3, ignore_eos=True)
           for t in (0, 0.8, 0)]
    return [o.token_ids for o in llm.generate(prompts, sps)]


def test_warm_start_loads_without_tracing(llama_bf16, tmp_path, monkeypatch):  # noqa: F811
    store = ExecutableStore(tmp_path / "executables")
    with persistent_cache(tmp_path / "jax"):
        cold = batched_prefill(make(llama_bf16, max_model_len=256))
        cold.engine.runner.store = store  # make() turns the compile cache off
        shapes = cold._shapes()
        cold.warmup(progress=False)
        entries = sorted(p.name for p in store.path.iterdir())
        assert len(entries) == len(shapes)  # one sampler mode per shape on the CPU
        expected = generate(cold)

        jax.clear_caches()  # a new process: nothing in memory
        traced = []
        real = runner_mod.compile_fresh
        monkeypatch.setattr(runner_mod, "compile_fresh",
                            lambda lowered: traced.append(lowered) or real(lowered))
        warm = batched_prefill(make(llama_bf16, max_model_len=256))
        warm.engine.runner.store = store
        with backend_compiles() as compiles:
            assert warm.engine.runner.precompile(shapes, workers=2, store=store) == len(shapes)
        assert traced == [] and compiles == []  # every step loaded, none traced
        warm.warmup(progress=False)  # the overlap helpers (the steps load again, untraced)
        assert traced == []
        with backend_compiles() as compiles:
            assert generate(warm) == expected
        assert compiles == []
        assert sorted(p.name for p in store.path.iterdir()) == entries


def test_executables_from_jax_cache_are_not_stored(llama_bf16, tmp_path):  # noqa: F811
    """A step that JAX's persistent cache (or memory) served is used, not stored."""
    store = ExecutableStore(tmp_path / "executables")
    with persistent_cache(tmp_path / "jax"):
        llm = make(llama_bf16, max_model_len=256)
        shapes = llm._shapes()[:2]
        llm.engine.runner.precompile(shapes, workers=1)  # fills JAX's cache only
        jax.clear_caches()
        llm = make(llama_bf16, max_model_len=256)
        assert llm.engine.runner.precompile(shapes, workers=1, store=store) == 2
        assert not store.path.exists() or not any(store.path.iterdir())


def test_key_covers_shapes_statics_and_environment(llama_bf16, tmp_path, monkeypatch):  # noqa: F811
    store = ExecutableStore(tmp_path)
    runner = make(llama_bf16, max_model_len=256).engine.runner
    fn, args, kw = runner._warm_call("decode", 1, 1, 32, None, runner.cache)
    static = {k: v for k, v in kw.items() if k in runner_mod._STATIC}
    key = store.key("decode", args, static)
    assert store.key("decode", args, static) == key
    assert store.key("prefill", args, static) != key
    assert store.key("decode", args, {**static, "num_steps": 2}) != key
    _, wider, _ = runner._warm_call("decode", 2, 1, 32, None, runner.cache)
    assert store.key("decode", wider, static) != key
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    compile_cache.fingerprint.cache_clear()
    try:
        assert store.key("decode", args, static) != key
    finally:
        monkeypatch.undo()
        compile_cache.fingerprint.cache_clear()
    assert store.key("decode", args, static) == key
    # where things are cached or reported is not part of the program
    for name in ("JFP8KV_CACHE", "JFP8KV_STARTUP_PROFILE"):
        monkeypatch.setenv(name, str(tmp_path / "elsewhere"))
        compile_cache.fingerprint.cache_clear()
        try:
            assert store.key("decode", args, static) == key, name
        finally:
            monkeypatch.undo()
            compile_cache.fingerprint.cache_clear()
    assert store.load("0" * 64) is None
    (tmp_path / ("1" * 64)).write_bytes(b"not a pickle")
    assert store.load("1" * 64) is None  # a bad entry is a miss


def test_executables_compiled_to_size_the_pools_are_kept_for_the_next_start(
        llama_bf16, tmp_path):  # noqa: F811
    """The memory plan's verification compiles the largest shapes against the pools' shapes
    (before they exist) and registers them for dispatch: they go to the store too, so a
    next start that keeps the plan loads them instead of tracing them (an H100 warm start
    of the 8B shape traced 9 of its 74 executables again, the sizing's among them); an
    unregistered compile (a probe at a two-page pool, never dispatched) is not stored."""
    import dataclasses

    from jfp8kv.kvcache.cache_tree import abstract_cache

    store = ExecutableStore(tmp_path / "executables")
    prompt = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with persistent_cache(tmp_path / "jax"):
        runner = make(llama_bf16, max_model_len=256).engine.runner
        runner.store = store  # as make_runner sets it with the compile cache on
        abstract = abstract_cache(runner.cache.plan)
        shape = ("prefill", 1, 64, runner.max_pages_per_seq)
        variants = runner.variants.of("prefill")
        probe = abstract_cache(dataclasses.replace(runner.cache.plan, num_pages=2))
        for greedy, switched in variants:
            runner.compile_variant(shape, greedy, switched, probe)
        assert not store.path.exists()
        for greedy, switched in variants:
            runner.compile_variant(shape, greedy, switched, abstract, register=True)
        assert len(list(store.path.iterdir())) == len(variants)

        jax.clear_caches()  # a new process
        llm = make(llama_bf16, max_model_len=256)
        warm = llm.engine.runner
        assert warm.precompile([shape], workers=1, store=store) == 1
        assert warm.stored_loads == len(variants)  # lowered from the live pools: same key
        # the loaded executable serves a 40-token prompt's one-row prefill
        served = llm.generate([list(range(3, 43))], prompt)[0].token_ids
    jax.clear_caches()
    assert served == make(llama_bf16, max_model_len=256).generate(
        [list(range(3, 43))], prompt)[0].token_ids
