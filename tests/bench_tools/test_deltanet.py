"""bench.deltanet on the CPU (tiny shapes): the looped decode op equals reps recurrent steps
written out, and so does the in-place kernel's loop (interpret mode); --cases picks and
orders the rows, a case that cannot run here (jla off a Hopper GPU) is a skipped row, and
the JSON written after each size keeps what finished when a later case fails (a plumbing
test: no timing is asserted)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import deltanet
from jfp8kv.kernels import delta_decode, delta_rule


@pytest.mark.parametrize("reps", [3, 16])  # no unrolling; unrolled by UNROLL
def test_decode_op_equals_the_steps_written_out(reps):
    s, b = deltanet.SMOKE_SHAPES, 3
    q, k, v, g, beta = deltanet._inputs(b, 1, s, jax.random.key(np.random.randint(1 << 30)))
    pool = jax.random.normal(jax.random.key(1), (6, s["hv"], s["dk"], s["dv"]), jnp.float32)
    slots = jnp.array([4, 1, 2], jnp.int32)
    want, qq = np.array(pool), q
    for _ in range(reps):
        out, state = delta_rule.recurrent(qq, k, v, g, beta, jnp.asarray(want)[slots])
        want[np.asarray(slots)] = np.asarray(state)
        qq = qq + 1e-3 * out[:, :, : q.shape[2], : q.shape[3]].astype(q.dtype)
    got = deltanet.decode_op(True)(reps)(jnp.array(pool), slots, q, k, v, g, beta)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert not np.isnan(np.asarray(got)).any()


def test_inplace_decode_op_equals_the_xla_op():
    s, b, reps = deltanet.SMOKE_SHAPES, 3, 3
    q, k, v, g, beta = deltanet._inputs(b, 1, s, jax.random.key(np.random.randint(1 << 30)))
    pool = jax.random.normal(jax.random.key(2), (6, s["hv"], s["dk"], s["dv"]), jnp.float32)
    slots = jnp.array([4, 1, 2], jnp.int32)
    want = deltanet.decode_op(True)(reps)(jnp.array(pool), slots, q, k, v, g, beta)
    op = deltanet.inplace_decode_op(delta_decode.DeltaDecodeTuning(block_v=16), interpret=True)
    got = op(reps)(jnp.array(pool), slots, q, k, v, g, beta)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert not np.isnan(np.asarray(got)).any()


def test_default_smoke_run_has_every_case(tmp_path):
    out = tmp_path / "d.json"
    deltanet.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    rows = {r["case"]: r for r in saved["rows"]}
    assert [r["case"] for r in saved["rows"]] == list(deltanet.CASES)
    assert rows["decode-inplace"]["block_v"] == 32 and rows["decode"]["pool_copies"] == 0
    assert rows["prefill-jla"]["skipped"] and "ms" not in rows["prefill-jla"]
    assert rows["prefill-triton"]["precision"] == "tf32" and rows["prefill-triton"]["ms"] > 0
    assert rows["prefill"]["tflops"] > 0 and "python -m bench.deltanet --smoke" in saved["command"]
    assert saved["machine"]["versions"]["jax"] and "packages" in saved


def test_cases_in_order_and_rows_written(tmp_path):
    out = tmp_path / "d.json"
    doc = deltanet.main(["--smoke", "--cases", "prefill,decode", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["complete"] and doc["complete"] and saved["cases"] == ["prefill", "decode"]
    assert [r["case"] for r in saved["rows"]] == ["prefill", "decode"]
    assert all(r["ms"] > 0 and r["wall_s"] > 0 for r in saved["rows"])
    assert saved["matmul_tflops"] > 0 and saved["copy_tbps"] > 0
    with pytest.raises(SystemExit):
        deltanet.main(["--smoke", "--cases", "decode,verify"])


def test_a_run_cut_short_keeps_its_rows(tmp_path, monkeypatch):
    def fail(*args, **kw):
        raise RuntimeError("time limit")

    monkeypatch.setattr(deltanet, "prefill_rows", fail)
    out = tmp_path / "d.json"
    with pytest.raises(RuntimeError):
        deltanet.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert not saved["complete"]
    assert [r["case"] for r in saved["rows"]] == ["decode", "decode-inplace"]
    assert saved["copy_tbps"] > 0 and saved["matmul_tflops"] is not None
