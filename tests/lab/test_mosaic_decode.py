"""The Mosaic GPU decode kernel vs the reference twin: GPU interpret mode on the CPU (which
simulates shared memory, TMA copies and barriers, fills unwritten memory with NaN and here
detects races between the warpgroups), and
natively on a Hopper GPU under ``-m gpu``.

Cases as ``test_decode``: fresh random pages, scales, queries and lengths (an empty slot, a
length-1 sequence, lengths off the page grid), a shuffled page table, NaN in every slot and
scale no sequence may see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import reference
from lab import mosaic_decode
from tests.kernels.cases import (HOPPER_MARKS, assert_close, assert_lowers_for_hopper, attention_case,
                    decode_lengths, make_cfg, on_cpu, on_exec)

pytest.importorskip("absl", reason="jax's Mosaic GPU module needs absl-py")

ref_decode = jax.jit(reference.decode_attention, static_argnums=(4, 5))

# (storage, scale mode, page_size, head_dim, num_heads, num_kv_heads, num_splits, stages);
# an odd stage count runs three compute warpgroups
CASES = [
    ("float8_e4m3fn", "token", 16, 128, 8, 2, 1, 4),
    ("float8_e5m2", "tensor", 32, 64, 9, 3, 2, 2),
    # GPU only:
    ("float8_e4m3fn", "tensor", 16, 128, 32, 8, 0, 4),
    ("float8_e4m3fn", "channel", 8, 128, 16, 8, 3, 4),
    ("float8_e4m3fn", "token", 64, 64, 14, 2, 0, 6),
    ("float8_e4m3fn", "token", 128, 128, 4, 4, 2, 2),
    ("float8_e5m2", "token", 16, 128, 64, 1, 1, 4),
    ("float8_e4m3fn", "token", 16, 128, 16, 8, 0, 3),  # stages 3: three compute warpgroups
]
IDS = [f"{c[0]}-{c[1]}-S{c[2]}-D{c[3]}-H{c[4]}_{c[5]}-ns{c[6]}-st{c[7]}" for c in CASES]


PARAMS = ([pytest.param(c, "interpret", id=f"{i}-interpret", marks=pytest.mark.lab)
           for c, i in zip(CASES[:2], IDS)]
          + [pytest.param(c, "gpu", id=f"{i}-gpu", marks=HOPPER_MARKS) for c, i in zip(CASES, IDS)])
OVERLAP_CASES = [0, 4]  # with V's upcast during q.K^T (``overlap_v``): interpret + native


@pytest.mark.parametrize("case,exec_mode", PARAMS)
def test_mosaic_decode_matches_reference(case, exec_mode, overlap_v=False):
    storage, mode, s, d, nh, hkv, ns, stages = case
    rng = np.random.default_rng()
    lens, max_pages, num_pages = decode_lengths(rng, s, 300)
    cfg = make_cfg(storage, mode, heads_kv=hkv, head_dim=d, page_size=s, num_pages=num_pages)
    case_ = attention_case(rng, cfg, lens, max_pages)
    q = jnp.asarray(rng.standard_normal((len(lens), nh, d)), "bfloat16")
    sm_scale = 1.0 / np.sqrt(d)
    tuning = mosaic_decode.MosaicDecodeTuning(stages=stages, num_splits=ns,
                                              compute_wgs=3 if stages % 2 else 2,
                                              overlap_v=overlap_v)
    out = on_exec(exec_mode, mosaic_decode.decode_attention, q, case_.poisoned,
                  case_.page_tables, case_.seq_lens, cfg, sm_scale, tuning=tuning)
    ref = on_cpu(ref_decode, q, case_.clean, case_.page_tables, case_.seq_lens, cfg, sm_scale)
    assert_close(out, ref)
    if exec_mode == "interpret":  # the kernel's interpret mode runs the race detector
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

        assert not gpu_callbacks.get_races().races_found, "a shared-memory race"
    empty = np.asarray(case_.seq_lens) == 0
    assert (np.asarray(out, np.float32)[empty] == 0).all(), "empty slots must return zeros"


@pytest.mark.parametrize("case,exec_mode", [
    pytest.param(CASES[0], "interpret", id=f"{IDS[0]}-interpret", marks=pytest.mark.lab)] + [
    pytest.param(CASES[i], "gpu", id=f"{IDS[i]}-gpu", marks=HOPPER_MARKS) for i in OVERLAP_CASES])
def test_mosaic_decode_overlap_v_matches_reference(case, exec_mode):
    test_mosaic_decode_matches_reference(case, exec_mode, overlap_v=True)


@pytest.mark.parametrize("storage,mode,page_size,head_dim,rotation,heads", [
    ("bfloat16", None, 16, 128, "none", 8),
    ("float8_e4m3fn", "block", 16, 128, "none", 8),
    ("float8_e4m3fn", "token", 16, 96, "none", 8),
    ("float8_e4m3fn", "token", 24, 128, "none", 8),
    ("float8_e4m3fn", "token", 16, 128, "hadamard", 8),
    ("float8_e4m3fn", "token", 16, 128, "none", 130),
])
def test_mosaic_decode_refuses_what_it_cannot_run(storage, mode, page_size, head_dim, rotation,
                                                  heads):
    import dataclasses

    cfg = dataclasses.replace(make_cfg(storage, mode, heads_kv=2, head_dim=head_dim,
                                       page_size=page_size, num_pages=4),
                              kv_rotation=rotation)
    with pytest.raises(ValueError, match="Triton kernel"):
        mosaic_decode.check_supported(cfg, heads)


@pytest.mark.parametrize("mode,overlap_v", [("token", False), ("token", True),
                                             ("tensor", False)])
def test_mosaic_decode_lowers_for_hopper_on_any_machine(mode, overlap_v):
    """As ``test_mosaic_prefill_lowers_for_hopper_on_any_machine``: Pallas's lowering for
    CUDA (layout inference down to NVVM) runs in Python, GPU or not."""
    cfg = make_cfg("float8_e4m3fn", mode, heads_kv=8, head_dim=128, page_size=16,
                   num_pages=64)
    case_ = attention_case(np.random.default_rng(), cfg, np.array([300, 1]), 20)
    q = jnp.zeros((2, 32, 128), "bfloat16")
    tuning = mosaic_decode.MosaicDecodeTuning(overlap_v=overlap_v)
    assert_lowers_for_hopper(
        jax.jit(mosaic_decode.decode_attention, static_argnums=(4, 5),
                static_argnames="tuning"),
        q, case_.clean, case_.page_tables, case_.seq_lens, cfg, 0.1, tuning=tuning)
