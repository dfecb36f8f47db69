"""DeepSeek-V4 decode kernels (``jfp8kv.kernels.v4_sparse``, ``v4_paged_sparse``,
``v4_paged_indexer``) and pool capacity, one GPU.

    python -m bench.v4_kernels --out bench/results/v4-kernels-h200.json
    python -m bench.v4_kernels --smoke          # tiny shapes, interpret mode (CPU)
    python -m bench.v4_kernels --paged --out bench/results/v4-paged-decode-h100.json
    python -m bench.v4_kernels --paged --smoke  # the same on deepseek-v4-tiny, interpret

``--paged`` (issue 57) times one decode step's attention, side by side in one process, of
``random:deepseek-v4-flash-4l``'s layers (window, window, CSA, HCA: 64 heads x 512, window
128, CSA 4:1 top-512 with a 64 x 128 indexer, HCA 128:1, pages of 128 tokens) at batch 32:

* ``gather``: the engine's path before it read the pools in place (issue 57): every
  window row and every entry of a row's page table gathered densely and dequantized
  (``_dense_entries`` here, the ring gather as ``models.v4_paged._rows``), the indexer
  over all of them (``v4_attention.indexer_select`` with the ``indexer_scores`` kernel),
  then ``deepseek_v4._decode_kernel`` (``sparse_decode``); kept as the baseline;
* ``in_place``: what the engine runs now: ``paged_sparse_decode`` on the window ring, the
  CSA index list from ``models.v4_paged_attention.csa_index`` (exact top-k merged over
  blocks of ``INDEX_BLOCK`` entries scored in place by ``paged_indexer_scores``: no static
  cap), the HCA page-table walk;

for bf16 and fp8 (e4m3 + per-32 fp16 scales) pools, at contexts 4k, 16k, 64k and 128k
tokens per row (page tables exactly as wide as the context), and for 4k-token rows with
page tables of 8,192 and 1,048,576 tokens (work must not follow the width). Per record: the
median ms of each layer kind (4 dependent calls per timed call) and the step (2 x window +
CSA + HCA), the in-place CSA index list alone, the bytes of rows + scales + indexer keys a
step must read once and the implied TB/s, the max |error| of each in-place kind against its
jnp twin and the CSA top-k's agreement with the twin's selection (at the first and last
context and the width cases: each check compiles the twins once more), and the
ratios the issue asks for (``summary``). Last, at 64k fp8, the in-place layers are timed
again under four other launch settings of ``paged_sparse_decode`` (``launches``: tile,
head_block, num_warps, num_stages). Rows are random, pages shuffled across the pool. No case
starts after ``--time-limit`` seconds (recorded as skipped), so a run cut short keeps JSON.

Without ``--paged``, what it answers, at DeepSeek-V4-Flash's attention shapes (64 heads x
512 dims, window 128, indexer top-512; indexer 64 heads x 128 dims), random data:

* ``sparse_decode`` (the CSA layer's decode attention: 128 window rows + 512 gathered
  compressed entries per sequence) for bf16 and fp8_e4m3 (per-32 fp16 scales) rows, at
  B = 64 sequences of 32k context (8192 compressed entries each in the pool): median ms,
  the bytes of rows + scales read once, TB/s, the max |error| against the jnp twin, and the
  ideal time ratio bf16 / fp8 = 2 / 1.0625 beside the measured one.
* ``indexer_scores`` over every closed entry (8192 bf16 keys per sequence): ms, TB/s, error.
* capacity (no GPU work): pages and tokens that the bf16 and fp8 pools hold in a 64 GiB
  budget with 64 sequence slots, from ``kvcache.v4_pools``'s byte model.

The JSON ({"machine", "command", "records", "capacity"}) is rewritten after every record; a
kernel that fails to lower is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.kernels import chain
from jfp8kv.kernels import v4_sparse
from jfp8kv.kvcache import fp8, v4_pools
from jfp8kv.kvcache.layout import CacheRequest, plan_cache
from jfp8kv.models.v4_presets import v4_config

FULL = dict(batch=64, heads=64, dim=512, window=128, topk=512, entries=8192, i_heads=64,
            i_dim=128)
SMOKE = dict(batch=2, heads=5, dim=64, window=6, topk=7, entries=40, i_heads=20, i_dim=32)


CALLS = 10  # timed calls per median (``--smoke``: 1)


def _median_ms(f, *args, calls: int | None = None) -> float:
    calls = CALLS if calls is None else calls
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def _decode_case(s, storage, key):
    k = jax.random.split(key, 5)
    b, d = s["batch"], s["dim"]
    q = jax.random.normal(k[0], (b, s["heads"], d), jnp.float32)
    win, ws = v4_pools.store_rows(jax.random.normal(k[1], (b, s["window"], d)) * 3, storage)
    comp, cs = v4_pools.store_rows(
        jax.random.normal(k[2], (b * s["entries"], d)) * 3, storage)
    idx = jax.random.randint(k[3], (b, s["topk"]), 0, s["entries"]) + (
        s["entries"] * jnp.arange(b)[:, None])
    sinks = jax.random.normal(k[4], (s["heads"],))
    win_len = jnp.full((b,), s["window"], jnp.int32)
    return q, win, ws, win_len, comp, cs, idx.astype(jnp.int32), sinks


def decode_record(s, storage, interpret, key) -> dict:
    args = _decode_case(s, storage, key)
    scale = s["dim"] ** -0.5
    rec = {"op": "sparse_decode", "storage": storage, **{k: s[k] for k in
                                                         ("batch", "heads", "dim", "window",
                                                          "topk")}}
    spec_bytes = s["dim"] * jnp.dtype(storage).itemsize + (
        s["dim"] // 32 * 2 if storage.startswith("float8") else 0)
    rec["bytes"] = s["batch"] * (s["window"] + s["topk"]) * spec_bytes
    try:
        ref = v4_sparse.sparse_decode_reference(*args, scale)
        got = v4_sparse.sparse_decode(*args, scale, interpret=interpret)
        rec["max_abs_err"] = float(jnp.max(jnp.abs(got - ref)))

        def one(q, *rest):
            return v4_sparse.sparse_decode(q, *rest, scale, interpret=interpret)

        reps = 8
        rec["ms"] = _median_ms(chain(one)(reps), *args) / reps
        rec["tbps"] = rec["bytes"] / rec["ms"] / 1e9
    except Exception as e:  # noqa: BLE001  recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return rec


def indexer_record(s, interpret, key) -> dict:
    k = jax.random.split(key, 3)
    b = s["batch"]
    q = jax.random.normal(k[0], (b, s["i_heads"], s["i_dim"]), jnp.float32)
    w = jax.random.normal(k[1], (b, s["i_heads"]), jnp.float32)
    keys = jax.random.normal(k[2], (b, s["entries"], s["i_dim"])).astype(jnp.bfloat16)
    rec = {"op": "indexer_scores", "batch": b, "i_heads": s["i_heads"], "i_dim": s["i_dim"],
           "entries": s["entries"], "bytes": keys.nbytes}
    try:
        ref = v4_sparse.indexer_scores_reference(q, w, keys)
        f = jax.jit(lambda q, w, k: v4_sparse.indexer_scores(q, w, k, interpret=interpret))
        rec["max_abs_err"] = float(jnp.max(jnp.abs(f(q, w, keys) - ref)))
        rec["ms"] = _median_ms(f, q, w, keys)
        rec["tbps"] = rec["bytes"] / rec["ms"] / 1e9
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return rec


def capacity(budget: int = 64 << 30, seqs: int = 64) -> dict:
    cfg = v4_config("deepseek-v4-flash")
    out = {"budget_bytes": budget, "max_num_seqs": seqs}
    for name in ("auto", "fp8_e4m3"):
        layout = v4_pools.v4_layout(cfg, CacheRequest(fp8.storage_dtype_name(name, "bfloat16")))
        plan = plan_cache(layout, budget, 256, seqs, 256)
        out[name] = {"pages": plan.num_pages, "max_tokens": plan.max_tokens,
                     "bytes_per_token": float(layout.bytes_per_token(256)),
                     **plan.pool_bytes()}
    out["token_ratio"] = out["fp8_e4m3"]["max_tokens"] / out["auto"]["max_tokens"]
    return out


# ----------------------------------------------------------------- --paged (issue 57)

PAGED_FULL = dict(model="deepseek-v4-flash-4l", batch=32,
                  contexts=(4096, 16384, 65536, 131072),
                  widths=(8192, 1048576), reps=4, launch_context=65536)
PAGED_SMOKE = dict(model="deepseek-v4-tiny", batch=2, contexts=(32, 64),
                   widths=(64, 512), reps=1, launch_context=64)


def _page_size(cfg) -> int:
    """The engine's rule (``engine.v4_engine._page_size`` from its default 16)."""
    ps = 16
    while any(ps % r for r in cfg.v4.compress_ratios if r):
        ps *= 2
    return ps


