"""Grouped matmul (``jax.lax.ragged_dot``'s meaning) on the Pallas Triton backend.

XLA on NVIDIA GPUs lowers ``ragged_dot`` to a dense dot over every expert for every row
(E times the useful FLOPs). This kernel does only the useful work:

* Each group's row segment is cut into row tiles of ``tm`` rows; a group's last tile may
  be partial (its missing rows are masked), so every tile belongs to exactly one group.
  The number of tiles has a static bound ``T = (M + min(E + 1, M) * (tm - 1)) // tm``.
* Plain jnp builds, from ``group_sizes``, an int32 group id per tile and an int32 source
  row per tile row (-1 for a padding row). Tiles past the last group get id -1 and do
  nothing. Rows past ``sum(group_sizes)`` form one extra segment (id E) whose tiles write
  zeros, as ``ragged_dot`` gives for them, so the kernel writes every output row and no
  jnp pass over the output follows.
* Grid ``(T, cdiv(N, tn))`` (``columns_inner``: ``(cdiv(N, tn), T)``, so the column
  programs of one row tile launch side by side): a program loads its tile's group id and
  rows, gathers the lhs rows, loops over K in chunks of ``tk`` reading
  ``rhs[g, k0:k0+tk, n0:n0+tn]``, accumulates in f32 (IEEE f32 dots for f32 operands) and
  scatters the ``[tm, tn]`` tile to its rows.
* K and N need not be multiples of ``tk`` / ``tn``: the edge chunks are masked (loads
  give 0 past K; stores skip columns past N). ``tm``, ``tn``, ``tk`` are powers of two
  >= 16 (Triton's dot); a padding row reads row 0 and is never stored.

Contract: lhs [M, K], rhs [E, K, N], group_sizes int32[E] (group g owns rows
``[sum(sizes[:g]), sum(sizes[:g+1]))``; a sum past M is clipped to M) -> [M, N] in
``preferred_element_type`` (default: the operands' common dtype). Each output element is a
sum of K products in f32 (f32 inputs: equal to ragged_dot up to summation order; bf16/f16
inputs: products exact, one rounding to the output dtype).

Interpret mode scatters padding rows to ``tm`` spill rows past M (the emulated masked
scatter would otherwise race on row 0) that are sliced away; on the GPU they are masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.kernels.tiles import Launch, check_dot_tile, dot_nn, next_pow2


@dataclasses.dataclass(frozen=True)
class GmmTuning(Launch):
    """The launch knobs plus the tile: ``tm`` rows (0: from the rows per group), ``tn``
    output columns, ``tk`` reduction steps. ``columns_inner``: the grid's fast axis walks
    the output columns, so the programs running at once read whole rows of one expert's
    weights and share its gathered lhs rows (else it walks the row tiles, i.e. experts)."""

    tm: int = 0
    tn: int = 128
    tk: int = 64
    columns_inner: bool = False


def choose_tm(m: int, num_groups: int) -> int:
    """16 rows for decode-sized batches (little padding), up to 64 for prefill."""
    per_group = max(1, -(-m // max(1, num_groups)))
    return min(64, max(16, next_pow2(per_group)))


# Rows per group from which the grid walks the columns inner (``columns_inner``), through
# COLUMNS_INNER_MAX: a launch that streams every expert's weights for a few row tiles each.
# Measured on an H100 (bench/results/gmm-v4-sweep-h100.json, DeepSeek-V4-Flash's experts,
# E 256): 1.06-1.08x at 12 rows per expert, 1.31-1.34x at 48. Other models' launches in
# the range (Qwen3-MoE decode batches of 128-512 rows: 8-32 rows for each of 128 experts)
# take it too, unmeasured until `bench.gmm_tuning --preset qwen3-moe` runs on a GPU.
COLUMNS_INNER_MIN, COLUMNS_INNER_MAX = 8, 64


def choose_tuning(m: int, num_groups: int, k: int, n: int) -> GmmTuning:
    """The tuning ``gmm`` runs without one: rows per tile from ``choose_tm``, and the columns
    inner where the rows per group lie in the measured range above. Takes the whole shape so
    a rule measured per shape (``bench.gmm_tuning``) can refine it; ``k`` and ``n`` do not
    change the choice yet."""
    del k, n
    per_group = m / max(1, num_groups)
    return GmmTuning(tm=choose_tm(m, num_groups),
                     columns_inner=COLUMNS_INNER_MIN <= per_group <= COLUMNS_INNER_MAX)


def num_tiles(m: int, num_groups: int, tm: int) -> int:
    """Static bound on row tiles: every non-empty segment (E groups + the zero tail) adds
    at most ``tm - 1`` padding rows."""
    return (m + min(num_groups + 1, m) * (tm - 1)) // tm


def tile_maps(group_sizes, m: int, tm: int):
    """(tile group id int32[T], source row int32[T * tm]) for ``num_tiles`` tiles.

    Group id -1: a tile past the end (skipped); E: the zero tail (rows past the groups'
    sum). Source row -1: a padding row of a partial tile.
    """
    e = group_sizes.shape[0]
    t = num_tiles(m, e, tm)
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])  # + the zero tail
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    tile_end = jnp.cumsum((sizes + tm - 1) // tm)
    tile_start = tile_end - (sizes + tm - 1) // tm
    tiles = jnp.arange(t, dtype=jnp.int32)
    g = jnp.searchsorted(tile_end, tiles, side="right").astype(jnp.int32)
    tile_group = jnp.where(g <= e, g, -1)
    p = jnp.arange(t * tm, dtype=jnp.int32)
    pg = jnp.clip(tile_group[p // tm], 0, e)
    local = (p // tm - tile_start[pg]) * tm + p % tm
    ok = (tile_group[p // tm] >= 0) & (local < sizes[pg])
    return tile_group, jnp.where(ok, starts[pg] + local, -1)


def _gmm_kernel(group_ref, rows_ref, lhs_ref, rhs_ref, out_ref, *, tm, tn, tk, num_groups,
                spill, columns_inner):
    # group_ref int32[T]; rows_ref int32[T * tm]; lhs_ref [M, K]; rhs_ref [E, K, N];
    # out_ref [M (+ tm spill rows in interpret mode), N]
    t, j = pl.program_id(0), pl.program_id(1)
    if columns_inner:
        t, j = j, t
    k_total, n_total = rhs_ref.shape[1], rhs_ref.shape[2]
    g = group_ref[t]
    rows = rows_ref[pl.ds(t * tm, tm)]
    row_ok = rows >= 0
    n_idx = j * tn + jnp.arange(tn, dtype=jnp.int32)
    n_ok = n_idx < n_total
    n_mask = None if n_total % tn == 0 else n_ok[None, :]
    src = jnp.maximum(rows, 0)
    ge = jnp.minimum(g, num_groups - 1)
    # No K loop for the zero tail (g == E) or a tile past the end (g == -1).
    n_iter = ((g >= 0) & (g < num_groups)).astype(jnp.int32) * pl.cdiv(k_total, tk)

    def body(i, acc):
        k_idx = i * tk + jnp.arange(tk, dtype=jnp.int32)
        a_mask, b_mask = None, n_mask
        if k_total % tk:
            a_mask = jnp.broadcast_to(k_idx[None, :] < k_total, (tm, tk))
            b_mask = k_idx[:, None] < k_total
            b_mask = b_mask if n_mask is None else b_mask & n_mask
        b_mask = None if b_mask is None else jnp.broadcast_to(b_mask, (tk, tn))
        a = plgpu.load(lhs_ref.at[src[:, None], k_idx[None, :]], mask=a_mask,
                       other=None if a_mask is None else 0)
        b = plgpu.load(rhs_ref.at[ge, pl.ds(i * tk, tk), pl.ds(j * tn, tn)], mask=b_mask,
                       other=None if b_mask is None else 0)
        return acc + dot_nn(a, b)

    acc = jax.lax.fori_loop(0, n_iter, body, jnp.zeros((tm, tn), jnp.float32))
    dst = jnp.where(row_ok, rows, spill + jnp.arange(tm, dtype=jnp.int32))

    @pl.when(g >= 0)
    def _store():
        plgpu.store(out_ref.at[dst[:, None], n_idx[None, :]], acc.astype(out_ref.dtype),
                    mask=row_ok[:, None] & n_ok[None, :])


@functools.partial(jax.jit,
                   static_argnames=("preferred_element_type", "tuning", "interpret"))
def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None,
        tuning: GmmTuning | None = None, interpret: bool = False):
    """lhs [M, K] x rhs [E, K, N] grouped by ``group_sizes`` int32[E] -> [M, N]
    (``jax.lax.ragged_dot``'s meaning; see the module docstring). Static: the dtype,
    tuning (None: ``choose_tuning`` of the shape) and interpret."""
    (m, k), (e, k2, n) = lhs.shape, rhs.shape
    if k != k2 or group_sizes.shape != (e,):
        raise ValueError(f"gmm needs lhs [M, K], rhs [E, K, N], group_sizes [E]; got "
                         f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
    tuning = tuning or choose_tuning(m, e, k, n)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    out_dtype = jnp.dtype(preferred_element_type or dtype)
    if min(m, n, k, e) == 0:
        return jnp.zeros((m, n), out_dtype)
    tm = tuning.tm or choose_tm(m, e)
    for name, v in (("tm", tm), ("tn", tuning.tn), ("tk", tuning.tk)):
        check_dot_tile(f"gmm tile {name}", v)
    tile_group, rows = tile_maps(group_sizes, m, tm)
    spill = m if interpret else 0
    kernel = functools.partial(_gmm_kernel, tm=tm, tn=tuning.tn, tk=tuning.tk,
                               num_groups=e, spill=spill, columns_inner=tuning.columns_inner)
    grid = (tile_group.shape[0], pl.cdiv(n, tuning.tn))
    out = pl.pallas_call(
        kernel,
        grid=grid[::-1] if tuning.columns_inner else grid,
        out_shape=jax.ShapeDtypeStruct((m + (tm if interpret else 0), n), out_dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
        name="jfp8kv_gmm",
    )(tile_group, rows, lhs.astype(dtype), rhs.astype(dtype))
    return out[:m] if interpret else out
