"""The memory plan (``engine/memory.py``, ``engine/capacity.py``) without a device: a fake
GPU's allocator limit, a fake runner whose executables' peak is a known function of their
shapes, real layouts of tiny presets. Pools = capacity - weights - measured peak - margin;
defaults left unset adapt (prefill tokens, sequences, max_model_len); values set are kept or
refused naming what fits; a probe measured once is not measured again."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from jfp8kv.config import EngineConfig, ModelConfig
from jfp8kv.engine import capacity, memory
from jfp8kv.engine.device_policy import device_defaults
from jfp8kv.kvcache.layout import EXTRA_SLOTS, CacheRequest, plan_cache
from jfp8kv.models import families
from jfp8kv.models.presets import PRESETS

GiB = 1 << 30


class FakeGPU:
    platform = "gpu"

    def __init__(self, limit: int, in_use: int):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


DECODE_PEAK = 1 << 20


class FakeRunner:
    """The runner's surface the sizing compiles through: ``warmup_shapes`` (one decode and
    one prefill shape), ``variants`` (one per kind), ``compile_variant`` (an executable whose
    memory analysis gives a prefill shape ``per_token`` bytes per token, a decode shape
    ``DECODE_PEAK``, each plus ``per_pool_page`` per page of the pool it is compiled against:
    0, temporaries that do not grow with the pool). ``log``: (shape as "decode" /
    "prefill<tokens>", pool pages, registered) per compile."""

    tp = None

    def __init__(self, plan, engine, log, per_token, per_pool_page, floor=0):
        self.plan, self.engine, self.log = plan, engine, log
        self.per_token, self.per_pool_page, self.floor = per_token, per_pool_page, floor
        self.variants = SimpleNamespace(of=lambda kind: ((None, True),))

    def warmup_shapes(self, seqs, tokens, steps):
        return [("decode", seqs, steps[0], 8), ("prefill", 1, tokens, 8)]

    def compile_variant(self, shape, greedy, switched, abstract, store=None, register=False):
        kind, _, t, _ = shape
        self.log.append(("decode" if kind == "decode" else f"prefill{t}",
                         self.plan.num_pages, register))
        peak = (self.floor + t * self.per_token if kind == "prefill" else DECODE_PEAK) \
            + self.plan.num_pages * self.per_pool_page
        analysis = SimpleNamespace(temp_size_in_bytes=peak, generated_code_size_in_bytes=0,
                                   output_size_in_bytes=0, alias_size_in_bytes=0)
        return SimpleNamespace(memory_analysis=lambda: analysis)


def _sizer(preset="qwen3-tiny", *, limit=40 * GiB, in_use=10 * GiB, per_token=1 << 20,
           per_pool_page=0, memo_dir=None, storage="float8_e4m3fn", floor=0, **asked):
    cfg = ModelConfig(**PRESETS[preset], name=preset)
    family = families.of(cfg)
    layout = family.cache_layout(cfg, CacheRequest(storage), "reference")
    asked = EngineConfig(**asked)
    dev = FakeGPU(limit, in_use)
    engine = device_defaults(asked, dev)
    log = []
    dm = memory.device_memory(dev, engine.gpu_memory_utilization, in_use)
    sizer = capacity.Sizer(cfg, layout, engine, asked, dm,
                           lambda plan, e: FakeRunner(plan, e, log, per_token, per_pool_page,
                                                      floor),
                           memory.PeakMemo(memo_dir), family_default=family.default_max_model_len)
    return sizer, log, layout


@pytest.fixture(autouse=True)
def _jax_fraction(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    monkeypatch.setattr(memory, "MAX_COMPILE_THREADS", 1)  # the compiles' order, logged


def test_capacity_is_the_utilization_of_the_device():
    dm = memory.device_memory(FakeGPU(90 * GiB, 5 * GiB), 0.9, 1)
    assert dm.capacity == 90 * GiB and dm.in_use == 5 * GiB  # limit = 0.9 x 100 GiB
    dm = memory.device_memory(FakeGPU(90 * GiB, 5 * GiB), 0.5, 1)
    assert dm.capacity == 50 * GiB
    assert dm.margin == max(memory.MIN_MARGIN, int(memory.MARGIN_FRACTION * dm.capacity))
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        memory.device_memory(FakeGPU(1, 0), 1.5, 0)


def test_default_pool_is_what_the_measured_peak_leaves():
    sizer, log, layout = _sizer(max_model_len=4096)
    sizing, runner = sizer.size()
    dm = sizer.dm
    peak = 8192 * (1 << 20)  # the GPU default of 8,192 prefill tokens
    assert sizing.memory.peak == peak and sizing.memory.source == "measured"
    assert sizing.memory.pool_budget == dm.capacity - dm.in_use - peak - dm.margin
    want = plan_cache(layout, sizing.memory.pool_budget, 16, 64, 4096)
    assert sizing.plan == want and sizing.engine.kv_cache_memory == sizing.memory.pool_budget
    # the probe (a two-page pool, shape by shape), then the executables at the planned
    # pool, registered for the warm-up
    assert log == [("decode", 2, False), ("prefill8192", 2, False),
                   ("decode", want.num_pages, True), ("prefill8192", want.num_pages, True)]
    assert runner.plan == want


def test_the_prefill_budget_halves_while_its_temporaries_crowd_the_memory():
    # 24 GiB left after the weights: 8,192 tokens x 4 MiB = 32 GiB > a third; 2,048 tokens
    # (8 GiB) is the first that fits under 8 GiB: predicted from the first probe, confirmed
    # by a second (the decode shape, unchanged, is not compiled again)
    sizer, log, _ = _sizer(per_token=4 << 20, limit=34 * GiB, max_model_len=4096)
    sizing, _ = sizer.size()
    assert sizing.engine.max_num_batched_tokens == 2048
    assert [name for name, _, registered in log if not registered] == [
        "decode", "prefill8192", "prefill2048"]
    kept, _, _ = _sizer(per_token=4 << 20, limit=80 * GiB, max_model_len=4096,
                        max_num_batched_tokens=8192)
    assert kept.size()[0].engine.max_num_batched_tokens == 8192  # the user's value stays
    tight, _, _ = _sizer(per_token=4 << 20, limit=34 * GiB, max_model_len=4096,
                         max_num_batched_tokens=8192)
    with pytest.raises(ValueError, match="nothing is left.*lower --max-num-batched-tokens"):
        tight.size()


def test_halving_stops_where_the_temporaries_do_not_follow_the_tokens():
    """A prefill whose temporaries are mostly a floor (12 GiB + 1 MiB per token, 20 GiB at
    8,192, above a third of the 50 GiB after the weights): halving to the predicted 4,096
    measures 16 GiB, less than a quarter off, so 8,192 stays."""
    sizer, log, _ = _sizer(floor=12 * GiB, limit=60 * GiB, max_model_len=4096)
    sizing, _ = sizer.size()
    assert sizing.engine.max_num_batched_tokens == 8192
    assert [name for name, _, registered in log if not registered] == [
        "decode", "prefill8192", "prefill4096"]


def test_slot_families_run_fewer_sequences_when_their_state_would_crowd_the_pool():
    sizer, _, layout = _sizer("qwen3.6-tiny", per_token=1, max_model_len=4096)
    per_slot = layout.bytes_per_slot()  # pools of 205 slots' bytes: 64 + 2 take > a quarter
    sizer.dm = dataclasses.replace(sizer.dm, capacity=sizer.dm.in_use + memory.MIN_MARGIN
                                   + DECODE_PEAK + 205 * per_slot)
    assert sizer.dm.margin == memory.MIN_MARGIN
    sizing, _ = sizer.size()
    seqs = sizing.engine.max_num_seqs
    free = sizing.memory.pool_budget
    assert seqs < 64 and (seqs + EXTRA_SLOTS) * per_slot <= free / 4
    assert (2 * seqs + EXTRA_SLOTS) * per_slot > free / 4  # halved no further than needed
    assert sizing.plan.sequence_slots == seqs


def test_context_follows_the_pool_unless_set():
    limit = 11 * GiB + (5 << 20)  # 5 MiB of pools: ~18k fp8 tokens of qwen3-tiny
    sizer, _, layout = _sizer(limit=limit, per_token=1)
    sizing, _ = sizer.size()  # qwen3-tiny's context is 40,960 tokens
    assert 16 <= sizing.engine.max_model_len < 40960
    assert sizing.engine.max_model_len == sizing.plan.max_tokens
    too_long, _, _ = _sizer(limit=limit, per_token=1, max_model_len=40960)
    with pytest.raises(ValueError, match="max_model_len=40960.*give at least"):
        too_long.size()
    with pytest.raises(ValueError, match="longer than the model's context.*at most 40960"):
        _sizer(max_model_len=50000)[0].size()


def test_kv_cache_memory_is_kept_or_refused_naming_what_fits():
    sizer, log, layout = _sizer(kv_cache_memory=2 * GiB, max_model_len=4096)
    sizing, _ = sizer.size()
    assert sizing.memory.pool_budget == 2 * GiB and sizing.memory.source == "kv_cache_memory"
    assert sizing.plan == plan_cache(layout, 2 * GiB, 16, 64, 4096)
    # measured at the pool itself, nothing probed
    pages = sizing.plan.num_pages
    assert log == [("decode", pages, True), ("prefill8192", pages, True)]
    big, _, _ = _sizer(kv_cache_memory=30 * GiB, max_model_len=4096)
    with pytest.raises(ValueError, match=r"kv_cache_memory=32212254720 bytes does not fit.*"
                                         r"at most \d+ bytes fit"):
        big.size()


def test_temporaries_that_grow_with_the_pool_are_measured_at_the_pool():
    sizer, log, layout = _sizer(per_token=1, per_pool_page=1 << 12, max_model_len=4096)
    sizing, _ = sizer.size()
    pages = sizing.plan.num_pages
    assert sizing.memory.peak == DECODE_PEAK + pages * (1 << 12)  # at the final pool
    # pools and their temporaries fit together, with less than a page's worth to spare
    spare = sizer.dm.free_for(0) - sizing.memory.pool_budget - sizing.memory.peak
    assert 0 <= spare <= layout.bytes_per_page(16) + (1 << 12) + DECODE_PEAK
    # the probe, then two verifications: at the first plan and after re-planning
    assert [registered for _, _, registered in log] == [False, False] + [True] * 6
    # (verified at the first plan, at the plan the measured peak leaves, then at the pools
    # that the per-page growth from those two measurements leaves)


def test_a_wider_verification_re_plans_once():
    """The verification measures more than the probe (the widest prefill, every variant: a
    constant 2 GiB here): the pools are planned once more from that peak, which holds."""
    sizer, log, _ = _sizer(per_token=1, max_model_len=4096)
    widest = FakeRunner.compile_variant

    def wider(self, shape, *a, register=False, **kw):
        out = widest(self, shape, *a, register=register, **kw)
        extra = 2 * GiB if register else 0
        m = vars(out.memory_analysis())
        grown = SimpleNamespace(**{**m, "temp_size_in_bytes": m["temp_size_in_bytes"] + extra})
        return SimpleNamespace(memory_analysis=lambda: grown)

    FakeRunner.compile_variant = wider
    try:
        sizing, _ = sizer.size()
    finally:
        FakeRunner.compile_variant = widest
    # held: the measured peak and the cushion for compile-to-compile variation
    assert sizing.memory.peak == int((DECODE_PEAK + 2 * GiB) * (1 + capacity.REPLAN_CUSHION))
    assert sizing.memory.pool_budget == sizer.dm.free_for(sizing.memory.peak)
    assert [registered for _, _, registered in log] == [False, False] + [True] * 4


def test_a_measured_probe_is_kept(tmp_path):
    first, log1, _ = _sizer(max_model_len=4096, memo_dir=tmp_path)
    first.size()
    again, log2, _ = _sizer(max_model_len=4096, memo_dir=tmp_path)
    sizing, _ = again.size()
    assert [e for e in log1 if not e[2]] and not [e for e in log2 if not e[2]]  # no probe
    assert sizing.memory.peak == 8192 * (1 << 20)  # the prefill's, remembered


def test_cpu_default_is_the_bounded_formula_and_compiles_nothing():
    cfg = ModelConfig(**PRESETS["qwen3-tiny"], name="qwen3-tiny")
    layout = families.DENSE.cache_layout(cfg, CacheRequest("bfloat16"), "reference")

    class CPU:
        platform = "cpu"

    asked = EngineConfig(max_model_len=512)
    engine = device_defaults(asked, CPU())
    dm = memory.device_memory(CPU(), 0.9, 1 << 20)
    sizer = capacity.Sizer(cfg, layout, engine, asked, dm,
                           lambda *a: pytest.fail("no compile for the CPU default"),
                           memory.PeakMemo(None))
    sizing, runner = sizer.size()
    assert runner is None and sizing.memory.source == "cpu default"
    budget = capacity.cpu_default_budget(layout, 16, 512, engine.max_num_seqs)
    assert budget == 512 * 512 * 16  # bf16 K and V, 2 layers x 2 heads x 32: 16 sequences
    assert sizing.plan == plan_cache(layout, budget, 16, engine.max_num_seqs, 512)


def test_an_unset_context_follows_a_given_pool_on_the_cpu():
    """``kv_cache_memory`` given, ``max_model_len`` left unset: the context is what the pages
    hold (a warning says so), not the model's 40,960 tokens refused."""
    cfg = ModelConfig(**PRESETS["qwen3-tiny"], name="qwen3-tiny")
    layout = families.DENSE.cache_layout(cfg, CacheRequest("bfloat16"), "reference")

    class CPU:
        platform = "cpu"

    asked = EngineConfig(kv_cache_memory=512 * 1000)  # 1,000 bf16 tokens of 512 bytes
    engine = device_defaults(asked, CPU())
    sizer = capacity.Sizer(cfg, layout, engine, asked, memory.device_memory(CPU(), 0.9, 1),
                           lambda *a: pytest.fail("no compile"), memory.PeakMemo(None))
    sizing, _ = sizer.size()
    assert sizing.engine.max_model_len == sizing.plan.max_tokens == 62 * 16
    with pytest.raises(ValueError, match="max_model_len=4096.*give at least"):
        capacity.Sizer(cfg, layout, dataclasses.replace(engine, max_model_len=4096),
                       dataclasses.replace(asked, max_model_len=4096),
                       sizer.dm, None, memory.PeakMemo(None)).size()


