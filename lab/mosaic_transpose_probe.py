"""Probe (not a benchmark): can P^T, a wgmma accumulator [64 keys, N heads], reach a [N, 64]
shared-memory buffer so that O^T = V^T P^T runs with N = 8 or 16 (decode with the products
transposed, docs/lab/kernels-notes.md)? For each lowering semantics (lane, warpgroup), N and way
of storing P^T, lowers a one-tile kernel for CUDA (works on the CPU) and, on a GPU, runs it
against numpy. Usage: ``python -m lab.mosaic_transpose_probe`` (needs absl-py); the
H200 output is bench/results/mosaic-transpose-probe-h200.txt."""

import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

def sw(shape, dt):
    bits = jnp.dtype(dt).itemsize * 8
    s = plgpu.find_swizzle(shape[-1] * bits)
    return plgpu.SMEM(shape, dt, transforms=(plgpu.TilingTransform((8, s * 8 // bits)), plgpu.SwizzleTransform(s)))
def build(N, how, sem):
    def kernel(k_ref, v_ref, q_ref, o_ref, smem):
        k_s, v_s, q_s, p_s, o_s, bar = smem
        for src, dst in ((k_ref, k_s), (v_ref, v_s), (q_ref, q_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.barrier_wait(bar)
        def qk(acc_ref):
            plgpu.wgmma(acc_ref, k_s, plgpu.transpose_ref(q_s, (1, 0)))
            return acc_ref[...]
        st = pl.run_scoped(qk, plgpu.ACC((64, N), jnp.float32))
        m = st.max(axis=0)
        pT = jnp.exp(st - jax.lax.broadcast_in_dim(m, st.shape, [1])).astype(jnp.float16)
        if how == "transref":
            plgpu.transpose_ref(p_s, (1, 0))[...] = pT
        elif how == "cast_transref":
            plgpu.transpose_ref(p_s, (1, 0))[...] = plgpu.layout_cast(pT, plgpu.Layout.WGMMA_TRANSPOSED)
        else:
            p_s[...] = pT.T
        plgpu.commit_smem()
        def pv(acc_ref):
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(v_s, (1, 0)), plgpu.transpose_ref(p_s, (1, 0)))
            return acc_ref[...]
        o = pl.run_scoped(pv, plgpu.ACC((128, N), jnp.float32))
        o_s[...] = o.astype(jnp.float16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref)
        plgpu.wait_smem_to_gmem(0)
    params = {} if sem == "lane" else dict(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((128, N), jnp.float16), grid=(1,), grid_names=("x",),
        scratch_types=((sw((64, 128), jnp.float16), sw((64, 128), jnp.float16), sw((N, 128), jnp.float16),
                         sw((N, 64), jnp.float16), plgpu.SMEM((128, N), jnp.float16), plgpu.Barrier(num_arrivals=3)),),
        compiler_params=plgpu.CompilerParams(**params))
def main():
    print("jax", jax.__version__, jax.devices()[0].platform)
    gpu = jax.devices()[0].platform == "gpu"
    rng = np.random.default_rng(0)
    for sem in ("lane", "wg"):
        for N in (8, 16):
            for how in ("transref", "cast_transref", "T"):
                if sem == "wg" and how == "cast_transref":
                    continue
                k, v, q = (rng.standard_normal(s).astype(np.float16) for s in ((64, 128), (64, 128), (N, 128)))
                tag = f"{sem} N={N} {how}"
                try:
                    f = build(N, how, sem)
                except TypeError:  # older keyword names
                    traceback.print_exc(limit=1); continue
                try:
                    jax.jit(f).trace(k, v, q).lower(lowering_platforms=("cuda",))
                except Exception as e:
                    print("NO-LOWER", tag, type(e).__name__, str(e).split("\n")[0][:200]); continue
                if not gpu:
                    print("LOWERS", tag); continue
                try:
                    o = np.asarray(jax.jit(f)(k, v, q)).astype(np.float32)
                    s = k.astype(np.float32) @ q.astype(np.float32).T  # [64, N]
                    p = np.exp(s - s.max(0, keepdims=True))
                    ref = v.astype(np.float32).T @ p.astype(np.float16).astype(np.float32)
                    err = np.abs(o - ref).max() / np.abs(ref).max()
                    print("RUNS", tag, "rel err %.2e" % err, "OK" if err < 1e-2 else "WRONG")
                except Exception as e:
                    print("NO-RUN", tag, type(e).__name__, str(e).split("\n")[0][:200])


if __name__ == "__main__":
    main()
