"""``delta_prefill.chunked``: the route (xla | jla | auto) and the mapping of our contract
onto jla's, on the CPU against a stand-in for jla, and jla's kernel itself on a Hopper GPU.

The stand-in is jla's documented convention written out here in float64 numpy, token by
token (``jla/ops/reference.py``'s recurrence, its ``l2norm`` rounding back to the input
dtype, the grouped-head rule of its Mosaic GPU kernels: value head h reads key head
h // (H / Hk)), with the input checks of jla's ``unsupported_reason``. The adapter through
the stand-in must then equal ``delta_rule.chunked``: a wrong scale, normalization, state
layout (Dk != Dv here), head mapping or gate convention fails. Cases: odd lengths, a
non-zero initial state, grouped heads, a row that ends in padding tokens and a row that is
all padding (its state must come back bit for bit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfp8kv.kernels import delta_prefill, delta_rule

from .cases import HOPPER_MARKS, assert_close, on_cpu

ref_chunked = jax.jit(delta_rule.chunked, static_argnums=6)


def jla_standin(calls: list):
    """A ``jla.ops.linear_attention`` that implements jla's convention in float64 numpy."""

    def linear_attention(kind, q, k, v, *, impl="auto", g=None, beta=None, scale=None,
                         initial_state=None, output_final_state=False, use_qk_l2norm=False,
                         **extra):
        assert kind == "gated_deltanet" and impl == "mosaic_gpu" and not extra, (kind, extra)
        b, t, hk, kd = q.shape
        hv, vd = v.shape[2:]
        assert q.dtype == k.dtype == v.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
        assert k.shape == q.shape and v.shape[:2] == (b, t) and hv % hk == 0
        assert g.shape == beta.shape == (b, t, hv)
        assert initial_state is not None and initial_state.shape == (b, hv, kd, vd)
        calls.append(kind)
        dt = ml_dtypes.bfloat16 if q.dtype == jnp.bfloat16 else np.float16
        scale = kd ** -0.5 if scale is None else scale

        def run(q, k, v, g, beta, s):  # numpy, float64, token by token
            qn, kn = (np.asarray(x, np.float32) for x in (q, k))
            if use_qk_l2norm:  # jla.ops.reference.l2norm: float32, then the input dtype
                qn, kn = (x * (1 / np.sqrt(np.sum(x * x, -1, keepdims=True) + np.float32(1e-6)))
                          for x in (qn, kn))
                qn, kn = (x.astype(dt) for x in (qn, kn))
            qn, kn = (np.asarray(x, np.float64) for x in (qn, kn))
            qn = qn * scale
            vv, gg, bb = (np.asarray(x, np.float64) for x in (v, g, beta))
            s = np.array(s, np.float64)  # [B, H, K, V]
            o = np.zeros((b, t, hv, vd))
            for h in range(hv):
                kh = h // (hv // hk)
                for i in range(t):
                    s[:, h] *= np.exp(gg[:, i, h])[:, None, None]
                    recalled = np.einsum("bk,bkv->bv", kn[:, i, kh], s[:, h])
                    u = bb[:, i, h, None] * (vv[:, i, h] - recalled)
                    s[:, h] += kn[:, i, kh, :, None] * u[:, None, :]
                    o[:, i, h] = np.einsum("bk,bkv->bv", qn[:, i, kh], s[:, h])
            return o.astype(np.float32), s.astype(np.float32)

        shapes = (jax.ShapeDtypeStruct((b, t, hv, vd), jnp.float32),
                  jax.ShapeDtypeStruct((b, hv, kd, vd), jnp.float32))
        o, s = jax.pure_callback(run, shapes, q, k, v, g, beta, initial_state)
        return o.astype(q.dtype), (s if output_final_state else None)

    return linear_attention


