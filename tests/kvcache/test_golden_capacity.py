"""The planner keeps the golden capacity table (``golden_capacity.py``): pages, slots, bytes
per token and every pool's bytes, for each family x cache dtype x scale mode at fixed budgets.
Pure Python and shapes: nothing is allocated, no engine is built.

One difference is deliberate: the table was recorded when DeepSeek-V4's planner counted the
padding page 0 inside the budget and the other families' did not. One planner now counts it
as the others did, so a V4 row holds one page more at the same budget (its paged pools one
page's bytes more) and ``expected`` says so; every other number is the table's."""

from __future__ import annotations

import json

import jax
import pytest

from tests.kvcache.golden_capacity import GOLDEN, MAX_MODEL_LEN, cases, key, model_config


def capacity_row(preset: str, kv: str, mode: str | None, budget: int, seqs: int) -> dict:
    """One row of the table from today's planner: the family's layout
    (``models.families``), ``plan_cache``, and the pools' bytes as ``Cache.init`` allocates
    them (``jax.eval_shape``: shapes only)."""
    from jfp8kv.kvcache import fp8
    from jfp8kv.kvcache.cache_tree import abstract_cache
    from jfp8kv.kvcache.layout import CacheRequest, plan_cache
    from jfp8kv.models import families

    cfg = model_config(preset)
    layout = families.of(cfg).cache_layout(cfg, CacheRequest(
        fp8.storage_dtype_name(kv, "bfloat16"), mode), "reference")
    page_size = layout.page_size(16)
    try:
        plan = plan_cache(layout, budget, page_size, seqs, MAX_MODEL_LEN)
    except ValueError:
        return {"refused": True}
    cache = abstract_cache(plan)
    assert cache.pool_nbytes() == plan.pool_bytes()  # the byte model is the allocation
    bpt = layout.bytes_per_token(page_size)
    return {"pages": plan.num_pages, "slots": plan.num_slots, "page_size": page_size,
            "bytes_per_token": float(bpt), "pool_bytes": cache.pool_nbytes()}


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def expected(row: dict, family: str, preset: str, kv: str) -> dict:
    """The golden row as today's planner must give it (see the module docstring)."""
    if family != "v4" or row.get("refused"):
        return row
    from jfp8kv.kvcache.layout import CacheRequest
    from jfp8kv.kvcache import fp8
    from jfp8kv.models import families

    cfg = model_config(preset)
    layout = families.of(cfg).cache_layout(cfg, CacheRequest(
        fp8.storage_dtype_name(kv, "bfloat16")), "reference")
    extra = {p.name: p.bytes_per_page(row["page_size"]) for p in layout.paged}
    return dict(row, pages=row["pages"] + 1,
                pool_bytes={k: v + extra.get(k, 0) for k, v in row["pool_bytes"].items()})


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: key(*c[:1], *c[2:]))
def test_planner_keeps_the_golden_capacity(case, golden):
    preset, family, kv, mode, budget, seqs = case
    row = golden[key(preset, kv, mode, budget, seqs)]
    assert capacity_row(preset, kv, mode, budget, seqs) == expected(row, family, preset, kv)
