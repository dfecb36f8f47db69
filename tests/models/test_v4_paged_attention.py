"""``models.v4_paged_attention`` against the kernels' twins (``kernels.v4_paged_sparse`` /
``v4_paged_indexer``), on the kernel tests' random pools (``tests.kernels.
test_v4_paged_sparse``: shuffled page tables, rows of different lengths, a padding row,
every unread row and scale NaN), with blocks of 16 entries so that rows span several:

* ``csa_index`` (the top-k merged block by block, both backends) picks each query's
  entries of one top-k over all of them (``indexer_topk_reference`` with a cap over the
  whole table), ties included (all-zero keys: the lower entry index wins), k below and
  above a block, one query per sequence and a chunk's queries sharing their sequence's
  table;
* the jnp twins of ``decode`` and ``chunk`` (the "reference" backend: the ring read in
  place, the HCA walk a block at a time, query blocks) equal ``paged_sparse_decode_
  reference`` / ``paged_sparse_prefill_reference``, which gather the whole table.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import v4_paged_indexer as vpi
from jfp8kv.kernels import v4_paged_sparse as vps
from jfp8kv.models import v4_paged_attention as v4pa
from tests.kernels.test_v4_paged_sparse import (E, W, WIDTH, _decode_case, _indexer_case,
                                                _prefill_case)


def _sets(ids, pt, rows=None):
    got = vps.ids_to_entries(ids, pt, E, rows)
    return [set(r[r >= 0].tolist()) for r in got]


def test_block_size():
    assert [v4pa.block_size(4, n) for n in (1, 16, 17, 2048)] == [16, 16, 32, 2048]
    assert v4pa.block_size(1, 5) == 16 and v4pa.block_size(32, 100) == 128
    assert v4pa.block_size(12, 16) == 48  # whole pages, a multiple of 16


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
@pytest.mark.parametrize("k", [5, 20])
def test_csa_index_is_one_top_k_over_every_entry(backend, k):
    """One query per sequence (a decode step), then three per sequence of its own counts
    sharing the sequence's table (a chunk)."""
    rng = np.random.default_rng()
    n_ent = [0, 3, 17, 29, 32]
    zero = [rng.permutation(c)[:c // 2] for c in n_ent]  # half the keys zero: exact ties
    q, w, pool, poisoned, pt, n = _indexer_case(rng, n_ent, zero_rows=zero, positive_w=True)
    want = vpi.indexer_topk_reference(q, w, pool, pt, n, k, WIDTH * E)
    got = v4pa.csa_index(q[:, None], w[:, None], poisoned, pt, n[:, None], k, 16,
                         backend)[:, 0]
    assert got.shape == (5, k)
    assert _sets(got, pt) == _sets(want, pt)
    for row, c in zip(np.asarray(got), n_ent):
        assert (row >= 0).sum() == min(k, c) and (row[min(k, c):] == -1).all()
    # a chunk: sequences 2-4 with 3 queries each, seeing up to their sequence's count
    seqs = jnp.asarray([2, 3, 4])
    qc = jnp.asarray(rng.standard_normal((3, 3) + q.shape[1:]).astype(np.float32))
    wc = jnp.abs(jnp.asarray(rng.standard_normal((3, 3, w.shape[1])).astype(np.float32)))
    nc = jnp.asarray([[5, 16, 17], [0, 28, 29], [32, 31, 17]], jnp.int32)
    rows = jnp.repeat(jnp.arange(3), 3)
    want = vpi.indexer_topk_reference(qc.reshape(9, *q.shape[1:]), wc.reshape(9, -1), pool,
                                      pt[seqs], nc.reshape(-1), k, WIDTH * E, rows)
    got = v4pa.csa_index(qc, wc, poisoned, pt[seqs], nc, k, 16, backend).reshape(9, k)
    assert _sets(got, pt[seqs], rows) == _sets(want, pt[seqs], rows)


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("entries", ["none", "index", "table"])
def test_decode_twin_reads_blocks(storage, entries):
    rng = np.random.default_rng()
    clean, poisoned, kw = _decode_case(rng, storage, entries)
    scale = 64 ** -0.5
    want = vps.paged_sparse_decode_reference(*clean, scale, **kw)
    q, win, ws, slots, pos, comp, cs, sinks = poisoned
    got = v4pa.decode(q, win, ws, slots, pos, sinks, scale, comp=comp, comp_scale=cs,
                      block=16, backend="reference", **kw)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("entries", ["index", "table"])
def test_chunk_twin_reads_blocks(storage, entries):
    rng = np.random.default_rng()
    clean, poisoned, kwc, kwp, _, _, _ = _prefill_case(rng, entries, storage, t=6, ratio=1)
    scale = 64 ** -0.5
    want = vps.paged_sparse_prefill_reference(*clean, scale, W, **kwc)
    q, keys, positions, sinks = poisoned
    for query_block in (None, 3):
        got = v4pa.chunk(q, keys, positions, positions[:, 0], sinks, scale, W, block=16,
                         backend="reference", query_block=query_block, **kwp)
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
