"""DeepSeek-V4 kernels that read the pools in place (``kernels.v4_paged_sparse``,
``v4_paged_indexer``), Pallas Triton in interpret mode on the CPU, against their jnp twins,
the twins against a float64 numpy computation written from the contract (and the chunk twin
against the model's ``v4_attention.blocked_attention``), and the indexer's selection
against the model's ``v4_attention.indexer_select``, ties included.

Every case draws fresh random pools, shuffled page tables wider than any row needs, and rows
of different lengths (a padding row at position -1, a row inside its first window, one whose
ring wrapped, entries spanning several pages). Every pool row and scale no query may read is
NaN (window rows of other slots or positions, compressed and indexer rows no index or walk
names), and interpret mode pre-fills the outputs with NaN, so a kernel that reads a wrong row
or leaves an output unwritten fails."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import v4_paged_indexer as vpi
from jfp8kv.kernels import v4_paged_sparse as vps
from jfp8kv.kvcache import v4_pools
from jfp8kv.models import v4_attention as va
from jfp8kv.models.v4_presets import v4_config

W, E, SLOTS, PAGES, WIDTH = 6, 4, 9, 40, 8  # window, entries per page, table width (pages)


def _nan(x):
    return jnp.asarray(np.float32(np.nan)).astype(x.dtype)


def _poison(a, keep):
    """a [..., D] with rows where ~keep set to NaN (None stays None)."""
    if a is None:
        return None
    return jnp.where(jnp.asarray(keep)[..., None], a, _nan(a))


def _tables(rng, n_pages_needed, width=WIDTH):
    """Page tables [B, width]: distinct random pages (1..PAGES-1) for the pages each row
    needs, the rest page 0 or unused pages (both NaN: nothing past a row's count is read)."""
    free = list(rng.permutation(np.arange(1, PAGES)))
    pt = np.zeros((len(n_pages_needed), width), np.int32)
    for b, n in enumerate(n_pages_needed):
        for c in range(n):
            pt[b, c] = free.pop()
    spare = free[:3]
    pt[:, -1] = np.where(pt[:, -1] == 0, spare[0], pt[:, -1])  # an unused page past the end
    return pt


def _pool(rng, lead, d, storage, scale=3.0):
    x = rng.standard_normal(lead + (d,)).astype(np.float32) * scale
    return v4_pools.store_rows(jnp.asarray(x), storage)


POS = np.array([-1, 0, 3, 5, 37, 22], np.int32)  # padding, first row, partial, full, wrapped


def _decode_case(rng, storage, entries, ratio=2, k=7, h=5, d=64):
    """(clean args, poisoned args, kwargs) for paged_sparse_decode."""
    b = len(POS)
    slots = rng.permutation(np.arange(1, SLOTS))[:b].astype(np.int32)
    slots[0] = 0  # the padding row reads the sink slot
    q = jnp.asarray(rng.standard_normal((b, h, d)).astype(np.float32))
    sinks = jnp.asarray(rng.standard_normal(h).astype(np.float32))
    win, ws = _pool(rng, (SLOTS, W), d, storage)
    seen_w = np.zeros((SLOTS, W), bool)
    for s, p in zip(slots, POS):
        seen_w[s, :max(0, min(p + 1, W))] = True
    comp, cs = _pool(rng, (PAGES, E), d, storage)
    n_ent = np.maximum((POS + 1) // ratio, 0)
    pt = _tables(rng, [-(-n // E) for n in n_ent])
    flat = pt[:, :, None] * E + np.arange(E)  # [B, WIDTH, E] flat id of entry c*E + j
    flat = flat.reshape(b, -1)
    seen_c = np.zeros(PAGES * E, bool)
    kw = {}
    if entries == "index":
        idx = np.full((b, k), -1, np.int32)
        for r in range(b):
            vis = rng.permutation(n_ent[r])[:k]
            slots_k = rng.permutation(k)[:len(vis)]  # -1 scattered between them
            idx[r, slots_k] = flat[r, vis]
        idx[3, :] = -1  # a row with entries visible but none chosen
        seen_c[idx[idx >= 0]] = True
        kw["idx"] = jnp.asarray(idx)
    elif entries == "table":
        for r in range(b):
            seen_c[flat[r, :n_ent[r]]] = True
        kw.update(page_tables=jnp.asarray(pt), ratio=ratio)
    else:
        comp = cs = None
    seen_c = seen_c.reshape(PAGES, E)
    clean = (q, win, ws, jnp.asarray(slots), jnp.asarray(POS), comp, cs, sinks)
    poisoned = (q, _poison(win, seen_w), _poison(ws, seen_w), clean[3], clean[4],
                None if comp is None else _poison(comp, seen_c),
                None if cs is None else _poison(cs, seen_c), sinks)
    return clean, poisoned, kw


def _float64_decode(q, win, ws, slots, pos, comp, cs, sinks, scale, idx=None,
                    page_tables=None, ratio=None):
    """The contract in float64 numpy, position by position (no ring arithmetic shared)."""
    def deq(x, s):
        x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
        if s is None:
            return x
        return x * np.repeat(np.asarray(jnp.asarray(s).astype(jnp.float32), np.float64), 32, -1)

    wv = deq(win, ws)
    cv = None if comp is None else deq(comp, cs).reshape(-1, q.shape[-1])
    out = np.zeros(q.shape, np.float64)
    for b in range(q.shape[0]):
        p = int(pos[b])
        rows = [wv[int(slots[b]), j % W] for j in range(max(0, p - W + 1), p + 1)]
        if idx is not None:
            rows += [cv[i] for i in np.asarray(idx[b]) if i >= 0]
        elif page_tables is not None:
            pt = np.asarray(page_tables[b])
            rows += [cv[pt[e // E] * E + e % E] for e in range(max(0, (p + 1) // ratio))]
        for h in range(q.shape[1]):
            logits = [np.dot(np.float64(q[b, h]), r) * scale for r in rows] + [float(sinks[h])]
            e = np.exp(np.array(logits) - max(logits))
            out[b, h] = sum(pi * r for pi, r in zip(e[:-1] / e.sum(), rows)) if rows else 0.0
    return out


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("entries", ["none", "index", "table"])
def test_paged_sparse_decode(storage, entries):
    rng = np.random.default_rng()
    clean, poisoned, kw = _decode_case(rng, storage, entries)
    scale = 64 ** -0.5
    ref = vps.paged_sparse_decode_reference(*clean, scale, **kw)
    np.testing.assert_allclose(ref, _float64_decode(*clean, scale, **kw), rtol=1e-5,
                               atol=1e-5)
    assert np.isnan(np.asarray(poisoned[1].astype(jnp.float32))).any()
    if poisoned[5] is not None:
        assert np.isnan(np.asarray(poisoned[5].astype(jnp.float32))).any()
    for tile, hb in ((16, 16), (32, 16)):  # one tile per source and several (37 > 16)
        got = vps.paged_sparse_decode(*poisoned, scale, **kw, interpret=True, tile=tile,
                                      head_block=hb)
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ref[0]), 0.0)  # the padding row sees nothing


def test_decode_walk_ignores_table_width():
    """The same rows through a table 8x wider (its extra columns on NaN pages) give the
    same output bit for bit: the walk never reads past a row's closed entries."""
    rng = np.random.default_rng()
    clean, poisoned, kw = _decode_case(rng, "float8_e4m3fn", "table")
    pt = np.asarray(kw["page_tables"])
    wide = np.concatenate([pt, np.zeros((pt.shape[0], 7 * pt.shape[1]), np.int32)], 1)
    a = vps.paged_sparse_decode(*poisoned, 0.125, **kw, interpret=True)
    b = vps.paged_sparse_decode(*poisoned, 0.125, page_tables=jnp.asarray(wide),
                                ratio=kw["ratio"], interpret=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decode_argument_errors():
    rng = np.random.default_rng(0)
    clean, _, kw = _decode_case(rng, "bfloat16", "table")
    with pytest.raises(ValueError, match="exactly one"):
        vps.paged_sparse_decode(*clean, 0.125, interpret=True)
    with pytest.raises(ValueError, match="ratio"):
        vps.paged_sparse_decode(*clean, 0.125, page_tables=kw["page_tables"], interpret=True)
    fp8 = _decode_case(rng, "float8_e4m3fn", "none")[0]
    with pytest.raises(ValueError, match="block scales"):
        vps.paged_sparse_decode(fp8[0], fp8[1], None, *fp8[3:], 0.125, interpret=True)


# ------------------------------------------------------------------ chunks (prefill)


def _prefill_case(rng, entries, storage, t=5, ratio=2, k=4, h=5, d=64):
    p0 = np.array([0, 9, -1], np.int32)  # a fresh row, a continuing one, a padding row
    b, r = len(p0), W - 1
    positions = np.where(p0[:, None] >= 0, p0[:, None] + np.arange(t)[None], -1)
    keys = rng.standard_normal((b, r + t, d)).astype(np.float32) * 3
    key_pos = p0[:, None] - r + np.arange(r + t)[None]
    seen = (key_pos >= 0) & (p0[:, None] >= 0)  # rows before a sequence start: never seen
    q = jnp.asarray(rng.standard_normal((b, t, h, d)).astype(np.float32))
    sinks = jnp.asarray(rng.standard_normal(h).astype(np.float32))
    comp, cs = _pool(rng, (PAGES, E), d, storage)
    n_ent = np.maximum((positions + 1) // ratio, 0)  # [B, T]
    pt = _tables(rng, [-(-int(n.max()) // E) for n in n_ent])
    flat = (pt[:, :, None] * E + np.arange(E)).reshape(b, -1)
    seen_c = np.zeros(PAGES * E, bool)
    kw, pick = {}, None
    if entries == "index":
        idx = np.full((b, t, k), -1, np.int32)
        chosen = np.zeros((b, t, flat.shape[1]), bool)
        for i in range(b):
            for j in range(t):
                vis = rng.permutation(n_ent[i, j])[:k]
                idx[i, j, :len(vis)] = flat[i, vis]
                chosen[i, j, vis] = True
        seen_c[idx[idx >= 0]] = True
        kw["idx"] = jnp.asarray(idx)
        pick = jnp.asarray(chosen)
    else:
        for i in range(b):
            seen_c[flat[i, :n_ent[i].max()]] = True
        kw.update(page_tables=jnp.asarray(pt), ratio=ratio)
    seen_c = seen_c.reshape(PAGES, E)
    clean = (q, jnp.asarray(keys), jnp.asarray(positions), sinks)
    poisoned = (q, _poison(jnp.asarray(keys), seen), clean[2], sinks)
    kw_clean = dict(kw, comp=comp, comp_scale=cs)
    kw_poisoned = dict(kw, comp=_poison(comp, seen_c), comp_scale=_poison(cs, seen_c))
    dense = vps.gather_entries(comp, cs, jnp.asarray(flat))  # [B, WIDTH*E, D], the model's
    return clean, poisoned, kw_clean, kw_poisoned, dense, pick, ratio


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("entries", ["index", "table"])
def test_paged_sparse_prefill(storage, entries):
    rng = np.random.default_rng()
    clean, poisoned, kwc, kwp, dense, pick, ratio = _prefill_case(rng, entries, storage)
    scale = 64 ** -0.5
    ref = vps.paged_sparse_prefill_reference(*clean, scale, W, **kwc)
    # The model's chunk attention over the dense entries (real rows only: row 2 is padding)
    q, keys, positions, sinks = clean
    pick_fn = ((lambda x: va.visible_entries(x["positions"], dense.shape[1], ratio))
               if pick is None else (lambda x: x["pick"]))
    model = va.blocked_attention(q, positions, keys, dense, pick_fn,
                                 {} if pick is None else {"pick": pick}, sinks, W)
    # (blocked_attention scales logits by head_dim ** -0.5, which is ``scale`` here)
    np.testing.assert_allclose(np.asarray(ref[:2]), np.asarray(model[:2]), rtol=1e-5,
                               atol=1e-5)
    got = vps.paged_sparse_prefill(*poisoned, scale, W, **kwp, interpret=True)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_csa_chunk_matches_model(storage):
    """A CSA chunk end to end in place: each query's index list from the indexer pool
    (``chunk_topk``), then ``paged_sparse_prefill``, equals the model's chunk attention
    (``blocked_attention`` with ``indexer_select`` over the dense entries)."""
    rng = np.random.default_rng()
    clean, poisoned, kwc, kwp, dense, _, m = _prefill_case(rng, "table", storage)
    q, keys, positions, sinks = clean
    pt = kwc["page_tables"]
    b, t = positions.shape
    k, hi, di = 3, 16, 32
    ikeys = jnp.asarray(rng.standard_normal((PAGES, E, di)), jnp.bfloat16)
    iq = jnp.asarray(rng.standard_normal((b, t, hi, di)).astype(np.float32))
    iw = jnp.asarray(rng.standard_normal((b, t, hi)).astype(np.float32))
    cap = vps.entry_cap(int(np.asarray(positions).max() + 1) // m, 16)
    idx = vpi.chunk_topk(iq, iw, ikeys, pt, positions, m, k, cap, interpret=True,
                         key_tile=16)
    got = vps.paged_sparse_prefill(*poisoned, 64 ** -0.5, W, comp=kwp["comp"],
                                   comp_scale=kwp["comp_scale"], idx=idx, interpret=True)
    width = pt.shape[1] * E
    flat = vps.entry_ids(pt, jnp.full((b,), width), E, width)
    dense_i = ikeys.reshape(-1, di)[flat].astype(jnp.float32)
    cfg = _model_cfg(k, m)
    model = va.blocked_attention(
        q, positions, keys, dense,
        lambda x: va.indexer_select(x["iq"], x["iw"], x["positions"], dense_i, cfg),
        {"iq": iq, "iw": iw}, sinks, W)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got[:2]), np.asarray(model[:2]), rtol=1e-5,
                               atol=1e-5)


# ------------------------------------------------------------------ indexer and top-k


def _indexer_case(rng, n_ent, hi=16, di=32, width=WIDTH, zero_rows=None, positive_w=False):
    """(q, w, clean keys pool, poisoned pool, page tables, n_entries)."""
    n = len(n_ent)
    keys = rng.standard_normal((PAGES, E, di)).astype(np.float32)
    pt = _tables(rng, [-(-int(c) // E) for c in n_ent], width)
    flat = (pt[:, :, None] * E + np.arange(E)).reshape(n, -1)
    if zero_rows is not None:  # entries whose key is all zeros: scores exactly 0, ties
        for i, z in enumerate(zero_rows):
            keys.reshape(-1, di)[flat[i, z]] = 0.0
    seen = np.zeros(PAGES * E, bool)
    for i, c in enumerate(n_ent):
        seen[flat[i, :c]] = True
    pool = jnp.asarray(keys, jnp.bfloat16)
    poisoned = _poison(pool, seen.reshape(PAGES, E))
    q = rng.standard_normal((n, hi, di)).astype(np.float32)
    w = rng.standard_normal((n, hi)).astype(np.float32)
    if positive_w:
        w = np.abs(w) + 0.1
    return (jnp.asarray(q), jnp.asarray(w), pool, poisoned, jnp.asarray(pt),
            jnp.asarray(np.asarray(n_ent, np.int32)))


def test_paged_indexer_scores():
    rng = np.random.default_rng()
    q, w, pool, poisoned, pt, n_ent = _indexer_case(rng, [0, 1, E - 1, 17, 29])
    cap = 32
    ref = vpi.paged_indexer_scores_reference(q, w, pool, pt, n_ent, cap)
    # float64 from the contract
    k64 = np.asarray(pool.astype(jnp.float32), np.float64).reshape(-1, pool.shape[-1])
    for i, c in enumerate(np.asarray(n_ent)):
        row = np.asarray(pt[i])
        for e in range(cap):
            if e >= c:
                assert ref[i, e] == -np.inf
                continue
            s = np.maximum(np.asarray(q[i], np.float64) @ k64[row[e // E] * E + e % E], 0)
            np.testing.assert_allclose(ref[i, e], s @ np.asarray(w[i], np.float64),
                                       rtol=1e-5, atol=1e-5)
    for tile in (16, 32):  # several programs per row (some past its count), one
        got = vpi.paged_indexer_scores(q, w, poisoned, pt, n_ent, cap, interpret=True,
                                       key_tile=tile)
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)  # -inf where ref is
    # query rows naming their table row (a chunk's queries share their sequence's row)
    rev = jnp.arange(pt.shape[0])[::-1]
    got = vpi.paged_indexer_scores(q, w, poisoned, pt[rev], n_ent, cap, rev, interpret=True,
                                   key_tile=16)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vpi.paged_indexer_scores_reference(q, w, pool, pt[rev], n_ent,
                                                                  cap, rev), ref, rtol=1e-6)


def _model_cfg(k: int, m: int):
    cfg = v4_config("deepseek-v4-tiny")
    return dataclasses.replace(cfg, v4=dataclasses.replace(cfg.v4, index_topk=k, csa_ratio=m))


def _model_choice(q, w, pool, pt, n_ent, m, k):
    """The model's choice (``va.indexer_select``) per row as a set of entry indices, over
    the row's dense entries (its whole table, as the engine gathers them today)."""
    cap = pt.shape[1] * E
    ids = vps.entry_ids(pt, jnp.full_like(n_ent, cap), E, cap)
    dense = pool.reshape(-1, pool.shape[-1])[ids].astype(jnp.float32)
    positions = (n_ent * m + m - 2)[:, None]  # (p + 1) // m = n_ent: sees exactly those
    chosen = va.indexer_select(q[:, None], w[:, None], positions, dense, _model_cfg(k, m))
    return [set(np.flatnonzero(c[0]).tolist()) for c in np.asarray(chosen)]


def _sets(ids, pt):
    got = vps.ids_to_entries(ids, pt, E)
    return [set(r[r >= 0].tolist()) for r in got]


@pytest.mark.parametrize("k", [5, 12])
def test_indexer_topk_matches_model(k):
    """The kernel's ids (through the table) name the entries the model's selection picks;
    k > a row's count takes all of it, -1 after."""
    rng = np.random.default_rng()
    q, w, pool, poisoned, pt, n_ent = _indexer_case(rng, [0, 3, 9, 23, 31])
    m, cap = 4, 32
    want = _model_choice(q, w, pool, pt, n_ent, m, k)
    ref = vpi.indexer_topk_reference(q, w, pool, pt, n_ent, k, cap)
    got = vpi.indexer_topk(q, w, poisoned, pt, n_ent, k, cap, interpret=True, key_tile=16)
    assert got.shape == (5, k)
    assert _sets(ref, pt) == want
    assert _sets(got, pt) == want
    for row, c in zip(np.asarray(got), np.asarray(n_ent)):
        assert (row >= 0).sum() == min(k, c)
        assert (row[min(k, c):] == -1).all()


def test_indexer_topk_ties():
    """Entries with all-zero keys score exactly 0 (positive head weights: no -0.0) and tie;
    the k-th place falls among them, and the lower entry indices win, as in the model."""
    rng = np.random.default_rng()
    n_ent = [20, 27, 12]
    zero = [rng.permutation(c)[:c - 5] for c in n_ent]  # 5 entries with real keys each
    q, w, pool, poisoned, pt, n_ent = _indexer_case(rng, n_ent, zero_rows=zero,
                                                    positive_w=True)
    m, k, cap = 4, 9, 32
    want = _model_choice(q, w, pool, pt, n_ent, m, k)
    got = _sets(vpi.indexer_topk(q, w, poisoned, pt, n_ent, k, cap, interpret=True), pt)
    assert got == want
    for row, z in zip(got, zero):
        ties = sorted(set(z.tolist()))
        assert sorted(row & set(ties)) == ties[:k - (len(row) - len(row & set(ties)))]
    # The rule on its own: equal scores, lower index first
    s = jnp.asarray([[3.0, 1.0, 3.0, 3.0, 2.0, -jnp.inf]])
    got = vpi.topk_entries(s, jnp.arange(2)[None], 3, 2)
    np.testing.assert_array_equal(np.asarray(got), [[0, 2]])
    np.testing.assert_array_equal(np.asarray(vpi.topk_entries(s, jnp.arange(2)[None], 3, 7)),
                                  [[0, 2, 3, 4, 1, -1, -1]])


def test_entry_helpers():
    pt = jnp.asarray([[5, 2, 7], [3, 0, 0]], jnp.int32)
    ids = vps.entry_ids(pt, jnp.asarray([6, 1]), 4, 8)
    np.testing.assert_array_equal(np.asarray(ids), [[20, 21, 22, 23, 8, 9, -1, -1],
                                                    [12, -1, -1, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(vps.ids_to_entries(ids, pt, 4),
                                  [[0, 1, 2, 3, 4, 5, -1, -1], [0] + [-1] * 7])
    assert [vps.entry_cap(n) for n in (0, 64, 65, 1000)] == [64, 64, 128, 1024]
    assert vps.entry_cap(3, 5) == 16  # the smallest tile the indexer kernel takes
    np.testing.assert_array_equal(np.asarray(vps.closed_entries(jnp.asarray([-1, 2, 3, 7]),
                                                                4)), [0, 0, 1, 2])


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_kernels_lower_for_cuda(storage):
    """Every kernel lowers for a GPU through Triton on this machine (interpret mode cannot
    see Triton's refusals, e.g. a masked fp8 load with an integer ``other``)."""
    rng = np.random.default_rng(0)
    for entries in ("none", "index", "table"):
        clean, _, kw = _decode_case(rng, storage, entries)
        jax.jit(lambda *a, kw=kw: vps.paged_sparse_decode(*a, 0.125, **kw)).trace(
            *clean).lower(lowering_platforms=("cuda",))
    c, _, kwc, _, _, _, _ = _prefill_case(rng, "table", storage)
    jax.jit(lambda *a: vps.paged_sparse_prefill(*a, 0.125, W, **kwc)).trace(*c).lower(
        lowering_platforms=("cuda",))
    q, w, pool, _, pt, n_ent = _indexer_case(rng, [3, 9])
    jax.jit(lambda *a: vpi.indexer_topk(*a, 8, 64)).trace(q, w, pool, pt, n_ent).lower(
        lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_paged_kernels_native(storage):
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs an NVIDIA GPU")
    rng = np.random.default_rng()
    for entries in ("none", "index", "table"):
        clean, poisoned, kw = _decode_case(rng, storage, entries)
        ref = vps.paged_sparse_decode_reference(*clean, 0.125, **kw)
        got = vps.paged_sparse_decode(*poisoned, 0.125, **kw)
        # tf32 products on the GPU, as ``v4_sparse``'s native test
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-2, atol=1e-2)
    for entries in ("index", "table"):
        clean, poisoned, kwc, kwp, *_ = _prefill_case(rng, entries, storage)
        ref = vps.paged_sparse_prefill_reference(*clean, 0.125, W, **kwc)
        got = vps.paged_sparse_prefill(*poisoned, 0.125, W, **kwp)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-2, atol=1e-2)
    q, w, pool, poisoned, pt, n_ent = _indexer_case(rng, [0, 3, 9, 23, 31])
    ref = vpi.paged_indexer_scores_reference(q, w, pool, pt, n_ent, 64)
    got = vpi.paged_indexer_scores(q, w, poisoned, pt, n_ent, 64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-2, atol=1e-2)
