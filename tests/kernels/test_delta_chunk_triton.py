"""The candidate chunked prefill (``delta_chunk_triton``: XLA's chunk factors, one Pallas
Triton kernel walking the chunks) vs ``delta_rule.chunked``, in interpret mode and on a GPU.

Fresh random inputs per case: odd lengths (the last chunk padded), grouped heads, a
non-zero initial state, a row that ends in padding tokens and a row that is all padding
(beta = g = 0: with float32 products its state must come back bit for bit). Outputs start
as NaN in interpret mode, so an element the kernel does not write fails. "ieee" products
are held to float32 rounding in interpret mode; "tf32"/"bf16" (and every GPU run) to a
relative error of 2e-2 (printed: a convention slip is O(1)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import delta_chunk_triton as dct
from jfp8kv.kernels import delta_prefill, delta_rule

from .cases import assert_close, on_cpu, on_exec, sweep

ref_chunked = jax.jit(delta_rule.chunked, static_argnums=6)

# (batch, T, Hk, Hv, Dk, Dv, input dtype, chunk, block_v, precision)
CASES = [
    (3, 77, 1, 2, 16, 32, "bfloat16", 32, 16, "ieee"),
    (2, 150, 2, 4, 32, 16, "float32", 64, 16, "ieee"),
    (3, 45, 1, 3, 16, 16, "bfloat16", 16, 16, "bf16"),
    # GPU only (Qwen3.6-35B-A3B's heads):
    (2, 1031, 16, 32, 128, 128, "bfloat16", 64, 32, "tf32"),
    (3, 515, 16, 32, 128, 128, "bfloat16", 64, 64, "ieee"),
    (1, 4099, 16, 32, 128, 128, "bfloat16", 64, 32, "bf16"),
]
IDS = [f"B{c[0]}-T{c[1]}-H{c[2]}_{c[3]}-D{c[4]}_{c[5]}-{c[6]}-C{c[7]}-bv{c[8]}-{c[9]}"
       for c in CASES]


def _inputs(rng, b, t, hk, hv, dk, dv, dtype):
    q, k = (jnp.asarray(rng.standard_normal((b, t, hk, dk)) * rng.uniform(0.3, 3), dtype)
            for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, hv, dv)), dtype)
    g = -rng.uniform(0.0, 1.0, (b, t, hv)) * rng.uniform(0.01, 1.0, (1, 1, hv))
    beta = rng.uniform(0.0, 1.0, (b, t, hv))
    live = np.ones((b, t), bool)
    live[0, t - int(rng.integers(1, t // 2)):] = False
    live[-1] = b < 3  # with 3 rows the last is all padding
    g, beta = (jnp.asarray(x * live[..., None], jnp.float32) for x in (g, beta))
    state = jnp.asarray(rng.standard_normal((b, hv, dk, dv)) * 0.3, jnp.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(3)))
def test_chunk_walk_matches_twin(case, exec_mode):
    b, t, hk, hv, dk, dv, dtype, chunk, bv, precision = case
    rng = np.random.default_rng()
    args = _inputs(rng, b, t, hk, hv, dk, dv, dtype)
    tuning = dct.ChunkTuning(block_v=bv, precision=precision)
    fn = jax.jit(dct.chunked, static_argnames=("chunk", "interpret", "tuning"))
    out, final = on_exec(exec_mode, fn, *args, chunk=chunk, tuning=tuning)
    want_out, want = on_cpu(ref_chunked, *args, chunk)
    assert out.dtype == want_out.dtype and final.dtype == want.dtype == jnp.float32
    exact = precision == "ieee" and exec_mode == "interpret"
    if exact:  # float32 products: the twin's sums in another order
        scale = max(1.0, float(np.abs(np.asarray(want_out, np.float32)).max()))
        np.testing.assert_allclose(np.asarray(out, np.float32),
                                   np.asarray(want_out, np.float32), rtol=0,
                                   atol=2e-5 * scale if dtype == "float32" else 8e-3 * scale)
        assert_close(final, want, exact_f32=True)
    else:  # tf32 / bf16 operands (or a GPU's float32 sums): relative errors, printed
        for got, ref in ((out, want_out), (final, want)):
            got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
            assert np.isfinite(got).all()
            rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            worst = float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max()))
            print(f"{precision} vs twin {got.shape}: relative error {rel:.2e}, max {worst:.2e}")
            assert rel <= 2e-2 and worst <= 6e-2, (rel, worst)
    if b == 3 and precision == "ieee":  # the all-padding row
        assert (np.asarray(final[-1]) == np.asarray(args[-1][-1])).all()


def test_route_by_name_and_cuda_lowering():
    """``delta_prefill.chunked(impl="triton")`` is this kernel (traced here for CUDA at 35B-A3B's
    shapes: Pallas's Triton lowering runs in Python), and every precision lowers."""
    f = jax.ShapeDtypeStruct
    t = 1000
    args = (f((1, t, 16, 128), jnp.bfloat16), f((1, t, 16, 128), jnp.bfloat16),
            f((1, t, 32, 128), jnp.bfloat16), f((1, t, 32), jnp.float32),
            f((1, t, 32), jnp.float32), f((1, 32, 128, 128), jnp.float32))
    fn = jax.jit(functools.partial(delta_prefill.chunked, impl="triton"))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "jfp8kv_delta_chunk_walk" in text
    for precision in dct.PRECISIONS:
        fn = jax.jit(functools.partial(dct.chunked, tuning=dct.ChunkTuning(precision=precision)))
        assert "xla.gpu.triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="precision"):
        dct.ChunkTuning(precision="fp8")
