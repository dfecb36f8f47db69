"""bench.quality_stats: block standard errors, paired comparisons, issue 36's targets and the
decision across models. Pure numpy: no model, no device, well under a second."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench import quality_stats as qs


def test_blocks_never_span_two_windows():
    assert qs.block_bounds([5, 3], 2) == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 8)]
    assert qs.block_bounds([4], 8) == [(0, 4)]
    np.testing.assert_array_equal(qs.block_sums(np.arange(8), qs.block_bounds([5, 3], 2)),
                                  [1, 5, 4, 11, 7])
    with pytest.raises(ValueError):
        qs.block_sums(np.arange(9), qs.block_bounds([5, 3], 2))


def test_equal_blocks_give_the_batch_means_standard_error():
    rng = np.random.default_rng(0)
    means = rng.normal(2.5, 0.3, 40)
    r, se = qs.mean_se(means * 64, np.full(40, 64))
    assert r == pytest.approx(means.mean())
    assert se == pytest.approx(means.std(ddof=1) / math.sqrt(40))


def test_degenerate_inputs():
    assert math.isnan(qs.ratio_se([1.0], [2.0])[1]) and qs.ratio_se([1.0], [2.0])[0] == 0.5
    assert all(math.isnan(v) for v in qs.ratio_se([1.0, 2.0], [0.0, 0.0]))
    with pytest.raises(ValueError):
        qs.ratio_se([1.0, 2.0], [1.0])


def _ar1(rng, reps, n, phi):
    """reps independent AR(1) series of length n, unit marginal variance."""
    x = np.empty((reps, n))
    x[:, 0] = rng.normal(size=reps)
    e = rng.normal(scale=math.sqrt(1 - phi * phi), size=(reps, n))
    for t in range(1, n):
        x[:, t] = phi * x[:, t - 1] + e[:, t]
    return x


def test_block_standard_error_covers_correlated_tokens():
    """On correlated per-token values (AR(1), phi 0.9: the iid formula is ~4.4x too small)
    the block standard error matches the spread of the mean over independent replicates."""
    rng = np.random.default_rng(1)
    reps, n, block = 300, 8192, 256
    x = _ar1(rng, reps, n, 0.9)
    bounds = qs.block_bounds([n], block)
    ses = [qs.mean_se(qs.block_sums(row, bounds), [b - a for a, b in bounds])[1] for row in x]
    true_sd = x.mean(1).std(ddof=1)
    assert np.mean(ses) == pytest.approx(true_sd, rel=0.2)
    assert x[0].std() / math.sqrt(n) < 0.4 * true_sd  # what per-token errors would claim


def test_paired_increase_removes_the_texts_own_spread():
    """Config = bf16 x 1.001 plus small noise: the paired relative increase is 0.1% with a
    standard error far below what the spread of the text's NLL would give unpaired."""
    rng = np.random.default_rng(2)
    base = rng.gamma(2.0, 1.2, 64 * 1023)
    conf = base * 1.001 + rng.normal(0, 0.002, base.shape)
    bounds = qs.block_bounds([1023] * 64, 1024)
    bb, cb = (qs.block_sums(v, bounds) for v in (base, conf))
    db = qs.block_sums(conf - base, bounds)
    n = [b - a for a, b in bounds]
    st = qs.text_stats({"n": n, "nll": cb, "kl": db * 0, "agree": np.array(n, float),
                        "d_nll": db, "base_nll": bb}, paired=True)
    assert st["nll_increase_pct"] == pytest.approx(0.1, abs=0.005)
    unpaired = 100 * math.hypot(*(qs.mean_se(v, n)[1] for v in (bb, cb))) / base.mean()
    assert st["nll_increase_pct_se"] < unpaired / 50
    assert st["greedy_agreement"] == 1.0 and st["greedy_agreement_se"] == 0.0


