"""bench.gmm_tuning: its padded reference equals ragged_dot, --preset smoke writes checked
records, the best per case and a step estimate (interpret mode: a plumbing test, no timing
is asserted), and bench.common.override_gmm_tuning hands gmm the measured tuning for the
measured shapes only."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import gmm_tuning
from bench.common import override_gmm_tuning
from jfp8kv.kernels import pallas_gmm


def test_padded_reference_matches_ragged_dot():
    rng = np.random.default_rng()
    sizes = np.array([5, 0, 9, 1, 0, 4], np.int32)  # an empty group; 3 rows past the sum
    lhs = jnp.asarray(rng.standard_normal((22, 24)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((6, 24, 40)), jnp.bfloat16)
    got = gmm_tuning.padded_reference(lhs, rhs, sizes)
    want = jax.lax.ragged_dot(lhs, rhs, jnp.asarray(sizes), preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert (np.asarray(got)[int(sizes.sum()):] == 0).all()


def test_smoke_preset(tmp_path):
    out = tmp_path / "g.json"
    gmm_tuning.main(["--preset", "smoke", "--out", str(out)])
    doc = json.loads(out.read_text())
    cases = gmm_tuning.PRESETS["smoke"]["cases"]
    assert len(doc["records"]) == 2 * sum(len(t) for t in cases.values()) and not doc["skipped"]
    for r in doc["records"]:
        assert "error" not in r and r["ok"] and r["finite"] and r["ms"] > 0, r
    assert {(b["projection"], b["M"]) for b in doc["best"]} == {
        (p, t * gmm_tuning.PRESETS["smoke"]["k"]) for p in gmm_tuning.PROJECTIONS for t in cases}
    assert all(b["default_ms"] is not None for b in doc["best"])
    for r in doc["records"]:  # the default is what gmm runs without a tuning
        assert r["default"] == (pallas_gmm.GmmTuning(**r["tuning"]) == pallas_gmm.choose_tuning(
            r["M"], r["E"], r["K"], r["N"])), r
    assert set(doc["step_estimate_ms"]) == {f"{t}_tokens_per_pass_{w}" for t in cases
                                            for w in ("default", "best")}
    assert "python -m bench.gmm_tuning" in doc["command"]


def test_override_gmm_tuning(tmp_path, monkeypatch):
    monkeypatch.setattr(pallas_gmm, "choose_tuning", pallas_gmm.choose_tuning)  # restored
    default = pallas_gmm.choose_tuning(3072, 256, 4096, 2048)
    assert default == pallas_gmm.GmmTuning(tm=16, columns_inner=True)  # 12 rows per expert
    assert override_gmm_tuning(None) == [] and pallas_gmm.choose_tuning(3072, 256, 4096,
                                                                        2048) == default
    win = pallas_gmm.GmmTuning(tm=32, tn=256, num_warps=8, columns_inner=True)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"best": [dict(projection="gate_up", M=3072, K=4096, N=2048,
                                              E=256, tuning=dataclasses.asdict(win))]}))
    assert len(override_gmm_tuning(str(path))) == 1
    assert pallas_gmm.choose_tuning(3072, 256, 4096, 2048) == win
    assert pallas_gmm.choose_tuning(3072, 256, 2048, 4096) == default  # another shape


def test_default_tuning_walks_columns_inner_only_where_measured():
    """bench/results/gmm-v4-sweep-h100.json: DeepSeek-V4's 12 and 48 rows per expert; a
    decode batch (< 1 row per expert) and a dense-routed prefill (256 rows per expert of
    Qwen3-30B-A3B's 128) keep the rows inner."""
    T = pallas_gmm.GmmTuning
    assert pallas_gmm.choose_tuning(12288, 256, 4096, 2048) == T(tm=64, columns_inner=True)
    assert pallas_gmm.choose_tuning(3072, 256, 2048, 4096) == T(tm=16, columns_inner=True)
    assert pallas_gmm.choose_tuning(192, 256, 4096, 2048) == T(tm=16)
    assert pallas_gmm.choose_tuning(32768, 128, 2048, 768) == T(tm=64)


def test_every_preset_case_times_the_default_tuning():
    """Each case of each preset has choose_tuning's pick among its candidates (filled the way
    run_case fills them), so every ``best`` row states its speed-up over the default."""
    for name, preset in gmm_tuning.PRESETS.items():
        for tokens, tunings in preset["cases"].items():
            m, e = tokens * preset["k"], preset["e"]
            for k, n in ((preset["d"], preset["i"]), (preset["i"], preset["d"])):
                filled = [dataclasses.replace(t, tm=t.tm or pallas_gmm.choose_tm(m, e))
                          for t in tunings]
                assert pallas_gmm.choose_tuning(m, e, k, n) in filled, (name, tokens)
