"""Mosaic GPU operations for kernels that compute attention with the products transposed
(S^T = K q^T, O^T = V^T P^T: keys as wgmma's M, a block of query heads as its N), which pads
8 or 16 query heads where the q-major form pads 64 rows. ``mosaic_mla`` (MLA latent decode)
calls them; ``lab/mosaic_decode_t.py`` is the dense decode prototype they came from.

Why a separate object: the transposed operands need ``transpose_ref`` views and the
``WGMMA_TRANSPOSED`` store layout, which lower only in Mosaic's *lane* semantics (jax
0.10.2) and which the CPU's GPU interpret mode does not model; in interpret mode each call is
the plain jnp operation on the same refs, so one kernel body runs in both.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jfp8kv.kernels.mosaic_ops import MosaicOps

CHUNK = 128  # upcast / zeroing columns at a time (64 x 128: 64 values a thread)
SCALED_CHUNK = 64  # block-scaled upcast: whole 64-column tiles of the f16 tile and fp8 slot


class TransposedOps(MosaicOps):
    """``MosaicOps`` plus the transposed products and the P^T store; in interpret mode (no
    transposed views or layouts on the CPU) the plain jnp operations."""

    def qk_t(self, k16, q_s):
        """K [BK, D] . q^T (q_s [N, D]), both in shared memory -> f32 [BK, N]."""
        if self.interpret:
            return lax.dot_general(k16[...], q_s[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return self._wgmma((k16.shape[0], q_s.shape[0]), k16,
                           self.plgpu.transpose_ref(q_s, (1, 0)))

    def load_a(self, ref, dtype):
        """An 8-bit tile [64, D] in shared memory -> ``dtype`` registers in the WGMMA layout
        (wgmma's A operand from registers)."""
        if self.interpret:
            return ref[...].astype(dtype)
        return self.plgpu.load(ref, (), layout=self.wgmma).astype(dtype)

    def qk_t_regs(self, k_a, q_s):
        """K [BK, D] (registers, WGMMA layout) . q^T (q_s [N, D]) -> f32 [BK, N]."""
        if self.interpret:
            return lax.dot_general(k_a, q_s[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return self._wgmma((k_a.shape[0], q_s.shape[0]), k_a,
                           self.plgpu.transpose_ref(q_s, (1, 0)))

    def store_pt(self, p_s, pt16):
        """pt16 [BK, N] (registers, f16) -> p_s [N, BK] (shared memory) as its transpose."""
        if self.interpret:
            p_s[...] = pt16.T
            return
        plgpu = self.plgpu
        plgpu.transpose_ref(p_s, (1, 0))[...] = plgpu.layout_cast(
            pt16, plgpu.Layout.WGMMA_TRANSPOSED)

    def pv_t_into(self, acc, v16, p_s):
        """acc [D, N] + V^T (v16 [BK, D]) . P^T (p_s [N, BK]), accumulating in place."""
        if self.interpret:
            return acc + lax.dot_general(v16[...], p_s[...], (((0,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
        plgpu = self.plgpu

        def body(acc_ref):
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(v16, (1, 0)),
                        plgpu.transpose_ref(p_s, (1, 0)))

        return pl.run_state(body)(plgpu.ACC.init(acc))


class LatentOps(TransposedOps):
    """``TransposedOps`` plus S^T as two products into one accumulator."""

    def qk_t2(self, c_lat, q_lat, c_rope, q_rope):
        """C_lat [BK, r] . q_lat^T + C_rope [BK, d_r] . q_rope^T (q_* [N, *]) -> f32 [BK, N]."""
        if self.interpret:
            dn = (((1,), (1,)), ((), ()))
            return (lax.dot_general(c_lat[...], q_lat[...], dn,
                                    preferred_element_type=jnp.float32)
                    + lax.dot_general(c_rope[...], q_rope[...], dn,
                                      preferred_element_type=jnp.float32))
        plgpu = self.plgpu

        def body(acc_ref):
            plgpu.wgmma(acc_ref, c_lat, plgpu.transpose_ref(q_lat, (1, 0)))
            plgpu.wgmma(acc_ref, c_rope, plgpu.transpose_ref(q_rope, (1, 0)))
            return acc_ref[...]  # waits for both

        return pl.run_scoped(body, plgpu.ACC((c_lat.shape[0], q_lat.shape[0]), jnp.float32))

    def upcast_scaled(self, ref, scales, group0, block, valid_rows=None):
        """An fp8 tile [64, W] in shared memory (W a multiple of ``block``, the scale block)
        times its block scales (``scales`` [G, 64] f16 in shared memory, the tile's first
        column in group ``group0``) -> f16 registers, rows at or past ``valid_rows`` (if
        given) zero. Each group's [64] scales are broadcast over the tile and selected by
        column (Mosaic slices a tile only at whole 64-column tiles). The product is taken in
        f16: the exact product of two f16 values rounded once, as ``dequant_kv``'s f32
        product rounded to f16."""
        plgpu = self.plgpu
        if self.interpret:
            x = ref[...].astype(jnp.float16)
            load_sc = lambda g: scales[g]  # noqa: E731
            iota = lambda d: lax.broadcasted_iota(jnp.int32, x.shape, d)  # noqa: E731
        else:
            x = plgpu.load(ref, (), layout=self.wide).astype(jnp.float16)
            row_layout = self.wide.reduce(1)
            load_sc = lambda g: plgpu.load(scales.at[g], (), layout=row_layout)  # noqa: E731
            iota = lambda d: plgpu.broadcasted_iota(  # noqa: E731
                jnp.int32, x.shape, d, layout=self.wide)
        def bcast(g):  # the layout named right after: the broadcast's target
            return self.cast(lax.broadcast_in_dim(load_sc(g), x.shape, [0]), self.wide)

        sc = bcast(group0)
        if x.shape[1] > block:
            col = iota(1)
            for k in range(1, x.shape[1] // block):
                sc = jnp.where(col >= k * block, bcast(group0 + k), sc)
        x = x * sc
        if valid_rows is None:
            return x
        return jnp.where(iota(0) < valid_rows, x, jnp.zeros_like(x))

    def upcast_chunks(self, src, dst, valid_rows, *, dtype, scales=None, group0=0, block=0):
        """src [R, C] (shared memory) -> dst (``dtype``) in [R, CHUNK] column chunks (64 values
        a thread at a time at R = 64), rows at or past ``valid_rows`` (if given) zero. src
        may be dst (zeroing in place). ``scales`` [G, R] (fp8 block scales, G groups of
        ``block`` columns over the whole row, src's first column in group ``group0``): each
        [R, block] chunk times its group's scales (``upcast_scaled``)."""
        rows, width = src.shape
        if scales is not None:
            step = max(block, SCALED_CHUNK)
            for c0 in range(0, width, step):
                cols = (pl.ds(0, rows), pl.ds(c0, step))
                dst.at[cols][...] = self.upcast_scaled(src.at[cols], scales,
                                                       group0 + c0 // block, block, valid_rows)
            return
        for c0 in range(0, width, CHUNK):
            cols = (pl.ds(0, rows), pl.ds(c0, min(CHUNK, width - c0)))
            dst.at[cols][...] = self.upcast(src.at[cols], dtype, valid_rows)
