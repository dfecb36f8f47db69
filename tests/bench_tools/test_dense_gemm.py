"""bench.dense_gemm: the skinny-GEMM prototype equals XLA's dot (interpret mode, fresh random
operands, split-K on and off), and --smoke writes XLA, swept and side-by-side rows (a
plumbing test: no timing is asserted)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import dense_gemm


@pytest.mark.parametrize("t", [dense_gemm.Tiling(bn=32, bk=32, splits=2, num_stages=1),
                               dense_gemm.Tiling(bn=64, bk=64, splits=1, num_stages=1)])
def test_skinny_gemm_matches_xla(t):
    kx, kw = jax.random.split(jax.random.PRNGKey(np.random.randint(1 << 30)))
    x = jax.random.normal(kx, (16, 128), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (128, 64), jnp.float32) * 0.1).astype(jnp.bfloat16)
    got = dense_gemm.skinny_gemm(x, w, t=t, interpret=True)
    want = jnp.einsum("mk,kn->mn", x.astype(jnp.float32), w.astype(jnp.float32))
    assert got.dtype == jnp.bfloat16 and got.shape == (16, 64)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2,
                               atol=1e-2)


def test_smoke_rows(tmp_path):
    out = tmp_path / "g.json"
    dense_gemm.main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["xla", "pallas", "pallas", "side_by_side"]
    assert all("error" not in r for r in rows)
    assert all(r["max_abs_err"] < 0.05 for r in rows if r["impl"] == "pallas")
