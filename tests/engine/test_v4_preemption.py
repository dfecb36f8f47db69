"""DeepSeek-V4 through the engine with fp8 e4m3 pools in a pool small enough to preempt
(split from ``test_v4_engine.py`` to keep each file's CPU time short): greedy tokens equal
the reference forward's with fp8 storage, prefix caching on (a preempted sequence may
restore its own state snapshot)."""

from jfp8kv.kvcache import v4_pools
from tests.engine.test_v4_engine import GREEDY, PROMPTS, _llm, loaded, reference_greedy  # noqa: F401


def test_fp8_preemption_recomputes_the_same_tokens(loaded):  # noqa: F811
    """The 3 sequences need 2 + 3 + 2 pages of 16, the pool has 4 (one max_model_len
    sequence; the padding page 0 comes beside the budget): the newest are preempted (pages
    and slot freed) and re-prefilled. 4 state snapshot slots beside them."""
    spec = v4_pools.V4PoolSpec.from_model(loaded.config, "fp8_e4m3", 16)
    llm = _llm(loaded, kv_cache_dtype="fp8_e4m3", state_snapshot_memory=4 * spec.bytes_per_slot(),
               kv_cache_memory=10 * spec.bytes_per_slot() + 4 * spec.bytes_per_page())
    info = llm.cache_info()
    assert info["num_pages"] == 4 and info["kv_scale_mode"] == "block"
    assert info["enable_prefix_caching"] and info["snapshot_slots"] == 4
    outs = llm.generate(PROMPTS, GREEDY)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == reference_greedy("float8_e4m3fn")
    assert llm.engine.scheduler.snapshot_stats().hits > 0  # a readmission restored its state
