"""The planner under tensor parallelism, against the golden capacity table
(``golden_capacity.py``): a layout's byte model is per device, so

* a layout split evenly over N devices (dense and hybrid K/V heads, DeltaNet heads, every
  count divisible by N) holds at a budget of B / N per device what one device holds at B:
  the golden row's pages and slots, each pool's bytes divided by N;
* a replicated layout (the MLA latent, DeepSeek-V4's pools) holds the golden row itself at
  the same budget per device: every device keeps a whole copy;
* replicated heads (KV heads, or DeltaNet q/k heads, that N does not divide: stored
  lcm(G, N) times) cost what the closed form below says, written from the model's shapes.

Shapes only, one process, no devices: the layouts are declared for N devices
(``CacheRequest.devices``); ``tests/engine/test_tp_families.py`` allocates them on a mesh and
checks each device's arrays hold exactly these bytes."""

from __future__ import annotations

import json
import math

import pytest

from tests.kvcache.golden_capacity import BUDGETS, GOLDEN, MAX_MODEL_LEN, cases, key, model_config
from tests.kvcache.test_golden_capacity import expected

SIZES = (2, 4)


def layout_for(preset: str, kv: str, mode, devices: int):
    """``preset``'s cache layout over ``devices`` (KV heads stored lcm(G, N) times, as
    ``builder.cache_layout`` asks under ``models.sharding.plan``)."""
    from jfp8kv.kvcache import fp8
    from jfp8kv.kvcache.layout import CacheRequest
    from jfp8kv.models import families

    cfg = model_config(preset)
    req = CacheRequest(fp8.storage_dtype_name(kv, "bfloat16"), mode, devices=devices,
                       kv_heads=math.lcm(cfg.num_kv_heads, devices))
    return cfg, families.of(cfg).cache_layout(cfg, req, "reference")


def tp_row(preset: str, kv: str, mode, budget: int, seqs: int, devices: int) -> dict:
    """A golden-table row from the planner over ``devices`` (per-device numbers)."""
    from jfp8kv.kvcache.layout import plan_cache

    _, layout = layout_for(preset, kv, mode, devices)
    page_size = layout.page_size(16)
    try:
        plan = plan_cache(layout, budget, page_size, seqs, MAX_MODEL_LEN)
    except ValueError:
        return {"refused": True}
    return {"pages": plan.num_pages, "slots": plan.num_slots, "page_size": page_size,
            "bytes_per_token": float(layout.bytes_per_token(page_size)),
            "pool_bytes": plan.pool_bytes()}


def divides(preset: str, n: int) -> bool:
    """Whether every count the layout splits divides by ``n`` (no replicated heads)."""
    cfg = model_config(preset)
    counts = [cfg.num_kv_heads]
    if cfg.hybrid is not None:
        counts += [cfg.hybrid.linear_num_key_heads, cfg.hybrid.linear_num_value_heads]
    return all(c % n == 0 for c in counts)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


SPLIT = [(c, n) for c in cases() if c[1] in ("dense", "hybrid") for n in SIZES
         if divides(c[0], n)]
REPLICATED = [(c, n) for c in cases() if c[1] in ("mla", "v4") for n in SIZES]


@pytest.mark.parametrize("case, n", SPLIT, ids=lambda x: str(x) if isinstance(x, int)
                         else key(*x[:1], *x[2:]))
def test_split_layouts_hold_the_golden_row_at_a_share_of_the_budget(case, n, golden):
    preset, _, kv, mode, budget, seqs = case
    row = golden[key(preset, kv, mode, budget, seqs)]
    got = tp_row(preset, kv, mode, budget // n, seqs, n)
    if row.get("refused"):
        assert got == row
        return
    assert got["pool_bytes"] == {k: v // n for k, v in row["pool_bytes"].items()}
    assert all(v % n == 0 for v in row["pool_bytes"].values())
    assert (got["pages"], got["slots"], got["page_size"]) == (
        row["pages"], row["slots"], row["page_size"])
    assert got["bytes_per_token"] * n == row["bytes_per_token"]


@pytest.mark.parametrize("case, n", REPLICATED, ids=lambda x: str(x) if isinstance(x, int)
                         else key(*x[:1], *x[2:]))
def test_replicated_layouts_hold_the_golden_row_on_every_device(case, n, golden):
    preset, family, kv, mode, budget, seqs = case
    row = expected(golden[key(preset, kv, mode, budget, seqs)], family, preset, kv)
    assert tp_row(preset, kv, mode, budget, seqs, n) == row


def closed_form(preset: str, kv: str, mode, n: int, page_size: int) -> tuple[int, int, int]:
    """(K/V bytes per page, DeltaNet bytes per slot, static bytes) on one device of ``n``,
    from the model's shapes: KV heads stored lcm(G, n) times, lcm(G, n) / n per device;
    DeltaNet q/k heads stored lcm(Hk, n) times, value heads Hv / n per device."""
    import jax.numpy as jnp

    from jfp8kv.kvcache import fp8, scale_modes

    cfg = model_config(preset)
    storage = fp8.storage_dtype_name(kv, "bfloat16")
    scales = scale_modes.get(mode, storage)
    heads = math.lcm(cfg.num_kv_heads, n) // n
    hd, item = cfg.head_dim, jnp.dtype(storage).itemsize
    per_head = hd * item + scales.scale_bytes_per_token_head(hd, 32)
    hy = cfg.hybrid
    layers = len(hy.attention_layers) if hy else cfg.num_layers
    kv_page = 2 * layers * heads * per_head * page_size
    static = scales.static_bytes(layers, heads, hd)
    if hy is None:
        return kv_page, 0, static
    dk, dv, hv = hy.linear_key_head_dim, hy.linear_value_head_dim, hy.linear_num_value_heads
    conv = (hy.linear_conv_kernel_dim - 1) * (
        2 * (math.lcm(hy.linear_num_key_heads, n) // n) * dk + hv // n * dv)
    state = len(hy.linear_layers) * (conv + hv // n * dk * dv)
    return kv_page, state * jnp.dtype(hy.state_dtype).itemsize, static


REPLICATED_HEADS = [("smollm2-135m", 2), ("smollm2-135m", 4), ("qwen3-moe-tiny", 4),
                    ("qwen3.6-35b-a3b", 4), ("qwen3.6-tiny", 4)]


@pytest.mark.parametrize("preset, n", REPLICATED_HEADS)
@pytest.mark.parametrize("kv, mode", [("auto", None), ("fp8_e4m3", "token"),
                                      ("fp8_e4m3", "channel")])
def test_replicated_heads_cost_the_closed_form(preset, n, kv, mode):
    """Heads N does not divide: the per-device pages and slots at every golden budget are
    what the model's shapes give by hand."""
    kv_page, slot, static = closed_form(preset, kv, mode, n, 16)
    _, layout = layout_for(preset, kv, mode, n)
    assert layout.bytes_per_page(16) == kv_page and layout.bytes_per_slot() == slot
    assert layout.fixed_bytes() == static
    for budget in BUDGETS:
        row = tp_row(preset, kv, mode, budget, 8, n)
        slots = 10 if slot else 0
        pages = (budget - slots * slot - layout.fixed_bytes()) // kv_page
        if pages * 16 < MAX_MODEL_LEN:
            assert row == {"refused": True}
            continue
        assert (row["pages"], row["slots"]) == (pages + 1, slots)
        want = {"kv": (pages + 1) * kv_page + layout.fixed_bytes()}
        if slot:
            want["deltanet"] = slots * slot
        assert row["pool_bytes"] == want
