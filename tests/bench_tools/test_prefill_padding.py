"""bench.prefill_padding: the real scheduler and prefill grouping, driven without a model."""

from bench import prefill_padding


def test_equal_prompts_fill_every_prefill_slot():
    """Prompts of half the budget: every step prefills two whole prompts in one dispatch of
    exactly the budget's slots, whatever number of decode rows runs beside (they take no
    budget), and every prompt is prefilled once."""
    r = prefill_padding.simulate(prompts=12, input_len=2048, output_len=16, pool_tokens=None,
                                 budget=4096)
    assert r["prefill_tokens"] == 12 * 2048
    assert r["prefill_slots"] == r["prefill_tokens"] and r["prefill_calls"] == 6
    assert r["preemptions"] == 0


def test_capacity_bound_run_recomputes_and_pads_little():
    """A pool that holds three sequences: preemptions re-prefill prompt + generated tokens
    (ragged lengths), each dispatch pads chunks of one bucket only."""
    r = prefill_padding.simulate(prompts=8, input_len=1000, output_len=200, pool_tokens=3 * 1200,
                                 budget=2048)
    assert r["prefill_tokens"] >= 8 * 1000
    assert r["prefill_tokens"] <= r["prefill_slots"] <= 2 * r["prefill_tokens"]
