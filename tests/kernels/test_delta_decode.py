"""The in-place DeltaNet decode kernels (``delta_decode``) vs their twins (gather ->
``delta_rule`` -> scatter), in interpret mode and on a GPU.

Every case draws a fresh pool and fresh rows: an odd batch whose real rows sit in shuffled
slots, padding rows on the sink slot 0 (beta = g = 0, n_valid 0, as the model pads), one row
that starts its sequence (``fresh``: its slot holds NaN, which must not be read), grouped
q/k heads, a non-zero state. The slots no row names are half NaN, half random: afterwards
they must hold the same bits (NaN stays NaN). The sink is NaN too (the padding rows' outputs
and the sink's contents are garbage by contract, so neither is compared). Outputs of the
interpret mode start as NaN, so an element the kernel does not write fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import delta_decode

from .cases import assert_close, has_gpu, on_cpu, on_exec, sweep

ref_step = jax.jit(delta_decode.recurrent_step_reference)
ref_conv = jax.jit(delta_decode.conv_step_reference)

# (pool dtype, input dtype, batch, Hk, Hv, Dk, Dv, slots, padding rows, block_v)
CASES = [
    ("float32", "bfloat16", 5, 2, 4, 16, 32, 11, 1, 16),
    ("bfloat16", "bfloat16", 3, 1, 3, 32, 16, 7, 1, 16),
    ("float32", "float32", 7, 2, 2, 16, 16, 12, 2, 64),
    # GPU only (the engine's shapes: Qwen3.6-35B-A3B, 16 key heads, 32 value heads):
    ("float32", "bfloat16", 37, 16, 32, 128, 128, 45, 3, 64),
    ("bfloat16", "bfloat16", 33, 16, 32, 128, 128, 40, 2, 32),
    ("float32", "bfloat16", 9, 16, 32, 128, 128, 16, 1, 128),
]
IDS = [f"pool_{c[0]}-in_{c[1]}-B{c[2]}-H{c[3]}_{c[4]}-D{c[5]}_{c[6]}-bv{c[9]}" for c in CASES]


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _layout(rng, b: int, slots: int, pad: int):
    """(slot_ids, fresh, real-row mask, untouched slots): the real rows in distinct shuffled
    slots >= 1, ``pad`` padding rows on slot 0, every row order shuffled."""
    real = b - pad
    ids = np.concatenate([rng.choice(np.arange(1, slots), real, replace=False),
                          np.zeros(pad, np.int64)])
    perm = rng.permutation(b)
    ids = ids[perm].astype(np.int32)
    is_real = ids > 0
    fresh = np.zeros(b, bool)
    fresh[rng.choice(np.flatnonzero(is_real))] = True
    untouched = np.setdiff1d(np.arange(1, slots), ids)
    return ids, fresh, is_real, untouched


def _poison(rng, pool: np.ndarray, ids, fresh, untouched) -> np.ndarray:
    """NaN in the sink, the fresh row's slot and half the untouched slots."""
    pool = pool.copy()
    pool[0] = np.nan
    pool[ids[fresh]] = np.nan
    pool[untouched[: (len(untouched) + 1) // 2]] = np.nan
    return pool


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(3)))
def test_recurrent_step_matches_twin(case, exec_mode):
    pool_dt, in_dt, b, hk, hv, dk, dv, slots, pad, bv = case
    rng = np.random.default_rng()
    ids, fresh, is_real, untouched = _layout(rng, b, slots, pad)
    clean = (rng.standard_normal((slots, hv, dk, dv)) * 0.3).astype(np.float32)
    pool = jnp.asarray(_poison(rng, clean, ids, fresh, untouched), pool_dt)
    q, k = (jnp.asarray(rng.standard_normal((b, hk, dk)) * rng.uniform(0.2, 3), in_dt)
            for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, hv, dv)), in_dt)
    g = -rng.uniform(0.0, 2.0, (b, hv)) * is_real[:, None]  # padding: beta = g = 0
    beta = rng.uniform(0.0, 1.0, (b, hv)) * is_real[:, None]
    g, beta = jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32)
    args = (jnp.asarray(ids), q, k, v, g, beta, jnp.asarray(fresh))
    before = np.asarray(pool)
    tuning = delta_decode.DeltaDecodeTuning(block_v=bv)
    out, new = on_exec(exec_mode, delta_decode.recurrent_step, pool, *args, tuning=tuning)
    want_out, want = on_cpu(ref_step, pool, *args)
    exact = pool_dt == in_dt == "float32"
    assert_close(np.asarray(out)[is_real], np.asarray(want_out)[is_real], exact_f32=exact)
    assert_close(np.asarray(new)[ids[is_real]], np.asarray(want)[ids[is_real]],
                 exact_f32=exact)
    assert (_bits(np.asarray(new)[untouched]) == _bits(before[untouched])).all(), \
        "a slot no row names changed"
    assert np.isnan(np.asarray(new, np.float32)[untouched[: (len(untouched) + 1) // 2]]).all()
    assert out.dtype == v.dtype and new.dtype == pool.dtype and new.shape == pool.shape


# (pool dtype, x dtype, batch, channels, conv kernel K, slots, padding rows, block_c)
CONV_CASES = [
    ("float32", "bfloat16", 5, 64, 4, 9, 1, 32),
    ("bfloat16", "bfloat16", 3, 32, 3, 6, 1, 32),
    ("float32", "float32", 4, 128, 4, 8, 1, 64),
    # GPU only (35B-A3B: 8,192 conv channels, K = 4):
    ("float32", "bfloat16", 37, 8192, 4, 45, 3, 256),
    ("bfloat16", "bfloat16", 9, 8192, 4, 16, 1, 1024),
]
CONV_IDS = [f"pool_{c[0]}-x_{c[1]}-B{c[2]}-C{c[3]}-K{c[4]}-bc{c[7]}" for c in CONV_CASES]


@pytest.mark.parametrize("case,exec_mode", sweep(CONV_CASES, CONV_IDS, cpu_subset=range(3)))
def test_conv_step_matches_twin(case, exec_mode):
    pool_dt, x_dt, b, c, kk, slots, pad, bc = case
    rng = np.random.default_rng()
    ids, fresh, is_real, untouched = _layout(rng, b, slots, pad)
    clean = rng.standard_normal((slots, kk - 1, c)).astype(np.float32)
    pool = jnp.asarray(_poison(rng, clean, ids, fresh, untouched), pool_dt)
    x = jnp.asarray(rng.standard_normal((b, c)), x_dt)
    weight = jnp.asarray(rng.standard_normal((c, kk)) * 0.5, x_dt)
    n_valid = is_real.astype(np.int32)
    n_valid[rng.choice(np.flatnonzero(is_real & ~fresh))] = 0  # a real row's padding token
    args = (jnp.asarray(ids), x, weight, jnp.asarray(n_valid), jnp.asarray(fresh))
    before = np.asarray(pool)
    tuning = delta_decode.DeltaDecodeTuning(block_c=bc)
    out, new = on_exec(exec_mode, delta_decode.conv_step, pool, *args, tuning=tuning)
    want_out, want = on_cpu(ref_conv, pool, *args)
    assert_close(np.asarray(out)[is_real], np.asarray(want_out)[is_real],
                 exact_f32=x_dt == "float32")
    # the window is moved, not computed: the same bits as the twin's
    real = ids[is_real]
    assert (_bits(np.asarray(new)[real]) == _bits(np.asarray(want)[real])).all()
    assert not np.isnan(np.asarray(new, np.float32)[real]).any()
    assert (_bits(np.asarray(new)[untouched]) == _bits(before[untouched])).all()
    assert out.dtype == x.dtype and new.dtype == pool.dtype


def _engine_args(b=4, slots=9):
    """Shape structs of one 35B-A3B decode step (recurrent and conv)."""
    f = jax.ShapeDtypeStruct
    rec = (f((slots, 32, 128, 128), jnp.float32), f((b,), jnp.int32),
           f((b, 16, 128), jnp.bfloat16), f((b, 16, 128), jnp.bfloat16),
           f((b, 32, 128), jnp.bfloat16), f((b, 32), jnp.float32), f((b, 32), jnp.float32))
    conv = (f((slots, 3, 8192), jnp.float32), f((b,), jnp.int32), f((b, 8192), jnp.bfloat16),
            f((8192, 4), jnp.bfloat16), f((b,), jnp.int32))
    return rec, conv


@pytest.mark.parametrize("block_v", [32, 64, 128])
def test_kernels_lower_for_cuda_with_the_pool_aliased(block_v):
    """Pallas's Triton lowering runs in Python: at the engine's shapes both kernels lower for
    CUDA on this machine, the pool an aliased operand of the custom call (no GPU needed)."""
    rec, conv = _engine_args()
    t = delta_decode.DeltaDecodeTuning(block_v=block_v)
    for fn, args in ((delta_decode.recurrent_step, rec), (delta_decode.conv_step, conv)):
        text = fn.trace(*args, tuning=t).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text and text.count("output_operand_alias<") == 1


def test_contract_errors():
    rec, conv = _engine_args()
    bad = jax.ShapeDtypeStruct((9, 32, 128, 128), jnp.float16)
    with pytest.raises(ValueError, match="pool dtype"):
        delta_decode.recurrent_step.trace(bad, *rec[1:])
    with pytest.raises(ValueError, match="do not fit"):
        delta_decode.recurrent_step.trace(rec[0], rec[1], rec[2], rec[2], rec[2], *rec[5:])
    f = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="multiple of block_c"):
        delta_decode.conv_step.trace(f((9, 3, 96), jnp.float32), conv[1],
                                     f((4, 96), jnp.bfloat16), f((96, 4), jnp.bfloat16), conv[4],
                                     tuning=delta_decode.DeltaDecodeTuning(block_c=64))


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")
def test_donated_pool_is_not_copied_gpu():
    """A jit that donates the pool compiles to the kernels and no copy of a pool-sized
    buffer (the point of the in-place step)."""
    rec, conv = _engine_args(b=32, slots=40)
    for fn, args in ((delta_decode.recurrent_step, rec), (delta_decode.conv_step, conv)):
        text = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
        shape = "[" + ",".join(str(d) for d in args[0].shape) + "]"
        copies = [ln for ln in text.splitlines() if " copy(" in ln and shape in ln.split("=")[0]]
        assert not copies, copies