def test_passkey_paired_standard_error_and_the_two_se_rule():
    base = np.ones(200, bool)
    for lost, met in ((3, True), (4, False)):
        ok = base.copy()
        ok[:lost] = False
        p = qs.passkey_paired(ok, base)
        d = ok.astype(float) - base
        assert p["delta_pts"] == pytest.approx(-100 * lost / 200)
        assert p["delta_se_pts"] == pytest.approx(100 * d.std(ddof=1) / math.sqrt(200))
        assert (p["delta_pts"] >= -qs.PASSKEY_SE * p["delta_se_pts"]) is met
        assert (p["lost"], p["gained"]) == (lost, 0)
        acc = 1 - lost / 200
        assert p["accuracy_se"] == pytest.approx(math.sqrt(acc * (1 - acc) / 200))
    assert qs.unbits(qs.bits([True, False, True])) == [True, False, True]


# -- targets and decision on synthetic results ------------------------------------------------
CTXS = (1024, 4096, 8192)


def _blocks(rng, nblk, inc_pct, kl_mean, noise):
    """Block sums for one (config, context): NLL increase ``inc_pct`` % and KL ``kl_mean``
    exactly, with block-to-block deviations of +-``noise`` (relative, alternating signs) on
    both, so the standard errors are ~noise x value / sqrt(nblk)."""
    n = np.full(nblk, 1023.0)
    base = 2.5 * n
    s = np.where(np.arange(nblk) % 2 == 0, 1.0, -1.0)
    d = base * (inc_pct / 100) * (1 + noise * s)
    kl = kl_mean * n * (1 + noise * rng.permutation(s))
    return {"n": n.tolist(), "nll": (base + d).tolist(), "kl": kl.tolist(),
            "agree": (0.95 * n).tolist(), "d_nll": d.tolist(), "base_nll": base.tolist()}


def _doc(spec: dict, passkey: dict | None = None, key="m", nblk=64, seed=3):
    """spec: {config: (inc_pct, kl, noise)}; the reference's KL is 0.01."""
    rng = np.random.default_rng(seed)
    runs, configs = [], [{"name": "bf16"}]
    for ctx in CTXS:
        runs.append({"config": "bf16", "context": ctx,
                     "blocks": {"n": [1023.0] * nblk, "nll": [2500.0] * nblk}})
    for name, (inc, kl, noise) in spec.items():
        configs.append({"name": name})
        for ctx in CTXS:
            b = _blocks(rng, nblk, inc, kl, noise)
            st = qs.text_stats(b, paired=True)
            runs.append({"config": name, "context": ctx, "blocks": b, **st})
    summary = []
    for name, (lost, n) in (passkey or {}).items():
        base = np.ones(n, bool)
        ok = base.copy()
        ok[:lost] = False
        for length in (1024, 2048, 4096, 8192):
            summary.append({"config": name, "length": length, **qs.passkey_paired(ok, base)})
    return {"model_key": key, "configs": configs, "runs": runs, "passkey_summary": summary}


REF = (0.5, 0.01, 0.05)


def test_targets_need_value_plus_one_standard_error():
    t = qs.evaluate(_doc({qs.REFERENCE: REF,
                          "fp8_e4m3:block": (0.10, 0.004, 0.05),        # meets
                          "fp8_e4m3:block+hadamard": (0.14, 0.004, 0.8),  # NLL se too big
                          "fp8_e4m3:token+hadamard": (0.05, 0.0049, 0.8),  # KL se too big
                          "fp8_e4m3:block+smooth:auto": (0.2, 0.001, 0.05)}))
    by = {x["config"]: x for x in t["configs"]}
    assert t["reference"] == qs.REFERENCE and by[qs.REFERENCE]["text_met"] is False
    assert t["text_met_by"] == ["fp8_e4m3:block"]
    r = by["fp8_e4m3:block+hadamard"]["contexts"][0]
    assert r["nll_increase_pct"] < qs.NLL_PCT < r["nll_increase_pct"] + r["nll_increase_pct_se"]
    r = by["fp8_e4m3:token+hadamard"]["contexts"][0]
    assert r["kl_ratio"] < qs.KL_RATIO < r["kl_ratio"] + r["kl_ratio_se"]
    assert by["fp8_e4m3:block"]["contexts"][0]["kl_ratio"] == pytest.approx(0.4, rel=0.05)
    assert not any(x["nll_met"] for x in by["fp8_e4m3:block+smooth:auto"]["contexts"])
    assert by["fp8_e4m3:block"]["passkey_met"] is None and by["fp8_e4m3:block"]["met"] is False


