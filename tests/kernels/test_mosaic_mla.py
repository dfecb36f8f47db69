"""The Mosaic GPU MLA latent decode kernel (``mosaic_mla``) vs its twin
``mla_reference.latent_attention``: GPU interpret mode on the CPU (simulated shared memory,
TMA copies and barriers; unwritten memory NaN; its race detector on), Mosaic's CUDA lowering
on any machine at the real shapes, and natively on a Hopper GPU under ``-m gpu``.

Cases as ``test_mla_kernel``: fresh random latent pages, scales and queries, a shuffled page
table, an empty slot, a length-1 sequence, lengths off the page grid, NaN in every row and
scale no sequence may see (the reference reads a clean copy).

What interpret mode checks: the warpgroups' protocol (barriers, slots, the page walk), the
two-part S^T, masking, the in-place zeroing of 16-bit rows past the end, the online softmax
down the columns and the split merge, through ``TransposedOps``' jnp stand-ins for the
transposed wgmma operands and the P^T store (jax 0.10.2's interpreter runs neither
``layout_cast`` nor a store through ``transpose_ref``: see tests/lab/test_mosaic_decode_t).
What it cannot check: Mosaic's lane-semantics code itself (layouts, wgmma, swizzles, the cross-warp
reduction, registers): the lowering test and the GPU cases cover that.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import mla_reference, mosaic_mla

from .cases import (HOPPER_MARKS, assert_close, assert_lowers_for_hopper, make_cfg, on_cpu,
                    on_exec)
from .test_mla_kernel import latent_case, queries

pytest.importorskip("absl", reason="jax's Mosaic GPU module needs absl-py")

ref_latent = jax.jit(mla_reference.latent_attention, static_argnums=(6, 7, 8))
Tuning = mosaic_mla.MosaicMLATuning

# (storage, scale mode, page_size, kv_lora_rank, heads, num_splits, tuning)
INTERPRET_CASES = [
    # small ranks and few programs (the interpreter's cost: ~3 s a program on 2 busy cores),
    # up to 3 tiles a split so the 2-slot ring wraps; token scales copied per page (32-token
    # pages: the gathered ones of 16-token pages run natively, and in mosaic_decode_t's
    # interpret cases); two head blocks (hb8); block scales over two splits
    ("bfloat16", None, 16, 128, 5, 1, Tuning()),
    ("float8_e4m3fn", "token", 32, 128, 12, 1, Tuning(head_block=8)),
    ("float8_e4m3fn", "block", 16, 128, 9, 2, Tuning()),
]
# natively (every case has the same two warpgroups, no register moves): the defaults per
# storage first, then page sizes, head counts (H = 128: 8 or 16 head blocks), stage counts,
# a rank of 256
GPU_CASES = [
    ("bfloat16", None, 16, 512, 16, 0, Tuning()),
    ("float8_e4m3fn", "token", 16, 512, 16, 0, Tuning()),
    ("float8_e4m3fn", "block", 16, 512, 16, 0, Tuning()),
    ("float16", None, 32, 512, 16, 3, Tuning(head_block=8)),
    ("bfloat16", None, 64, 512, 128, 0, Tuning()),
    ("float8_e4m3fn", "token", 64, 512, 16, 0, Tuning()),
    ("float8_e4m3fn", "token", 16, 512, 128, 0, Tuning(stages=3, head_block=8)),
    ("float8_e5m2", "token", 8, 512, 20, 2, Tuning(stages=1)),
    ("float8_e4m3fn", "block", 64, 512, 128, 0, Tuning(stages=3, head_block=8)),
    ("float8_e5m2", "token", 32, 256, 12, 1, Tuning(head_block=8)),
    # rank 128 (six block-scale groups a row), as in the engine's GPU test
    ("bfloat16", None, 16, 128, 16, 0, Tuning()),
    ("float8_e4m3fn", "block", 16, 128, 16, 0, Tuning()),
    ("float8_e4m3fn", "token", 16, 128, 16, 0, Tuning()),
]


def _id(c):
    t = c[6]
    return (f"{c[0]}-{c[1]}-S{c[2]}-R{c[3]}+64-H{c[4]}-ns{c[5]}-st{t.stages}"
            f"-hb{t.head_block}")


PARAMS = ([pytest.param(c, "interpret", id=f"{_id(c)}-interpret") for c in INTERPRET_CASES]
          + [pytest.param(c, "gpu", id=f"{_id(c)}-gpu", marks=HOPPER_MARKS)
             for c in GPU_CASES])


@pytest.mark.parametrize("case,exec_mode", PARAMS)
def test_mosaic_mla_matches_reference(case, exec_mode):
    storage, mode, s, rank, nh, ns, tuning = case
    rng = np.random.default_rng()
    span = 150 if exec_mode == "interpret" else 700  # interpret: up to 3 tiles a split
    cap = max(2, -(-span // s)) * s
    lens = np.array([0, 1, int(rng.integers(2, cap)), cap, int(rng.integers(2, s + 3))])
    rng.shuffle(lens)
    cfg, clean, poisoned, pt, seq_lens = latent_case(rng, storage, mode, s, rank, 64, lens)
    q, pos = queries(rng, lens, 1, nh, rank + 64, "bfloat16")
    sm_scale = 1.0 / np.sqrt(rank + 64)
    tuning = dataclasses.replace(tuning, num_splits=ns)
    out = on_exec(exec_mode, mosaic_mla.latent_attention, q, *poisoned, pt, seq_lens, pos,
                  cfg, sm_scale, rank, tuning=tuning)
    ref = on_cpu(ref_latent, q, *clean, pt, seq_lens, pos, cfg, sm_scale, rank)
    assert out.dtype == q.dtype and out.shape == (len(lens), 1, nh, rank)
    assert_close(out, ref)
    if exec_mode == "interpret":  # the kernel's interpret mode runs the race detector
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

        assert not gpu_callbacks.get_races().races_found, "a shared-memory race"
    empty = np.asarray(seq_lens) == 0
    assert (np.asarray(out, np.float32)[empty] == 0).all(), "empty slots must return zeros"


def _latent_cfg(storage, mode, page_size=16, rank=512, rope=64):
    return dataclasses.replace(make_cfg(storage, mode, heads_kv=1, head_dim=rank + rope,
                                        page_size=page_size, num_pages=4), layout="latent")


@pytest.mark.parametrize("cfg,heads,value_dim", [
    (dataclasses.replace(_latent_cfg("float8_e4m3fn", "block"), scale_block=16), 16, 512),
    (_latent_cfg("float8_e4m3fn", "tensor"), 16, 512),
    (_latent_cfg("float32", None), 16, 512),
    (_latent_cfg("bfloat16", None, rope=32), 16, 512),  # RoPE tail 32
    (_latent_cfg("bfloat16", None, rank=64), 16, 64),  # rank 64
    (_latent_cfg("bfloat16", None, page_size=24), 16, 512),
    (dataclasses.replace(_latent_cfg("bfloat16", None), layout="kv"), 16, 512),
])
def test_mosaic_mla_refuses_what_it_cannot_run(cfg, heads, value_dim):
    with pytest.raises(ValueError, match="Triton kernel"):
        mosaic_mla.check_supported(cfg, heads, value_dim)


def _args(storage, mode, s, nh, batch_lens=(300, 1), rank=512):
    rng = np.random.default_rng(0)
    cfg, clean, _, pt, seq_lens = latent_case(rng, storage, mode, s, rank, 64,
                                              np.array(batch_lens))
    q = jnp.zeros((len(batch_lens), 1, nh, rank + 64), "bfloat16")
    return (q, *clean, pt, seq_lens, (seq_lens - 1)[:, None], cfg, 0.1, rank)


@pytest.mark.parametrize("storage,mode,tuning", [
    ("bfloat16", None, Tuning(stages=3)),  # 3 x 72 KB slots
    ("float8_e4m3fn", "token", Tuning(stages=3)),  # N = 16: 2 stages at most
    ("float8_e4m3fn", "token", Tuning(stages=4, head_block=8)),
])
def test_mosaic_mla_refuses_too_many_stages(storage, mode, tuning):
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_mla.latent_attention(*_args(storage, mode, 16, 16), tuning=tuning)


def test_mosaic_mla_refuses_bad_tunings_and_prefill():
    for tuning in (Tuning(stages=0), Tuning(head_block=32)):
        with pytest.raises(ValueError):
            mosaic_mla.check_tuning(tuning)
    q, *rest = _args("bfloat16", None, 16, 16)
    with pytest.raises(ValueError, match="decode only"):
        mosaic_mla.latent_attention(jnp.zeros((2, 3, 16, 576), "bfloat16"), *rest[:4],
                                    jnp.zeros((2, 3), jnp.int32), *rest[5:])


# (storage, mode, page_size, heads, tuning): each storage, page size, head count and
# stage count the bench times, at DeepSeek's rows
LOWER_CASES = [
    ("bfloat16", None, 16, 16, Tuning()),
    ("bfloat16", None, 64, 128, Tuning()),
    ("bfloat16", None, 16, 16, Tuning(head_block=8, stages=1)),
    ("float16", None, 32, 16, Tuning()),
    ("float8_e4m3fn", "token", 16, 16, Tuning()),
    ("float8_e4m3fn", "token", 64, 16, Tuning()),
    ("float8_e4m3fn", "token", 16, 128, Tuning()),
    ("float8_e4m3fn", "token", 16, 16, Tuning(stages=3, head_block=8)),
    ("float8_e5m2", "token", 8, 20, Tuning(stages=1)),
    ("float8_e4m3fn", "block", 16, 16, Tuning()),
    ("float8_e4m3fn", "block", 64, 128, Tuning(stages=3, head_block=8)),
    ("bfloat16", None, 64, 16, Tuning()),
]


@pytest.mark.parametrize("case", LOWER_CASES, ids=[
    f"{c[0]}-{c[1]}-S{c[2]}-H{c[3]}-st{c[4].stages}-hb{c[4].head_block}"
    for c in LOWER_CASES])
def test_mosaic_mla_lowers_for_hopper_on_any_machine(case):
    """Pallas's lowering for CUDA (lane semantics, layout inference down to NVVM) runs in
    Python, GPU or not: most Mosaic errors show here in seconds."""
    storage, mode, s, nh, tuning = case
    fn = jax.jit(mosaic_mla.latent_attention, static_argnums=(6, 7, 8),
                 static_argnames="tuning")
    assert_lowers_for_hopper(fn, *_args(storage, mode, s, nh), tuning=tuning)


@pytest.mark.parametrize("storage,mode,rank,hopper,runs", [
    ("bfloat16", None, 512, True, True),
    ("float8_e4m3fn", "token", 512, True, True),
    ("float8_e4m3fn", "block", 512, True, True),
    ("bfloat16", None, 512, False, False),  # Ada, or no GPU: the Triton kernel
    ("bfloat16", None, 1024, True, False),  # a rank the Mosaic kernel refuses
    ("float8_e4m3fn", "tensor", 512, True, False)])  # static scales: refused for latents
def test_the_pallas_backend_takes_the_mosaic_mla_kernel_for_decode_where_it_runs(
        monkeypatch, storage, mode, rank, hopper, runs):
    import jfp8kv.kernels as kernels

    monkeypatch.setattr(kernels, "is_hopper", lambda: hopper)
    cfg = dataclasses.replace(make_cfg(storage, mode, heads_kv=1, head_dim=rank + 64,
                                       page_size=16, num_pages=4), layout="latent")
    assert kernels.mosaic_mla_runs(cfg, 16, rank) is runs


def test_prefill_and_interpret_backends_keep_the_triton_mla_kernel(monkeypatch):
    """Only decode (T == 1) on the native ``pallas`` backend goes to the Mosaic kernel: a
    Mosaic call here (no GPU) would raise, so these reaching the reference's values shows
    ``pallas_mla`` ran."""
    import jfp8kv.kernels as kernels

    monkeypatch.setattr(kernels, "is_hopper", lambda: True)
    monkeypatch.setattr(mosaic_mla, "latent_attention", lambda *a, **k: 1 / 0)
    rng = np.random.default_rng()
    cfg, clean, _, pt, lens = latent_case(rng, "bfloat16", None, 16, 128, 64, np.array([40, 7]))
    for t in (1, 3):
        q, pos = queries(rng, lens, t, 4, 192, "bfloat16")
        out = kernels.latent_attention(q, *clean, pt, lens, pos, cfg, 0.1, 128,
                                       backend="pallas_interpret")
        ref = mla_reference.latent_attention(q, *clean, pt, lens, pos, cfg, 0.1, 128)
        assert_close(out, ref)
