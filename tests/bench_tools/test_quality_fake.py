"""bench.quality_fake: the decision's text scores through the fake quantization on the CPU,
written so ``bench.quality --decide-from`` reads them, resumable window by window."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import fakequant as fq  # noqa: E402
from bench import quality_fake, quality_stats as qs  # noqa: E402

CONFIGS = "bf16,fp8_e4m3:token,fp8_e4m3:block+hadamard,fp8_e4m3:block"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("qf") / "q.json"
    quality_fake.main(["--configs", CONFIGS, "--contexts", "64,128", "--min-scored", "130",
                       "--keep", "1", "--out", str(out)])
    return out, json.loads(out.read_text())


def test_runs_are_the_decision_format(run):
    _, doc = run
    by = {(r["config"], r["context"]): r for r in doc["runs"]}
    # 130 positions: 3 windows of 64 (189 scored), 2 of 128 (254)
    assert by[("bf16", 64)]["positions"] == 189 and by[("bf16", 128)]["positions"] == 254
    assert by[("fp8_e4m3:token", 64)]["kl"] > 0
    t = qs.evaluate(doc)
    rows = {x["config"]: x for x in t["configs"]}
    assert rows["fp8_e4m3:token"]["contexts"][0]["kl_ratio"] == pytest.approx(1.0)
    # --keep 1: one candidate (the closer) is scored at 128, the other pruned after 64
    assert len(doc["pruned"]) == 1 and doc["pruned"][0]["after_context"] == 64
    pruned = doc["pruned"][0]["config"]
    assert (pruned, 128) not in by and ("fp8_e4m3:token", 128) in by
    kept = ({"fp8_e4m3:block+hadamard", "fp8_e4m3:block"} - {pruned}).pop()
    assert quality_fake.shortfall(rows[kept]["contexts"][0]) <= \
        doc["pruned"][0]["worst_shortfall"]
    d = qs.decide([doc, doc, doc])
    assert d["models"] == ["smollm2"] and len(d["candidates"]) == len(qs.CANDIDATES)


def test_window_scores_match_a_direct_forward(run):
    """The token config's per-position NLL and KL on the first 64-token window equal a
    forward of the same window through the hook, compared with rotation_cpu's KL."""
    import torch

    from bench.rotation_cpu import forward_lp, kl_agree, load

    out, _ = run
    z = np.load(str(out) + ".d/c64-w0.npz")
    key, gguf = quality_fake.resolve("smollm2")
    hf, tok = load(gguf)
    from bench import quality

    ids = quality.scored_windows(tok, 64, 1)[0]
    fq.set_quantizer(hf, None)
    base = forward_lp(hf, ids)
    fq.set_quantizer(hf, fq.KVQuantizer("fp8_e4m3", "token"))
    lp = forward_lp(hf, ids)
    fq.set_quantizer(hf, None)
    nxt = torch.tensor(ids[1:])
    np.testing.assert_allclose(z["fp8_e4m3:token|nll"], -lp[torch.arange(63), nxt].numpy(),
                               rtol=0, atol=1e-6)
    np.testing.assert_allclose(z["bf16|nll"], z["fp8_e4m3:token|base_nll"])
    kl, agree = kl_agree(base, lp)
    assert z["fp8_e4m3:token|kl"].mean() == pytest.approx(kl, rel=1e-5)
    assert z["fp8_e4m3:token|agree"].mean() == pytest.approx(agree)


def test_resume_reuses_every_window(run, monkeypatch):
    out, doc = run

    def boom(*a, **k):
        raise AssertionError("a finished window was scored again")

    monkeypatch.setattr(quality_fake, "window_scores", boom)
    quality_fake.main(["--configs", CONFIGS, "--contexts", "64,128", "--min-scored", "130",
                       "--keep", "1", "--out", str(out)])
    again = json.loads(out.read_text())
    strip = lambda d: [{k: v for k, v in r.items()} for r in d["runs"]]  # noqa: E731
    assert strip(again) == strip(doc)
