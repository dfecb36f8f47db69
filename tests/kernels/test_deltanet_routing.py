"""``kernels.deltanet``: the DeltaNet layers' one routing point. The backend -> kernel table;
the in-place decode step (pallas_interpret) against the reference backend's twin on a
NaN-poisoned pool; the prefill route of the "pallas" backend to jla (through the float64
stand-in of tests/kernels/test_delta_prefill.py) with padding rows exact.

Every case draws a fresh pool and rows: real rows in shuffled distinct slots >= 1, padding
rows on the sink slot 0, one row that starts its sequence (``fresh``: its slot holds NaN).
The sink, the fresh row's slot and half of the slots no row names are NaN; afterwards the
unnamed slots hold the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import delta_prefill, deltanet

from .cases import assert_close
from .test_delta_prefill import jla_standin

BACKENDS = ("reference", "pallas", "pallas_triton", "pallas_interpret")
conv_jit = jax.jit(deltanet.causal_conv, static_argnames="backend")
rule_jit = jax.jit(deltanet.gated_delta_rule, static_argnames="backend")


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _rows(rng, b: int, slots: int, pad: int):
    """(slot_ids, fresh, real-row mask, unnamed slots), as tests/kernels/test_delta_decode.py
    lays them out."""
    ids = np.concatenate([rng.choice(np.arange(1, slots), b - pad, replace=False),
                          np.zeros(pad, np.int64)])[rng.permutation(b)].astype(np.int32)
    real = ids > 0
    fresh = np.zeros(b, bool)
    fresh[rng.choice(np.flatnonzero(real))] = True
    return ids, fresh, real, np.setdiff1d(np.arange(1, slots), ids)


def _pool(rng, shape, dtype, ids, fresh, unnamed):
    pool = (rng.standard_normal(shape) * 0.3).astype(np.float32)
    pool[0] = pool[ids[fresh]] = np.nan
    pool[unnamed[: (len(unnamed) + 1) // 2]] = np.nan
    return jnp.asarray(pool, dtype)


def _case(rng, b, t, hk, hv, dk, dv, dtype, slots, pad, pool_dtype="float32"):
    ids, fresh, real, unnamed = _rows(rng, b, slots, pad)
    q, k = (jnp.asarray(rng.standard_normal((b, t, hk, dk)) * rng.uniform(0.3, 3), dtype)
            for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, hv, dv)), dtype)
    n_valid = np.where(real, rng.integers(1, t + 1, b), 0)
    live = (np.arange(t)[None] < n_valid[:, None])[..., None]
    g = jnp.asarray(-rng.uniform(0.0, 1.5, (b, t, hv)) * live, jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, hv)) * live, jnp.float32)
    pool = _pool(rng, (slots, hv, dk, dv), pool_dtype, ids, fresh, unnamed)
    args = [jnp.asarray(ids), q, k, v, g, beta, jnp.asarray(fresh)]
    return pool, args, real, n_valid, unnamed


def test_routing_table():
    """Decode in place on every Pallas backend where the pool fits the kernels, the twin on
    "reference" or where it does not; the prefill's impl from the backend; unknown refused."""
    assert {b: deltanet.prefill_impl(b) for b in BACKENDS} == {
        "reference": "xla", "pallas": "auto", "pallas_triton": "xla",
        "pallas_interpret": "xla"}
    rec, conv = (9, 32, 128, 128), (9, 3, 8192)
    for b in BACKENDS[1:]:
        assert deltanet.decode_in_place(b, rec, jnp.float32, "recurrent") is None
        assert deltanet.decode_in_place(b, conv, jnp.bfloat16, "conv") is None
    assert "reference" in deltanet.decode_in_place("reference", rec, jnp.float32, "recurrent")
    assert "float64" in deltanet.decode_in_place("pallas", rec, jnp.float64, "recurrent")
    assert "powers of two" in deltanet.decode_in_place("pallas", (9, 4, 24, 32), jnp.float32,
                                                       "recurrent")
    assert "int32" in deltanet.decode_in_place("pallas", (4097, 32, 128, 128), jnp.float32,
                                               "recurrent")
    assert "conv channels" in deltanet.decode_in_place("pallas", (9, 3, 96 + 256),
                                                       jnp.float32, "conv")
    with pytest.raises(ValueError, match="unknown backend"):
        deltanet.prefill_impl("auto")