def _paged_pools(cfg, storage, batch: int, context: int, key):
    """Random pools for ``batch`` rows of ``context`` tokens (pages shuffled, page 0 the
    sink), one per layer as the engine holds them, and each row's pages [B, context/ps]."""
    v4, d, ps = cfg.v4, cfg.head_dim, _page_size(cfg)
    per_row = context // ps
    pages = batch * per_row + 1
    rows = (1 + jax.random.permutation(key, pages - 1)).reshape(batch, per_row)
    keys = iter(jax.random.split(jax.random.fold_in(key, 1), 4 * cfg.num_layers + 4))
    layers = []
    for i in range(cfg.num_layers):
        kind, m = v4.layer_kind(i), v4.compress_ratios[i]
        lay = {"kind": kind, "window": v4_pools.store_rows(
            jax.random.normal(next(keys), (batch + 1, v4.sliding_window, d)) * 3, storage)}
        if kind != "window":
            lay["m"] = m
            lay["comp"] = v4_pools.store_rows(
                jax.random.normal(next(keys), (pages, ps // m, d)) * 3, storage)
        if kind == "csa":
            lay["index"] = jax.random.normal(next(keys), (pages, ps // m, v4.index_head_dim)
                                             ).astype(jnp.bfloat16)
        layers.append(lay)
    return layers, rows.astype(jnp.int32)


def _table(rows, width_pages: int):
    """Page tables [B, width_pages]: the row's pages, then page 0."""
    b, n = rows.shape
    return jnp.zeros((b, width_pages), jnp.int32).at[:, :n].set(rows)


def _pool_args(pool):
    """(values, scales or None) of a ``store_rows`` pair."""
    return pool[0], pool[1]


def _in_place_layer(cfg, lay, q, iq, iw, slots, pos, pt, sinks, interpret, launch=None):
    """One layer's decode attention through ``v4_paged_sparse`` -> [B, H, D] float32.
    ``launch``: paged_sparse_decode's tile / head_block / num_warps / num_stages (None:
    its defaults)."""
    from jfp8kv.kernels import v4_paged_sparse as vps

    sm = cfg.head_dim ** -0.5
    kw = dict(launch or {}, interpret=interpret)
    wv, ws = _pool_args(lay["window"])
    if lay["kind"] == "window":
        return vps.paged_sparse_decode(q, wv, ws, slots, pos, None, None, sinks, sm, **kw)
    cv, cs = _pool_args(lay["comp"])
    if lay["kind"] == "hca":
        return vps.paged_sparse_decode(q, wv, ws, slots, pos, cv, cs, sinks, sm,
                                       page_tables=pt, ratio=lay["m"], **kw)
    idx = _csa_index(cfg, lay, iq, iw, pt, pos, interpret)
    return vps.paged_sparse_decode(q, wv, ws, slots, pos, cv, cs, sinks, sm, idx=idx, **kw)


def _csa_index(cfg, lay, iq, iw, pt, pos, interpret):
    """The engine's CSA index list (``v4_paged_attention.csa_index``, blocks of
    ``INDEX_BLOCK`` entries) -> int32 [B, index_topk]."""
    from jfp8kv.kernels import v4_paged_sparse as vps
    from jfp8kv.models import v4_paged_attention as v4pa

    n = vps.closed_entries(pos, lay["m"])[:, None]  # one query per sequence
    return v4pa.csa_index(iq[:, None], iw[:, None], lay["index"], pt, n, cfg.v4.index_topk,
                          v4pa.INDEX_BLOCK,
                          backend="pallas_interpret" if interpret else "pallas")[:, 0]


def _dense_entries(pool, page_tables, dtype):
    """The baseline's entry gather: a paged pool [pages, E, d] (+ scales) -> each row's
    entries [B, P*E, d] (entry w at flat index w), dequantized in ``dtype``: the whole
    table, whatever the row's length."""
    b = page_tables.shape[0]
    got = tuple(a[page_tables].reshape(b, -1, a.shape[-1]) for a in pool)
    return v4_pools.read_rows(got[0], got[1] if len(got) > 1 else None, dtype)


def _gather_layer(cfg, lay, q, iq, iw, slots, pos, pt, sinks, kv_new, interpret):
    """One layer's decode attention as the engine ran it before issue 57 (dense gathers of
    the ring and the table's entries, ``deepseek_v4._attention``'s kernel branch)
    -> [B, H, D]."""
    from jfp8kv.models import deepseek_v4 as dv4
    from jfp8kv.models import v4_attention as va
    from jfp8kv.models import v4_paged

    w = cfg.v4.sliding_window
    dtype, sdt = jnp.bfloat16, jnp.float32  # the GPU's weights; read_state's state dtype
    ring = (pos[:, None] - (w - 1) + jnp.arange(w - 1)[None]) % w
    win = v4_paged._rows(tuple(a[slots[:, None], ring] for a in lay["window"] if a is not None),
                         dtype)
    keys = jnp.concatenate([win, kv_new.astype(dtype)[:, None]], 1)
    entries, chosen = keys[:, :0], None
    if lay["kind"] != "window":
        comp = tuple(a for a in lay["comp"] if a is not None)
        ent = _dense_entries(comp, pt, dtype).astype(sdt)
        if lay["kind"] == "hca":
            chosen = va.visible_entries(pos[:, None], ent.shape[1], lay["m"])
        else:
            ient = _dense_entries((lay["index"],), pt, dtype).astype(sdt)
            scorer = functools.partial(v4_sparse.indexer_scores, interpret=interpret)
            chosen = va.indexer_select(iq[:, None], iw[:, None], pos[:, None], ient, cfg,
                                       scorer)
        entries = ent.astype(dtype)
    out = dv4._decode_kernel(q[:, None].astype(dtype), keys, keys.shape[1], entries, chosen,
                             pos, sinks, cfg, lay["kind"], interpret)
    return out[:, 0].astype(jnp.float32)


def _chained(layer_fn, reps: int):
    """A jitted f(q, iq, arrays, iw, slots, pos, pt, sinks) running ``layer_fn`` reps times,
    each call depending on the last output: the queries move by it and the integer inputs
    (slots, positions, page tables) get ``+ 0 * it``, so XLA can neither merge the calls nor
    hoist a gather out of the chain (x * 0.0 is not folded for floats)."""
    @jax.jit
    def f(q, iq, arrays, iw, slots, pos, pt, sinks):
        acc = jnp.zeros((), jnp.float32)
        for _ in range(reps):
            out = layer_fn(q, iq, arrays, iw, slots, pos, pt, sinks)
            s = jnp.sum(out[:, :1, :1])
            acc = acc + s
            q, iq = q + 1e-3 * s, iq + 1e-3 * s
            zero = (s * 0.0).astype(jnp.int32)
            slots, pos, pt = slots + zero, pos + zero, pt + zero
        return acc
    return f


def _step_bytes(cfg, storage, batch, context) -> dict:
    """Bytes one decode step must read once: window rows, CSA top-k rows, HCA closed
    entries (+ fp8 scales), and the CSA indexer keys of every closed entry."""
    v4, d = cfg.v4, cfg.head_dim
    row = d * jnp.dtype(storage).itemsize + (d // 32 * 2 if storage.startswith("float8") else 0)
    out = {"window": 0, "csa": 0, "hca": 0}
    for i in range(cfg.num_layers):
        kind, m = v4.layer_kind(i), v4.compress_ratios[i]
        n = v4.sliding_window
        if kind == "csa":
            n += min(v4.index_topk, context // m)
            out["csa"] += batch * (context // m) * v4.index_head_dim * 2
        elif kind == "hca":
            n += context // m
        out[kind] += batch * n * row
    out["step"] = sum(out.values())
    return out


LAUNCHES = ({"tile": 16, "head_block": 16, "num_warps": 4, "num_stages": 2},  # the default
            {"tile": 32, "head_block": 16, "num_warps": 4, "num_stages": 2},
            {"tile": 16, "head_block": 16, "num_warps": 8, "num_stages": 3},
            {"tile": 16, "head_block": 32, "num_warps": 8, "num_stages": 2},
            {"tile": 32, "head_block": 32, "num_warps": 8, "num_stages": 3})


def paged_record(cfg, path, storage, context, width_tokens, s, interpret, key, pools,
                 launch=None, check=True) -> dict:
    """Time one (path, storage, context, table width) case; errors recorded, not raised."""
    from jfp8kv.kernels import v4_paged_sparse as vps

    v4, b, ps = cfg.v4, s["batch"], _page_size(cfg)
    rec = {"path": path, "storage": storage, "context": context, "table_tokens": width_tokens,
           "batch": b, "page_size": ps, "reps": s["reps"]}
    if launch is not None:
        rec["launch"] = launch
    layers, rows = pools
    k = jax.random.split(key, 6)
    q = jax.random.normal(k[0], (b, cfg.num_heads, cfg.head_dim), jnp.float32)
    iq = jax.random.normal(k[1], (b, v4.index_n_heads, v4.index_head_dim), jnp.float32)
    iw = jax.random.normal(k[2], (b, v4.index_n_heads), jnp.float32) * 0.1
    kv_new = jax.random.normal(k[3], (b, cfg.head_dim), jnp.float32)
    sinks = jax.random.normal(k[4], (cfg.num_heads,), jnp.float32)
    slots = jnp.arange(1, b + 1, dtype=jnp.int32)
    pos = jnp.full((b,), context - 1, jnp.int32)  # the row's last token; its row is written
    pt = _table(rows, width_tokens // ps)
    cap = vps.entry_cap(context // v4.csa_ratio, v4.index_topk)  # the twin's (a bound)
    rec["bytes"] = _step_bytes(cfg, storage, b, context)
    rec["ms"], rec["max_abs_err"] = {}, {}
    kinds = {}
    for lay in layers:
        kinds.setdefault(lay["kind"], lay)
    for kind, lay in kinds.items():
        static = {k: lay[k] for k in ("kind", "m") if k in lay}
        arrays = {k: v for k, v in lay.items() if k not in static}  # jit arguments, never
        try:  # closed-over constants (the pools are GBs)
            if path == "in_place":
                def one(q, iq, arrays, iw, slots, pos, pt, sinks, static=static):
                    return _in_place_layer(cfg, dict(arrays, **static), q, iq, iw, slots, pos,
                                           pt, sinks, interpret, launch)
            else:
                def one(q, iq, arrays, iw, slots, pos, pt, sinks, static=static):
                    return _gather_layer(cfg, dict(arrays, **static), q, iq, iw, slots, pos,
                                         pt, sinks, kv_new, interpret)
            f = _chained(one, s["reps"])
            rec["ms"][kind] = _median_ms(f, q, iq, arrays, iw, slots, pos, pt, sinks) / s["reps"]
            if path == "in_place" and launch is None and check:
                rec["max_abs_err"][kind] = _twin_error(cfg, lay, q, iq, iw, slots, pos, pt,
                                                       sinks, cap, interpret, rec)
        except Exception as e:  # noqa: BLE001  recorded, the run goes on
            rec.setdefault("error", {})[kind] = f"{type(e).__name__}: {str(e)[:400]}"
    if path == "in_place" and "csa" in kinds and launch is None:
        lay = kinds["csa"]
        try:
            f = jax.jit(lambda iq, iw, keys, pt, pos: _csa_index(
                cfg, dict(lay, index=keys), iq, iw, pt, pos, interpret))
            rec["ms"]["csa_index_list"] = _median_ms(f, iq, iw, lay["index"], pt, pos)
        except Exception as e:  # noqa: BLE001
            rec.setdefault("error", {})["csa_index_list"] = f"{type(e).__name__}: {str(e)[:400]}"
    counts = {kd: sum(lay["kind"] == kd for lay in layers) for kd in kinds}
    if all(kd in rec["ms"] for kd in kinds):
        rec["ms"]["step"] = sum(counts[kd] * rec["ms"][kd] for kd in kinds)
        rec["tbps"] = rec["bytes"]["step"] / rec["ms"]["step"] / 1e9
    return rec


def _twin_error(cfg, lay, q, iq, iw, slots, pos, pt, sinks, cap, interpret, rec) -> float:
    """max |in-place - its jnp twin| for one layer (the twin gathers); for CSA also the
    fraction of rows whose top-k set equals the twin's (recorded in ``rec``). One jit."""
    from jfp8kv.kernels import v4_paged_indexer as vpi
    from jfp8kv.kernels import v4_paged_sparse as vps

    sm = cfg.head_dim ** -0.5
    static = {k: lay[k] for k in ("kind", "m") if k in lay}
    arrays = {k: v for k, v in lay.items() if k not in static}

    @jax.jit
    def diff(arrays, q, iq, iw, slots, pos, pt, sinks):
        ly = dict(arrays, **static)
        wv, ws = _pool_args(ly["window"])
        got = _in_place_layer(cfg, ly, q, iq, iw, slots, pos, pt, sinks, interpret)
        kw, comp, same = {}, (None, None), jnp.float32(-1)
        if ly["kind"] != "window":
            comp = _pool_args(ly["comp"])
        if ly["kind"] == "hca":
            kw = {"page_tables": pt, "ratio": ly["m"]}
        elif ly["kind"] == "csa":
            n = vps.closed_entries(pos, ly["m"])
            mine = _csa_index(cfg, ly, iq, iw, pt, pos, interpret)
            twin = vpi.indexer_topk_reference(iq, iw, ly["index"], pt, n, cfg.v4.index_topk,
                                              cap)
            same = jnp.mean(jnp.all(jnp.sort(mine, 1) == jnp.sort(twin, 1), 1))
            kw = {"idx": mine}
        ref = vps.paged_sparse_decode_reference(q, wv, ws, slots, pos, *comp, sinks, sm, **kw)
        return jnp.max(jnp.abs(got - ref)), same

    err, same = diff(arrays, q, iq, iw, slots, pos, pt, sinks)
    if static["kind"] == "csa":
        rec["csa_topk_rows_equal"] = float(same)
    return float(err)


def _ratio(recs, path, storage, num, den, key="context"):
    def ms(v):
        for r in recs:
            if (r["path"], r["storage"], r[key]) == (path, storage, v) and "step" in r["ms"]:
                if key == "context" and r["table_tokens"] != r["context"]:
                    continue
                if key == "table_tokens" and r.get("width_case") is not True:
                    continue
                return r["ms"]["step"]
        return None
    a, b = ms(num), ms(den)
    return None if a is None or b is None else a / b


def paged_main(a, shapes, interpret) -> dict:
    """The ``--paged`` run (module docstring): records, then ``summary``."""
    cfg = v4_config(shapes["model"])
    doc = {"machine": common.machine_info(), "command": common.command_line(
        "bench.v4_kernels", a.argv), "model": f"random:{shapes['model']}", "records": []}
    key = jax.random.key(0)
    first = shapes["contexts"][0]
    cases = [(first, first, False)] + [(first, w, True) for w in shapes["widths"]]
    cases += [(c, c, False) for c in shapes["contexts"][1:]]
    t0 = time.perf_counter()
    for n, storage in enumerate(a.storages.split(",")):
        done = {}
        # the first dtype in the order; the next starts at 64k (its fp8/bf16 row)
        order = cases if n == 0 else sorted(cases, key=lambda c: c[0] != 65536)
        for context, width, width_case in order:
            if time.perf_counter() - t0 > a.time_limit:
                doc["records"].append({"path": "both", "storage": storage, "context": context,
                                       "table_tokens": width, "ms": {},
                                       "skipped": f"--time-limit {a.time_limit} s"})
                continue
            if context not in done:
                done.clear()  # one context's pools at a time
                done[context] = _paged_pools(cfg, storage, shapes["batch"], context, key)
            for path in ("in_place", "gather"):
                check = width_case or context in (first, shapes["contexts"][-1])
                rec = paged_record(cfg, path, storage, context, width, shapes, interpret,
                                   key, done[context], check=check)
                rec["width_case"] = width_case
                doc["records"].append(rec)
                print({k: rec.get(k) for k in ("path", "storage", "context", "table_tokens",
                                               "ms", "error")}, flush=True)
                common.write_result(a.out, doc)

    # Last (least needed): the in-place kernel's launch knobs at one context, first dtype
    context, pools = shapes["launch_context"], None
    for launch in LAUNCHES[1:]:
        if time.perf_counter() - t0 > a.time_limit:
            break
        storage = a.storages.split(",")[0]
        pools = pools or _paged_pools(cfg, storage, shapes["batch"], context, key)
        rec = paged_record(cfg, "in_place", storage, context, context, shapes, interpret, key,
                           pools, launch)
        doc.setdefault("launches", []).append(rec)
        print({k: rec.get(k) for k in ("launch", "ms", "error")}, flush=True)
        common.write_result(a.out, doc)
    del pools
    recs, lo, hi = doc["records"], shapes["contexts"][0], shapes["contexts"][-1]
    summ = {}
    for path in ("in_place", "gather"):
        for st in ("float8_e4m3fn", "bfloat16"):
            summ[f"{path}/{st}/step_{hi}_over_{lo}"] = _ratio(recs, path, st, hi, lo)
            w0, w1 = shapes["widths"]
            summ[f"{path}/{st}/step_width_{w1}_over_{w0}"] = _ratio(recs, path, st, w1, w0,
                                                                    "table_tokens")
        cs = shapes["contexts"]
        mid = 65536 if 65536 in cs else cs[len(cs) // 2]  # the 64k
        summ[f"{path}/fp8_over_bf16_at_{mid}"] = (
            None if _ms(recs, path, "float8_e4m3fn", mid) is None
            or _ms(recs, path, "bfloat16", mid) is None
            else _ms(recs, path, "float8_e4m3fn", mid) / _ms(recs, path, "bfloat16", mid))
    for st in ("float8_e4m3fn", "bfloat16"):
        for c in shapes["contexts"]:
            g, i = _ms(recs, "gather", st, c), _ms(recs, "in_place", st, c)
            summ[f"gather_over_in_place/{st}/{c}"] = None if g is None or i is None else g / i
    doc["summary"] = summ
    common.write_result(a.out, doc)
    return doc


def _ms(recs, path, storage, context):
    for r in recs:
        if ((r["path"], r["storage"], r["context"], r["table_tokens"]) ==
                (path, storage, context, context) and "step" in r["ms"]):
            return r["ms"]["step"]
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench/results/v4-kernels-h200.json, with "
                         "--paged bench/results/v4-paged-decode.json)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--paged", action="store_true",
                    help="issue 57: today's gather + sparse_decode vs the in-place kernels")
    ap.add_argument("--storages", default="float8_e4m3fn,bfloat16",
                    help="--paged: pool dtypes, comma-separated")
    ap.add_argument("--time-limit", type=float, default=450.0,
                    help="--paged: seconds after which no new case starts (recorded as "
                         "skipped), so one call under a 600 s limit keeps its JSON")
    ap.add_argument("--contexts", default=None,
                    help="--paged: tokens per row, comma-separated (default 4k,16k,64k,128k)")
    ap.add_argument("--widths", default=None,
                    help="--paged: two page-table widths in tokens for rows of the first "
                         "context (default 8192,1048576)")
    a = ap.parse_args(argv)
    a.argv = argv
    if a.paged:
        global CALLS
        CALLS = 1 if a.smoke else CALLS
        a.out = a.out or "bench/results/v4-paged-decode.json"
        shapes = dict(PAGED_SMOKE if a.smoke else PAGED_FULL)
        if a.contexts:
            shapes["contexts"] = tuple(int(x) for x in a.contexts.split(","))
            shapes["launch_context"] = shapes["contexts"][-1]
        if a.widths:
            shapes["widths"] = tuple(int(x) for x in a.widths.split(","))
        doc = paged_main(a, shapes, a.smoke)
        print(doc["summary"])
        return
    a.out = a.out or "bench/results/v4-kernels-h200.json"
    shapes, interpret = (SMOKE, True) if a.smoke else (FULL, False)
    doc = {"machine": common.machine_info(), "command": common.command_line("bench.v4_kernels",
                                                                             argv),
           "capacity": capacity(), "records": []}
    key = jax.random.key(0)
    for storage in ("bfloat16", "float8_e4m3fn"):
        doc["records"].append(decode_record(shapes, storage, interpret, key))
        common.write_result(a.out, doc)
    ms = {r["storage"]: r.get("ms") for r in doc["records"]}
    if all(ms.values()):
        doc["decode_ratio"] = {"measured_bf16_over_fp8": ms["bfloat16"] / ms["float8_e4m3fn"],
                               "ideal": 2 / 1.0625}
    doc["records"].append(indexer_record(shapes, interpret, key))
    common.write_result(a.out, doc)
    print(doc)


if __name__ == "__main__":
    main()
