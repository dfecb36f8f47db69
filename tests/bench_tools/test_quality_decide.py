"""bench.quality's issue-36 plumbing without a model: the --decide presets, the text layout
(consecutive windows before the calibration slice), block records from per-position scores,
--survivors-of and --resume's compatibility check. No device, a few seconds (JAX import)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench import quality, quality_stats as qs


class CharTokenizer:
    """One token per character: token counts are character counts."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 50000 for c in text]


def test_decide_preset_and_defaults():
    ap = quality.arg_parser()
    st = quality.settings(ap.parse_args(["--decide"]), ap)
    assert [c["name"] for c in st["configs"]] == list(qs.DECIDE_CONFIGS)
    assert st["min_scored"] == qs.MIN_SCORED and st["keys"] * len(st["depths"]) == 200
    assert st["passkey_for"] == "text-pass" and st["contexts"] == [1024, 4096, 8192]
    assert st["lengths"] == [1024, 2048, 4096, 8192]
    smooth = [c for c in st["configs"] if "smooth" in c["kv_rotation"]]
    assert len(smooth) == 4 and all(c["scales"] == "auto" for c in smooth)
    st = quality.settings(ap.parse_args(["--decide", "--quick", "--no-passkey"]), ap)
    assert st["min_scored"] == 512 and st["passkey_for"] == "none"
    st = quality.settings(ap.parse_args([]), ap)  # the old defaults are unchanged
    assert st["min_scored"] is None and st["keys"] == 25 and st["passkey_for"] == "all"


def test_windows_score_at_least_the_minimum():
    for ctx in (1024, 4096, 8192):
        n = quality.windows_for(64_000, ctx)
        assert n * (ctx - 1) >= 64_000 > (n - 1) * (ctx - 1)
    assert [quality.windows_for(64_000, c) for c in (1024, 4096, 8192)] == [63, 16, 8]


def test_scored_windows_are_consecutive_and_end_before_the_calibration_slice():
    tok = CharTokenizer()
    ids = quality.scored_ids(tok)
    assert len(ids) == quality.CALIB_CHARS  # characters [0, CALIB_CHARS) only
    w = quality.scored_windows(tok, 1024, 63)
    assert len(w) == 63 and w[0] == ids[:1024] and w[62] == ids[62 * 1024:63 * 1024]
    assert quality.scored_windows(tok, 8192, 8)[0] == ids[:8192]  # same stream per context
    calib = quality.text_windows(tok, 2048, 1, quality.CALIB_CHARS)[0]
    text = quality.natural_text()
    start = text.index("\n\n", quality.CALIB_CHARS) + 2
    assert start >= quality.CALIB_CHARS and calib == tok.encode(text[start:start + 2048])
    with pytest.raises(ValueError, match="calibration slice"):
        quality.scored_windows(tok, 8192, 100)


def test_text_record_blocks_and_paired_errors():
    rng = np.random.default_rng(0)
    lengths = [1023] * 4
    base = rng.gamma(2.0, 1.2, sum(lengths))
    conf = base + rng.normal(0.002, 0.01, base.shape)
    kl = rng.uniform(0, 0.02, base.shape)
    agree = rng.uniform(size=base.shape) < 0.95
    scored = {"nll": conf.astype(np.float32), "base_nll": base.astype(np.float32),
              "kl": kl, "agree": agree, "lengths": lengths}
    r = quality.text_record(scored, 512, baseline=False)
    assert r["blocks_n"] == 8 and sum(r["blocks"]["n"]) == r["positions"] == 4092
    assert r["mean_nll"] == pytest.approx(conf.mean(), rel=1e-6)
    assert r["kl"] == pytest.approx(kl.mean()) and r["greedy_agreement"] == pytest.approx(
        agree.mean())
    inc = 100 * (conf.astype(np.float32).sum(dtype=np.float64)
                 / base.astype(np.float32).sum(dtype=np.float64) - 1)
    assert r["nll_increase_pct"] == pytest.approx(inc, rel=1e-6)
    assert 0 < r["nll_increase_pct_se"] < 0.1 and math.isfinite(r["kl_se"])
    b = quality.text_record({**scored, "nll": scored["base_nll"]}, 512, baseline=True)
    assert set(b["blocks"]) == {"n", "nll"} and b["kl"] == 0.0 and "nll_increase_pct" not in b
    json.dumps(r)  # plain Python numbers only


def test_survivors_and_resumable(tmp_path):
    n = [1023.0] * 8

    def run(cfg, ctx, inc, kl):
        blocks = {"n": n, "nll": [2500.0] * 8, "kl": [kl * 1023] * 8, "agree": [1000.0] * 8,
                  "d_nll": [25.0 * inc] * 8, "base_nll": [2500.0] * 8}
        return {"config": cfg, "context": ctx, "blocks": blocks, **qs.text_stats(blocks, True)}

    def doc(ok):
        runs = [{"config": "bf16", "context": c, "blocks": {"n": n, "nll": [2500.0] * 8}}
                for c in (1024, 4096)]
        names = ["bf16", qs.REFERENCE, "fp8_e4m3:block", "fp8_e4m3:token+hadamard"]
        for c in (1024, 4096):
            runs += [run(qs.REFERENCE, c, 0.5, 0.01), run("fp8_e4m3:block", c, 0.1, 0.004),
                     run("fp8_e4m3:token+hadamard", c, 0.1, 0.004 if ok else 0.008)]
        return {"configs": [{"name": x} for x in names], "runs": runs}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(doc(True)))
    b.write_text(json.dumps(doc(False)))
    assert quality.survivors(f"{a}") == {"fp8_e4m3:block", "fp8_e4m3:token+hadamard"}
    assert quality.survivors(f"{a},{b}") == {"fp8_e4m3:block"}
    assert quality.survivors(f"{a},{tmp_path / 'missing.json'}") == quality.survivors(f"{a}")
    assert quality.survivors(f"{tmp_path / 'missing.json'}") is None
    fresh = {"model_key": "m", "dtype": "bfloat16", "quick": False, "text": {"w": 1},
             "passkey_setup": {"keys": 40}, "se_block": 1024}
    assert quality.resumable(dict(fresh), fresh) is None
    assert "se_block" in quality.resumable({**fresh, "se_block": 512}, fresh)