def test_default_snapshots_never_crowd_out_one_sequence():
    """The default snapshot memory (4 per sequence, at most a fifth of the pools) shrinks,
    to none at all, rather than leave less than one max_model_len sequence of pages."""
    from jfp8kv.models.v4_presets import v4_config

    cfg = v4_config("deepseek-v4-tiny")
    layout = families.V4.cache_layout(cfg, CacheRequest("bfloat16"), "reference")
    e = EngineConfig(max_model_len=64, max_num_seqs=64, page_size=16)
    slots = (64 + EXTRA_SLOTS) * layout.bytes_per_slot()
    one = 4 * layout.bytes_per_page(16)  # 64 tokens of pages
    for spare in (0, layout.bytes_per_slot() // 2, 3 * layout.bytes_per_slot()):
        budget = slots + one + spare
        snaps = capacity.snapshot_memory(e, layout, budget)
        assert snaps <= spare
        plan = plan_cache(layout, budget, 16, 64, 64, snaps)  # one sequence still fits
        assert plan.max_tokens >= 64
    assert capacity.snapshot_memory(e, layout, 10 ** 12) == 4 * 64 * layout.bytes_per_slot()


def _varying_verifications(sizer, extras):
    """``sizer.size()`` with each registered (verification) compile's peak raised by the
    next of ``extras``."""
    widest = FakeRunner.compile_variant
    extra = iter(extras)

    def varying(self, shape, *a, register=False, **kw):
        out = widest(self, shape, *a, register=register, **kw)
        m = vars(out.memory_analysis())
        add = next(extra) if register else 0
        grown = SimpleNamespace(**{**m, "temp_size_in_bytes": m["temp_size_in_bytes"] + add})
        return SimpleNamespace(memory_analysis=lambda: grown)

    FakeRunner.compile_variant = varying
    try:
        return sizer.size()
    finally:
        FakeRunner.compile_variant = widest


def test_a_re_plan_within_the_cushion_holds_after_one_more_verification():
    """The H100 numbers: 1.63 GiB at the first plan, 1.79 GiB (+10%) at the re-planned
    pool: the re-plan held 10% above the first measurement, so it holds."""
    sizer, log, _ = _sizer(per_token=1, max_model_len=4096)
    first, second = int(1.63 * GiB), int(1.79 * GiB)
    sizing, _ = _varying_verifications(sizer, [first, first, second, second])
    held = int((DECODE_PEAK + first) * (1 + capacity.REPLAN_CUSHION))
    assert held >= DECODE_PEAK + second and sizing.memory.peak == held
    assert sizing.memory.pool_budget == sizer.dm.free_for(held)
    assert [registered for _, _, registered in log] == [False, False] + [True] * 4


def test_temporaries_that_differ_between_compiles_are_planned_from_the_largest():
    """More at the re-planned (smaller) pool than the cushion held (an H100 start of the 35B
    hybrid measured 1.63 then 1.75 GiB: no growth with the pool, the compiler's choices
    differ per program): the pools come from the largest peak measured, verified again; the
    start-up is not refused (the slope of two such points was negative, and the
    extrapolation from it left more pools than memory)."""
    sizer, log, _ = _sizer(per_token=1, max_model_len=4096)
    sizing, _ = _varying_verifications(sizer, [1 * GiB, 1 * GiB, 1 * GiB + GiB // 3,
                                               1 * GiB + GiB // 3, 1 * GiB + GiB // 4,
                                               1 * GiB + GiB // 4])
    top = DECODE_PEAK + GiB + GiB // 3  # the largest measured (the second verification,
    # beyond the first's cushion)
    assert sizing.memory.pool_budget == sizer.dm.free_for(top)
    assert sizing.memory.peak == top
    assert sizing.memory.pool_budget + sizing.memory.peak <= sizer.dm.free_for(0)
    assert [registered for _, _, registered in log] == [False, False] + [True] * 6


def test_a_second_start_keeps_the_plan_and_compiles_nothing_to_size(tmp_path):
    """The same flags on the same card: the pools an earlier start measured are planned again
    page for page (so every executable is the cached one) without a compile; weights a few
    MB heavier borrow from the margin; weights that leave too little are measured again."""
    first, log1, _ = _sizer(per_token=4 << 20, limit=34 * GiB, max_model_len=4096,
                            memo_dir=tmp_path)
    one, _ = first.size()
    again, log2, _ = _sizer(per_token=4 << 20, limit=34 * GiB, in_use=10 * GiB + (8 << 20),
                            max_model_len=4096, memo_dir=tmp_path)
    two, runner = again.size()
    assert log1 and log2 == [] and runner is None
    assert two.plan == one.plan and two.engine == one.engine
    assert two.memory.peak == one.memory.peak and two.memory.in_use == 10 * GiB + (8 << 20)
    assert two.memory.measured.endswith(", kept")
    heavier, log3, _ = _sizer(per_token=4 << 20, limit=34 * GiB, in_use=11 * GiB,
                              max_model_len=4096, memo_dir=tmp_path)
    three, _ = heavier.size()
    assert [r for _, _, r in log3 if r] and not three.memory.measured.endswith("kept")
    assert three.memory.pool_budget == heavier.dm.free_for(three.memory.peak)


def test_a_context_that_adapts_leaves_the_snapshots_their_share():
    """The hybrid with default flags where the pages hold less than the model's context
    (an H100 and the 35B): max_model_len becomes what the pages hold beside the default
    snapshot share, so prefix caching keeps snapshots (it kept none: the context took every
    page, and the snapshots never crowd out one max_model_len sequence)."""
    probe, _, layout = _sizer("qwen3.6-tiny", per_token=1)
    ctx = probe.cfg.max_position_embeddings
    # pools of about a quarter of one full-context sequence, beside the slots
    budget = ctx // 4 * layout.bytes_per_token(16) + 80 * layout.bytes_per_slot()
    limit = GiB + int(budget) + memory.MIN_MARGIN + 2 * DECODE_PEAK  # < 33 GiB: the least margin
    sizer, _, layout = _sizer("qwen3.6-tiny", per_token=1, limit=limit, in_use=GiB,
                              max_num_seqs=8)
    sizing, _ = sizer.size()
    plan, e = sizing.plan, sizing.engine
    assert e.max_model_len < ctx and plan.num_snapshots > 0
    assert plan.max_tokens >= e.max_model_len
    share = capacity.snapshot_memory(dataclasses.replace(e, max_model_len=16), layout,
                                     sizing.memory.pool_budget)
    assert plan.num_snapshots == share // layout.bytes_per_slot()


def test_two_probes_predict_the_budget_without_a_third():
    """Temporaries of 1.5 GiB + 1 MiB per token, 3 GiB of room (a third of 9 GiB after the
    weights): from 8,192 (9.5 GiB) the proportional halving predicts 2,048, whose probe
    measures 3.5 GiB; the line through the two predicts 1,024 at 2.5 GiB, planned without a
    third probe (the H100's 35B hybrid probed 8,192, 2,048 and 1,024), and the verification
    at the planned pool measures it."""
    sizer, log, _ = _sizer(per_token=1 << 20, floor=3 * GiB // 2, limit=19 * GiB,
                           max_model_len=4096)
    sizing, _ = sizer.size()
    assert sizing.engine.max_num_batched_tokens == 1024
    assert [name for name, _, registered in log if not registered] == [
        "decode", "prefill8192", "prefill2048"]
    assert [name for name, _, registered in log if registered] == ["decode", "prefill1024"]
    assert sizing.memory.peak == 3 * GiB // 2 + 1024 * (1 << 20)  # measured = predicted