def _case(rng, b, t, hk, hv, dk, dv, dtype, pad_tail=True, idle_row=True):
    """Random inputs as the model makes them: raw q/k, g <= 0, beta in (0, 1); row 0 ends in
    padding tokens, the last row is all padding (when asked)."""
    q, k = (jnp.asarray(rng.standard_normal((b, t, hk, dk)) * rng.uniform(0.3, 3), dtype)
            for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, hv, dv)), dtype)
    g = -rng.uniform(0.0, 1.0, (b, t, hv)) * rng.uniform(0.01, 1.0, (1, 1, hv))
    beta = rng.uniform(0.0, 1.0, (b, t, hv))
    live = np.ones((b, t), bool)
    if pad_tail:
        live[0, t - int(rng.integers(1, t // 2)):] = False
    if idle_row:
        live[-1] = False
    g, beta = (jnp.asarray(x * live[..., None], jnp.float32) for x in (g, beta))
    state = jnp.asarray(rng.standard_normal((b, hv, dk, dv)) * 0.3, jnp.float32)
    return q, k, v, g, beta, state


@pytest.fixture
def standin(monkeypatch):
    calls = []
    monkeypatch.setattr(delta_prefill, "_load_jla", lambda: jla_standin(calls))
    monkeypatch.setattr(delta_prefill, "_is_hopper", lambda: True)
    return calls


@pytest.mark.parametrize("b,t,hk,hv,dk,dv,dtype", [
    (3, 77, 1, 2, 64, 128, jnp.bfloat16),
    (2, 131, 2, 4, 128, 64, jnp.float16),
    (1, 64, 1, 1, 64, 64, jnp.bfloat16),
])
@pytest.mark.parametrize("impl", ["jla", "auto"])
def test_jla_mapping_equals_twin_through_standin(standin, b, t, hk, hv, dk, dv, dtype, impl):
    rng = np.random.default_rng()
    q, k, v, g, beta, state = _case(rng, b, t, hk, hv, dk, dv, dtype, idle_row=b > 1)
    fn = jax.jit(functools.partial(delta_prefill.chunked, impl=impl))
    out, final = fn(q, k, v, g, beta, state)
    assert standin == ["gated_deltanet"], "the call did not go to jla"
    want_out, want = ref_chunked(q, k, v, g, beta, state, 64)
    assert out.dtype == want_out.dtype and final.dtype == want.dtype == jnp.float32
    assert_close(out, want_out)
    assert_close(final, want)
    if b > 1:  # the all-padding row: its state passes through bit for bit
        assert (np.asarray(final[-1]) == np.asarray(state[-1])).all()


def test_routes_on_this_machine():
    """Off a Hopper GPU (this CPU) "auto" is XLA and "jla" says why it cannot run; the
    reasons come from the shapes first."""
    rng = np.random.default_rng()
    args = _case(rng, 2, 40, 1, 2, 64, 64, jnp.bfloat16)
    assert delta_prefill.route(*args, "xla") == "xla"
    assert delta_prefill.route(*args, "triton") == "triton"  # by name only
    if delta_prefill.jla_unsupported_reason(*args) is not None:
        assert delta_prefill.route(*args, "auto") == "xla"
        with pytest.raises(ValueError, match="impl='jla' cannot run"):
            delta_prefill.route(*args, "jla")
    with pytest.raises(ValueError, match="unknown delta-rule prefill impl"):
        delta_prefill.route(*args, "pallas")
    f32 = tuple(x.astype(jnp.float32) for x in args)
    assert "share a dtype" in delta_prefill.jla_unsupported_reason(*f32)
    small = _case(rng, 1, 9, 1, 2, 16, 16, jnp.bfloat16)
    assert "head dims" in delta_prefill.jla_unsupported_reason(*small)
    q, k, v, g, beta, state = args
    mixed = (q, k.astype(jnp.float16), v, g, beta, state)
    assert "share a dtype" in delta_prefill.jla_unsupported_reason(*mixed)


def test_auto_keeps_xla_for_shapes_jla_does_not_take(standin):
    """With a Hopper GPU and jla present, "auto" still takes XLA for float32 inputs and head
    dims jla lacks, and gives the twin's bits there."""
    rng = np.random.default_rng()
    for args in (_case(rng, 2, 33, 1, 2, 16, 16, jnp.bfloat16),
                 tuple(x.astype(jnp.float32) for x in _case(rng, 1, 20, 1, 1, 64, 64,
                                                            jnp.bfloat16))):
        assert delta_prefill.route(*args, "auto") == "xla"
        out, final = delta_prefill.chunked(*args, impl="auto")
        want_out, want = ref_chunked(*args, 64)
        assert (np.asarray(out) == np.asarray(want_out)).all()
        assert (np.asarray(final) == np.asarray(want)).all()
    assert standin == []


@pytest.mark.parametrize("b,t,hk,hv,dk,dv,dtype", [
    (2, 1031, 2, 4, 128, 128, jnp.bfloat16),
    (3, 77, 1, 2, 64, 128, jnp.float16),
    (1, 4099, 16, 32, 128, 128, jnp.bfloat16),  # Qwen3.6-35B-A3B's heads
], ids=["B2-T1031-H2_4", "B3-T77-H1_2-f16", "B1-T4099-H16_32"])
@pytest.mark.parametrize("hopper", [pytest.param(None, marks=HOPPER_MARKS)], ids=["gpu"])
def test_jla_kernel_matches_twin_gpu(hopper, b, t, hk, hv, dk, dv, dtype):
    """jla's Mosaic GPU kernel through the adapter against ``delta_rule.chunked`` on the CPU
    (fresh random inputs: odd lengths, non-zero initial state, grouped heads, padding)."""
    rng = np.random.default_rng()
    args = _case(rng, b, t, hk, hv, dk, dv, dtype, pad_tail=b > 1, idle_row=b > 2)
    reason = delta_prefill.jla_unsupported_reason(*args)
    if reason is not None:
        pytest.skip(reason)
    fn = jax.jit(functools.partial(delta_prefill.chunked, impl="jla"))
    out, final = jax.block_until_ready(fn(*args))
    want_out, want = on_cpu(ref_chunked, *args, 64)
    for got, ref in ((out, want_out), (final, want)):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        assert got.shape == ref.shape and np.isfinite(got).all()
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        worst = float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max()))
        print(f"jla vs twin {got.shape}: relative error {rel:.2e}, max {worst:.2e}")
        # bf16 operands (T0, the state in q S and k S, the corrections): a few 1e-3 expected;
        # a convention mismatch is O(1)
        assert rel <= 2e-2 and worst <= 6e-2, (rel, worst)
    if b > 2:
        assert (np.asarray(final[-1]) == np.asarray(args[-1][-1])).all()
