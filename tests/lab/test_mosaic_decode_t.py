"""The transposed Mosaic GPU decode kernel (``mosaic_decode_t``) vs the reference twin: GPU
interpret mode on the CPU (simulated shared memory, TMA copies and barriers; unwritten
memory NaN; its race detector on), Mosaic's CUDA lowering on any machine, and natively on a
Hopper GPU under ``-m gpu``.

Cases as ``test_mosaic_decode``: fresh random pages, scales, queries and lengths (an empty
slot, a length-1 sequence, lengths off the page grid), a shuffled page table, NaN in every
slot and scale no sequence may see.

What interpret mode checks: the warpgroups' protocol (barriers, slots, the page walk, the
turns), masking and the online softmax down the columns, through ``TransposedOps``' jnp
stand-ins for the transposed wgmma operands and the P^T store. jax 0.10.2's interpreter runs
a lane-semantics kernel (it ignores the lowering semantics) but not these: the probe's chain
(``lab/mosaic_transpose_probe.py``) under it fails at ``layout_cast`` ("MLIR translation
rule for primitive 'layout_cast' not found for platform cpu") and, without the cast, at the
store through ``transpose_ref`` ("'TransposeTransform' object has no attribute
'indices'"). What it cannot check: Mosaic's lane-semantics code itself (layouts, wgmma, the
cross-warp reduction's shared scratch, register budgets): the lowering test and the GPU
cases cover that.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import reference
from lab import mosaic_decode_t
from tests.kernels.cases import (HOPPER_MARKS, NVVM_OPS, assert_close, assert_lowers_for_hopper,
                    attention_case, decode_lengths, make_cfg, on_cpu, on_exec)

pytest.importorskip("absl", reason="jax's Mosaic GPU module needs absl-py")

ref_decode = jax.jit(reference.decode_attention, static_argnums=(4, 5))
Tuning = mosaic_decode_t.MosaicDecodeTTuning

# (storage, scale mode, page_size, head_dim, num_heads, num_kv_heads, num_splits, tuning)
W1 = Tuning(stages=4, upcast="warpgroup", compute_wgs=1, f16_stages=2)
W2 = Tuning(stages=4, upcast="warpgroup", compute_wgs=2, f16_stages=2)
C1 = Tuning(stages=2, upcast="compute", compute_wgs=1)
C2 = Tuning(stages=4, upcast="compute", compute_wgs=2)
CASES = [
    # interpret (CPU) and GPU; up to 3 tiles a split there, so the 2-slot rings wrap:
    ("float8_e4m3fn", "token", 16, 64, 4, 1, 1, W2),
    ("float8_e5m2", "channel", 16, 64, 3, 1, 1, dataclasses.replace(C2, stages=2)),
    ("float8_e4m3fn", "token", 32, 64, 16, 1, 2,  # scales copied per page; K in registers
     dataclasses.replace(C1, k_regs=True)),
    # GPU only:
    ("float8_e5m2", "tensor", 8, 64, 6, 2, 0, C1),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, 0, W1),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, 0, W2),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, 0, C1),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, 0, C2),
    ("float8_e5m2", "token", 32, 128, 16, 8, 3, W2),
    ("float8_e4m3fn", "tensor", 16, 128, 8, 8, 0, W2),  # G = 1
    ("float8_e5m2", "channel", 64, 128, 16, 8, 2, C2),  # G = 2
    ("float8_e4m3fn", "token", 8, 64, 9, 3, 0, W1),  # G = 3
    ("float8_e4m3fn", "tensor", 128, 64, 64, 8, 1, C1),  # G = 8
    ("float8_e4m3fn", "token", 16, 128, 16, 1, 2, C2),  # G = 16
    ("float8_e5m2", "tensor", 16, 64, 32, 2, 0, W2),  # G = 16
    ("float8_e4m3fn", "token", 64, 128, 12, 1, 0, Tuning(stages=6, compute_wgs=2,
                                                          f16_stages=2)),  # G = 12
    # K upcast into registers, S^T's A operand from there (``k_regs``)
    ("float8_e4m3fn", "token", 16, 128, 32, 8, 0, dataclasses.replace(C1, k_regs=True)),
    ("float8_e5m2", "channel", 32, 64, 18, 2, 2, dataclasses.replace(C2, k_regs=True)),
    # the upcast in the layout Mosaic infers (``wide_upcast=False``)
    ("float8_e4m3fn", "token", 16, 128, 32, 8, 0, dataclasses.replace(C1, wide_upcast=False)),
    ("float8_e5m2", "tensor", 16, 64, 9, 3, 0, dataclasses.replace(W2, wide_upcast=False)),
]
INTERPRET = 3


def _id(c):
    t = c[7]
    return (f"{c[0]}-{c[1]}-S{c[2]}-D{c[3]}-H{c[4]}_{c[5]}-ns{c[6]}-"
            f"{t.upcast[0]}{t.compute_wgs}-st{t.stages}_{t.f16_stages}"
            + ("" if t.wide_upcast else "-narrow") + ("-kregs" if t.k_regs else "")
            + (f"-probe_{t.probe}" if t.probe else ""))


IDS = [_id(c) for c in CASES]


def _warpgroups(case) -> int:
    t = case[7]
    return t.compute_wgs + 1 + (t.upcast == "warpgroup")


# natively, fewest warpgroups first: two (no register moves, no turns) before three and four
# (setmaxnreg, which hangs rather than fails when a budget is wrong)
PARAMS = ([pytest.param(c, "interpret", id=f"{i}-interpret", marks=pytest.mark.lab)
           for c, i in zip(CASES[:INTERPRET], IDS)]
          + [pytest.param(c, "gpu", id=f"{i}-gpu", marks=HOPPER_MARKS)
             for c, i in sorted(zip(CASES, IDS), key=lambda ci: _warpgroups(ci[0]))])


@pytest.mark.parametrize("case,exec_mode", PARAMS)
def test_mosaic_decode_t_matches_reference(case, exec_mode):
    storage, mode, s, d, nh, hkv, ns, tuning = case
    rng = np.random.default_rng()
    span = 150 if exec_mode == "interpret" else 700  # interpret: up to 3 tiles a split
    lens, max_pages, num_pages = decode_lengths(rng, s, span)
    cfg = make_cfg(storage, mode, heads_kv=hkv, head_dim=d, page_size=s, num_pages=num_pages)
    case_ = attention_case(rng, cfg, lens, max_pages)
    q = jnp.asarray(rng.standard_normal((len(lens), nh, d)), "bfloat16")
    sm_scale = 1.0 / np.sqrt(d)
    tuning = dataclasses.replace(tuning, num_splits=ns)
    out = on_exec(exec_mode, mosaic_decode_t.decode_attention, q, case_.poisoned,
                  case_.page_tables, case_.seq_lens, cfg, sm_scale, tuning=tuning)
    ref = on_cpu(ref_decode, q, case_.clean, case_.page_tables, case_.seq_lens, cfg, sm_scale)
    assert_close(out, ref)
    if exec_mode == "interpret":  # the kernel's interpret mode runs the race detector
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

        assert not gpu_callbacks.get_races().races_found, "a shared-memory race"
    empty = np.asarray(case_.seq_lens) == 0
    assert (np.asarray(out, np.float32)[empty] == 0).all(), "empty slots must return zeros"


@pytest.mark.parametrize("storage,mode,page_size,head_dim,rotation,heads", [
    ("bfloat16", None, 16, 128, "none", 8),
    ("float8_e4m3fn", "block", 16, 128, "none", 8),
    ("float8_e4m3fn", "token", 16, 96, "none", 8),
    ("float8_e4m3fn", "token", 24, 128, "none", 8),
    ("float8_e4m3fn", "token", 16, 128, "hadamard", 8),
    ("float8_e4m3fn", "token", 16, 128, "none", 34),  # G = 17
    ("float8_e4m3fn", "token", 16, 128, "none", 7),  # not a multiple of the KV heads
])
def test_mosaic_decode_t_refuses_what_it_cannot_run(storage, mode, page_size, head_dim,
                                                    rotation, heads):
    cfg = dataclasses.replace(make_cfg(storage, mode, heads_kv=2, head_dim=head_dim,
                                       page_size=page_size, num_pages=4),
                              kv_rotation=rotation)
    with pytest.raises(ValueError, match="Triton kernel"):
        mosaic_decode_t.check_supported(cfg, heads)


@pytest.mark.parametrize("tuning", [Tuning(upcast="registers"), Tuning(compute_wgs=3),
                                    Tuning(upcast="compute", compute_wgs=2, stages=3),
                                    Tuning(compute_wgs=2, f16_stages=3), Tuning(probe="mma"),
                                    Tuning(k_regs=True)])
def test_mosaic_decode_t_refuses_bad_tunings(tuning):
    with pytest.raises(ValueError):
        mosaic_decode_t.check_tuning(tuning)


def test_mosaic_decode_t_refuses_too_many_stages():
    cfg = make_cfg("float8_e4m3fn", "token", heads_kv=2, head_dim=128, page_size=16,
                   num_pages=8)
    case_ = attention_case(np.random.default_rng(), cfg, np.array([30, 1]), 2)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_decode_t.decode_attention(
            jnp.zeros((2, 4, 128), "bfloat16"), case_.clean, case_.page_tables,
            case_.seq_lens, cfg, 0.1, tuning=Tuning(stages=8, f16_stages=4, compute_wgs=2))


# (storage, mode, page_size, head_dim, num_heads, num_kv_heads, tuning): each supported
# axis at least once, each tuning shape the bench times
LOWER_CASES = [
    ("float8_e4m3fn", "token", 16, 128, 32, 8, W1),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, W2),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, C1),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, C2),
    ("float8_e4m3fn", "tensor", 16, 128, 32, 8, Tuning(stages=4, compute_wgs=2,
                                                       f16_stages=4)),
    ("float8_e4m3fn", "token", 64, 128, 12, 1, Tuning(stages=6, compute_wgs=2,
                                                      f16_stages=2)),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, Tuning(stages=8, upcast="compute",
                                                      compute_wgs=2)),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, Tuning(stages=4, compute_wgs=2, f16_stages=2,
                                                      wide_upcast=False)),
    ("float8_e4m3fn", "token", 16, 64, 9, 3, Tuning(stages=4, upcast="compute",
                                                    compute_wgs=2, wide_upcast=False)),
    ("float8_e5m2", "channel", 64, 128, 16, 8, W2),
    ("float8_e4m3fn", "token", 8, 64, 9, 3, W2),
    ("float8_e4m3fn", "token", 32, 64, 8, 8, C2),  # G = 1
    ("float8_e5m2", "tensor", 128, 64, 16, 1, W1),  # G = 16
    ("float8_e4m3fn", "token", 128, 128, 16, 1, C1),  # G = 16, gathered scales off
    ("float8_e4m3fn", "token", 16, 128, 32, 8, dataclasses.replace(C2, k_regs=True)),
    ("float8_e4m3fn", "tensor", 16, 64, 9, 3, dataclasses.replace(C1, k_regs=True,
                                                                  wide_upcast=False)),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, Tuning(stages=8, upcast="compute",
                                                      compute_wgs=2, k_regs=True)),
    # the bench's diagnostics (wrong results by design: lowered, never compared)
    ("float8_e4m3fn", "token", 16, 128, 32, 8, dataclasses.replace(C2, probe="copies")),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, dataclasses.replace(W2, probe="copies")),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, dataclasses.replace(C1, probe="no_upcast")),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, dataclasses.replace(W1, probe="no_mma")),
]


@pytest.mark.parametrize("case", LOWER_CASES, ids=[_id(c[:6] + (0,) + c[6:])
                                                   for c in LOWER_CASES])
def test_mosaic_decode_t_lowers_for_hopper_on_any_machine(case):
    """Pallas's lowering for CUDA (lane semantics, layout inference down to NVVM) runs in
    Python, GPU or not: most Mosaic errors show here in seconds."""
    storage, mode, s, d, nh, hkv, tuning = case
    cfg = make_cfg(storage, mode, heads_kv=hkv, head_dim=d, page_size=s, num_pages=64)
    case_ = attention_case(np.random.default_rng(), cfg, np.array([300, 1]), -(-320 // s))
    q = jnp.zeros((2, nh, d), "bfloat16")
    fn = jax.jit(mosaic_decode_t.decode_attention, static_argnums=(4, 5),
                 static_argnames="tuning")
    args = (q, case_.clean, case_.page_tables, case_.seq_lens, cfg, 0.1)
    if tuning.probe in ("copies", "no_mma"):  # no wgmma in these: the copies' ops only
        text = fn.trace(*args, tuning=tuning).lower(lowering_platforms=("cuda",)).as_text()
        assert "nvvm.wgmma.fence" not in text
        for op in NVVM_OPS[1:]:
            assert op in text, op
    else:
        assert_lowers_for_hopper(fn, *args, tuning=tuning)