@pytest.mark.parametrize("pool_dtype,dtype,b,hk,hv,dk,dv,pad", [
    ("float32", "float32", 5, 2, 4, 16, 16, 1),
    ("bfloat16", "bfloat16", 4, 1, 4, 32, 16, 2),
])
def test_decode_in_place_equals_the_twin(pool_dtype, dtype, b, hk, hv, dk, dv, pad):
    """pallas_interpret's one-token step (``delta_decode`` in interpret mode, in place)
    against the reference backend's gather -> step -> scatter: conv and delta rule, the
    real rows' outputs and slots, the unnamed slots' bits, no NaN read."""
    rng = np.random.default_rng()
    slots, c = 11, 2 * hk * dk + hv * dv
    pool, args, real, n_valid, unnamed = _case(rng, b, 1, hk, hv, dk, dv, dtype, slots, pad,
                                               pool_dtype)
    ids, fresh = args[0], args[-1]
    conv_pool = _pool(rng, (slots, 3, c), pool_dtype, np.asarray(ids), np.asarray(fresh),
                      unnamed)
    for p, kind in ((pool, "recurrent"), (conv_pool, "conv")):  # the kernels take them
        assert deltanet.decode_in_place("pallas_interpret", p.shape, p.dtype, kind) is None
    x = jnp.asarray(rng.standard_normal((b, 1, c)), dtype)
    w = jnp.asarray(rng.standard_normal((c, 4)) * 0.5, dtype)
    nv = jnp.asarray(n_valid, jnp.int32)
    got, want = ({"conv": conv_jit(conv_pool, ids, x, w, nv, fresh, backend=be),
                  "rule": rule_jit(pool, *args, backend=be)}
                 for be in ("pallas_interpret", "reference"))
    exact = pool_dtype == dtype == "float32"
    touched = np.asarray(ids)[real]
    for name, before in (("conv", conv_pool), ("rule", pool)):
        (out, new), (want_out, want_new) = got[name], want[name]
        assert_close(np.asarray(out)[real], np.asarray(want_out)[real], exact_f32=exact)
        assert_close(np.asarray(new)[touched], np.asarray(want_new)[touched], exact_f32=exact)
        assert (_bits(new)[unnamed] == _bits(before)[unnamed]).all(), name
        assert new.dtype == before.dtype and out.dtype == x.dtype


@pytest.fixture
def standin(monkeypatch):
    calls = []
    monkeypatch.setattr(delta_prefill, "_load_jla", lambda: jla_standin(calls))
    monkeypatch.setattr(delta_prefill, "_is_hopper", lambda: True)
    return calls


def test_prefill_of_the_pallas_backend_takes_jla(standin):
    """With a Hopper GPU and jla (the stand-in), the "pallas" backend's prefill runs jla
    from each row's slot and writes the final state back: within bf16 of the reference
    backend, an all-padding real row's slot and the unnamed slots bit for bit; the other
    backends never call it."""
    rng = np.random.default_rng()
    pool, args, real, n_valid, unnamed = _case(rng, 5, 37, 1, 2, 64, 64, jnp.bfloat16, 9, 1)
    ids, g, beta = np.asarray(args[0]), np.asarray(args[4]), np.asarray(args[5])
    idle = np.flatnonzero(real & ~np.asarray(args[-1]))[0]  # a real row with no live token
    args[4], args[5] = (jnp.asarray(np.where(np.arange(5)[:, None, None] == idle, 0, x))
                        for x in (g, beta))
    for be in ("reference", "pallas_triton", "pallas_interpret"):
        want_out, want = rule_jit(pool, *args, backend=be)
    assert standin == []
    out, new = rule_jit(pool, *args, backend="pallas")
    assert standin == ["gated_deltanet"]
    live = real & (np.arange(5) != idle)
    assert_close(np.asarray(out)[live], np.asarray(want_out)[live])
    assert_close(np.asarray(new)[ids[live]], np.asarray(want)[ids[live]])
    assert (_bits(new)[ids[idle]] == _bits(pool)[ids[idle]]).all()
    assert (_bits(new)[unnamed] == _bits(pool)[unnamed]).all()