def test_targets_need_bf16_and_the_reference():
    assert qs.evaluate(_doc({"fp8_e4m3:block": (0.1, 0.004, 0.05)})) is None


def test_passkey_order_follows_the_rule():
    spec = {qs.REFERENCE: REF, "fp8_e4m3:block+smooth:auto": (0.05, 0.002, 0.05),
            "fp8_e4m3:block": (0.05, 0.004, 0.05), "fp8_e4m3:token+hadamard": (0.05, 0.004, 0.05)}
    t = qs.evaluate(_doc(spec))
    assert qs.passkey_order(t, 2) == ["fp8_e4m3:token+hadamard", "fp8_e4m3:block"]
    assert qs.passkey_order(None, 2) == []


def test_decide_picks_the_first_candidate_meeting_everything_on_every_model():
    good, pk = (0.05, 0.004, 0.05), {"bf16": (0, 200)}
    spec = {qs.REFERENCE: REF, "fp8_e4m3:token+hadamard": good, "fp8_e4m3:block": good,
            "fp8_e4m3:block+smooth:auto": good}
    docs = [_doc(spec, {**pk, "fp8_e4m3:token+hadamard": (0, 200), "fp8_e4m3:block": (1, 200),
                        "fp8_e4m3:block+smooth:auto": (0, 200)}, key=k, seed=i)
            for i, k in enumerate(("a", "b"))]
    # on the third model token+hadamard loses 10 keys at every length: block wins
    docs.append(_doc(spec, {**pk, "fp8_e4m3:token+hadamard": (10, 200),
                            "fp8_e4m3:block": (0, 200)}, key="c", seed=9))
    d = qs.decide(docs)
    assert d["winner"] == d["default"] == "fp8_e4m3:block" and d["models"] == ["a", "b", "c"]
    rows = {r["config"]: r for r in d["candidates"]}
    assert any("c passkey 1024" in m for m in rows["fp8_e4m3:token+hadamard"]["missed"])
    assert any("c: passkey not run" in m for m in rows["fp8_e4m3:block+smooth:auto"]["missed"])
    # a cost over 3% moves the choice on; none left: the reference stays
    d = qs.decide(docs, costs={"fp8_e4m3:block": {"decode_step_pct": 4.0, "capacity_pct": 2.9}})
    assert d["winner"] is None and d["default"] == qs.REFERENCE
    assert d["closest"] == "fp8_e4m3:block"  # one miss; the others were not measured
    # two models only: no decision
    d = qs.decide(docs[:2])
    assert d["winner"] is None and "incomplete" in d["note"]


def test_a_context_the_candidate_lacks_is_not_measured():
    """A candidate pruned after the first context (bench.quality_fake --keep) misses the
    contexts the reference has, so it cannot come out closest by having fewer checks."""
    good = (0.05, 0.004, 0.05)
    spec = {qs.REFERENCE: REF, "fp8_e4m3:block": good, "fp8_e4m3:block+hadamard": good}
    docs = [_doc(spec, {"bf16": (0, 200), "fp8_e4m3:block": (0, 200),
                        "fp8_e4m3:block+hadamard": (0, 200)}, key=k, seed=i)
            for i, k in enumerate("abc")]
    for d in docs:  # block lost its rows past the first context on model "b"
        d["runs"] = [r for r in d["runs"] if not (
            d["model_key"] == "b" and r["config"] == "fp8_e4m3:block" and r["context"] > CTXS[0])]
    d = qs.decide(docs)
    rows = {r["config"]: r for r in d["candidates"]}
    assert [m for m in rows["fp8_e4m3:block"]["missed"] if "not measured" in m] == [
        f"b {c}: not measured" for c in CTXS[1:]]
    assert d["winner"] == "fp8_e4m3:block+hadamard"
