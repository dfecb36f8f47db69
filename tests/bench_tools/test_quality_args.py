"""bench.quality's config syntax (K rotations included) and issue #14's targets evaluation,
and bench.kernels' --kv-rotation argument path. Pure Python: no model, no device."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from bench import kernels, quality


@pytest.mark.parametrize("text, want", [
    ("bf16", ("auto", None, "none", None)),
    ("fp8_e4m3:token", ("fp8_e4m3", "token", "none", None)),
    ("fp8_e5m2:channel", ("fp8_e5m2", "channel", "none", "calib")),
    ("fp8_e4m3:tensor:0.25", ("fp8_e4m3", "tensor", "none", "0.25")),
    ("fp8_e4m3:token+hadamard", ("fp8_e4m3", "token", "hadamard", None)),
    ("fp8_e4m3:block+smooth", ("fp8_e4m3", "block", "smooth", "calib")),
    ("fp8_e4m3:block+smooth:auto", ("fp8_e4m3", "block", "smooth", "auto")),
    ("fp8_e4m3:tensor+smooth+hadamard:calib", ("fp8_e4m3", "tensor", "smooth+hadamard", "calib")),
    ("fp8_e4m3:tensor+hadamard", ("fp8_e4m3", "tensor", "hadamard", "calib")),
])
def test_parse_config_accepts(text, want):
    c = quality.parse_config(text)
    assert (c["kv_cache_dtype"], c["kv_scale_mode"], c["kv_rotation"], c["scales"]) == want
    assert c["name"] == ("bf16" if text == "bf16" else text)


@pytest.mark.parametrize("text, says", [
    ("fp8:token", "format"), ("fp8_e4m3", "format"), ("fp8_e4m3:tok", "scale mode 'tok'"),
    ("fp8_e4m3:token+rot", "rotation 'rot'"), ("fp8_e4m3:token+", "rotation ''"),
    ("fp8_e4m3:token+none", "rotation 'none'"), ("fp8_e4m3:tensor:-1", "scales '-1'"),
    ("fp8_e4m3:tensor:big", "scales 'big'"), ("fp8_e4m3:token:calib:2", "format"),
])
def test_parse_config_rejects_with_the_syntax(text, says):
    with pytest.raises(ValueError) as e:
        quality.parse_config(text)
    msg = str(e.value)
    assert repr(text) in msg and "smooth+hadamard" in msg and "fp8_e4m3:token+hadamard" in msg
    if says != "format":
        assert says in msg


def test_config_names_expands_presets_in_order():
    names = quality.config_names("fp8_e4m3:token,rotation", quick=False)
    assert names[:2] == ["fp8_e4m3:token", "bf16"]
    assert len(names) == len(set(names)) == 13
    assert {quality.parse_config(n)["kv_rotation"] for n in names} == {
        "none", "hadamard", "smooth", "smooth+hadamard"}
    assert quality.config_names(None, quick=True) == quality.QUICK_CONFIGS


def test_main_rejects_a_bad_config_before_loading_anything(capsys):
    with pytest.raises(SystemExit):
        quality.main(["--configs", "bf16,fp8_e4m3:token+rotate", "--no-passkey"])
    assert "unknown K rotation 'rotate'" in capsys.readouterr().err


def _doc(rng, kl: dict, nll_pct: dict):
    """Synthetic runs: bf16 and one row per (config, context) from KL and NLL increase (%)."""
    ctxs = (1024, 4096, 8192)
    base = {c: float(rng.uniform(2.0, 3.0)) for c in ctxs}
    runs = [{"config": "bf16", "context": c, "mean_nll": base[c], "kl": 0.0,
             "greedy_agreement": 1.0} for c in ctxs]
    configs = [{"name": "bf16"}]
    for name in kl:
        c = quality.parse_config(name)
        configs.append({"name": name, "kv_scale_mode": c["kv_scale_mode"],
                        "kv_rotation": c["kv_rotation"]})
        for i, ctx in enumerate(ctxs):
            runs.append({"config": name, "context": ctx, "kl": kl[name][i],
                         "mean_nll": base[ctx] * (1 + nll_pct[name][i] / 100),
                         "greedy_agreement": 0.9})
    return {"runs": runs, "configs": configs}


def test_rotation_targets_on_a_synthetic_doc():
    rng = np.random.default_rng()
    b = rng.uniform(0.005, 0.01, 3)
    kl = {"fp8_e4m3:token": list(b),
          "fp8_e4m3:token+hadamard": list(0.4 * b),             # meets both
          "fp8_e4m3:block+smooth": list(0.4 * b),               # NLL too high at 8k
          "fp8_e4m3:tensor+smooth+hadamard:calib": list(0.6 * b)}  # KL too high
    nll = {"fp8_e4m3:token": [0.35, 0.55, 0.65], "fp8_e4m3:token+hadamard": [0.05, 0.08, 0.02],
           "fp8_e4m3:block+smooth": [0.05, 0.08, 0.12],
           "fp8_e4m3:tensor+smooth+hadamard:calib": [0.0, 0.0, 0.0]}
    t = quality.evaluate_rotation_targets(_doc(rng, kl, nll))
    assert t["baseline"] == "fp8_e4m3:token"
    by = {x["config"]: x for x in t["configs"]}
    assert set(by) == set(kl) - {"fp8_e4m3:token"}
    assert t["met_by"] == ["fp8_e4m3:token+hadamard"]
    assert by["fp8_e4m3:block+smooth"]["met"] is False
    assert [r["met"] for r in by["fp8_e4m3:block+smooth"]["contexts"]] == [True, True, False]
    tensor = by["fp8_e4m3:tensor+smooth+hadamard:calib"]
    assert tensor["kv_rotation"] == "smooth+hadamard" and tensor["met"] is False
    for r in by["fp8_e4m3:token+hadamard"]["contexts"]:
        assert r["kl_ratio"] == pytest.approx(0.4, abs=1e-4)
    assert list(t["baseline_nll_increase_pct"].values()) == pytest.approx([0.35, 0.55, 0.65],
                                                                          abs=1e-3)


def test_rotation_targets_need_bf16_and_the_baseline():
    rng = np.random.default_rng()
    doc = _doc(rng, {"fp8_e4m3:token+hadamard": [0.001] * 3}, {"fp8_e4m3:token+hadamard": [0] * 3})
    assert quality.evaluate_rotation_targets(doc) is None


def test_kernels_rotation_args():
    ap = argparse.ArgumentParser()
    assert kernels.parse_rotation_args(ap, "", "decode") == ((), ("decode",))
    rots, ops = kernels.parse_rotation_args(ap, "all", "decode,prefill,store")
    assert rots == ("hadamard", "smooth", "smooth+hadamard") and ops == kernels.ROTATION_OPS
    for spec, ops in (("hadamard,spin", "decode"), ("none", "decode"), ("hadamard", "attn")):
        with pytest.raises(SystemExit):
            kernels.parse_rotation_args(ap, spec, ops)


def test_kernels_rotation_summary_against_the_target():
    rows = [{"op": "decode_attention", "kv_rotation": "hadamard", "cost_pct": c}
            for c in (0.5, 2.9)]
    rows += [{"op": "prefill_attention", "kv_rotation": "hadamard", "cost_pct": 3.5},
             {"op": "prefill_attention", "kv_rotation": "none", "ratio_vs_none": 1.01,
              "repeat": True}]
    s = {(x["op"], x["kv_rotation"]): x for x in kernels.rotation_summary(rows)}
    assert s[("decode_attention", "hadamard")]["under_target"] is True
    assert s[("decode_attention", "hadamard")]["max_cost_pct"] == 2.9
    assert s[("prefill_attention", "hadamard")]["under_target"] is False
    assert s[("prefill_attention", "hadamard")]["noise_pct_max"] == pytest.approx(1.0)
    assert s[("prefill_attention", "hadamard")]["resolved"] is True
    assert s[("decode_attention", "hadamard")]["noise_pct_max"] is None
    assert s[("decode_attention", "hadamard")]["resolved"] is False


def test_kernels_rotation_phase_adds_the_matched_store():
    """Per phase: (attention extra + the step's store extra) / attention "none" ms, each from
    the medians of the matched rows; stores matched by mode, head shape and the step's rows;
    an unmatched store is reported, not invented."""
    shapes = kernels.rotation_shapes("store", smoke=False)
    for b, c, _, _, hkv, d in kernels.rotation_shapes("prefill", smoke=False):
        assert (b * c, hkv, d) in shapes
    for b, _, _, hkv, d in kernels.rotation_shapes("decode", smoke=False):
        assert (b, hkv, d) in shapes
    pre = dict(op="prefill_attention", kv_scale_mode="token", batch=1, tokens=2048,
               context=4096, num_heads=32, num_kv_heads=8, head_dim=128)
    dec = dict(op="decode_attention", kv_scale_mode="token", batch=64, context=8192,
               num_heads=32, num_kv_heads=8, head_dim=128)
    st = dict(op="store", kv_scale_mode="token", batch=1, num_kv_heads=8, head_dim=128)
    rows = [{**pre, "kv_rotation": r, "ms": ms} for r, ms in
            (("none", 0.50), ("hadamard", 0.51), ("none", 0.52))]
    rows += [{**st, "tokens": 2048, "kv_rotation": r, "ms": ms} for r, ms in
             (("none", 0.013), ("hadamard", 0.016), ("none", 0.013))]
    rows += [{**st, "tokens": 8192, "kv_rotation": "hadamard", "ms": 9.0}]  # not this step's
    rows += [{**dec, "kv_rotation": r, "ms": ms} for r, ms in
             (("none", 0.40), ("hadamard", 0.40), ("none", 0.40))]
    phase = {(x["phase"], x["kv_rotation"]): x for x in kernels.rotation_phase_rows(rows)}
    p = phase[("prefill", "hadamard")]
    assert p["attention_none_ms"] == pytest.approx(0.51)
    assert p["store_extra_ms"] == pytest.approx(0.003)
    assert p["cost_pct"] == pytest.approx(100 * (0.0 + 0.003) / 0.51, abs=0.01)
    assert p["noise_pct"] == pytest.approx(100 * 0.02 / 0.51, abs=0.01)
    d = phase[("decode", "hadamard")]
    assert d["store_rows"] == 64 and d["store_extra_ms"] is None and d["cost_pct"] == 0.0
    s = {x["phase"]: x for x in kernels.rotation_phase_summary(list(phase.values()))}
    assert s["prefill"]["under_target"] is True and s["prefill"]["store_included"] is True
    assert s["prefill"]["resolved"] is False  # 3.9% noise: no verdict to trust
    assert s["decode"]["store_included"] is False
