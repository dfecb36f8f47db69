"""Start-up calibration of a smoothing K transform: a dynamic scale mode (token, block) needs
only the K mean, so the engine runs one pass over the built-in text for it; a static mode
still measures its amax in the shifted basis (a second pass). The one-pass shift equals the
two-pass measurement's mean."""

from __future__ import annotations

import numpy as np
import pytest

from jfp8kv import LLM
from jfp8kv.engine import calibrate as engine_calibrate
from jfp8kv.kvcache.calibrate import BUILTIN_TEXT
from jfp8kv.models.loader import load_model


@pytest.fixture(scope="module")
def qwen2(tiny_hf_checkpoint):
    return load_model(str(tiny_hf_checkpoint("qwen2")), "float32")


def _passes(monkeypatch) -> list:
    """Record each calibration pass (``engine.calibrate._run``) the engine makes."""
    calls, real = [], engine_calibrate._run
    monkeypatch.setattr(engine_calibrate, "_run",
                        lambda *a, **kw: (calls.append(a[3].kv_rotation), real(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("mode,passes", [("token", 1), ("channel", 2)])  # tiny head_dim 16: no block
def test_smoothing_calibrates_in_one_pass_for_dynamic_modes(qwen2, monkeypatch, mode, passes):
    calls = _passes(monkeypatch)
    llm = LLM(loaded=qwen2, kv_cache_dtype="fp8_e4m3", kv_scale_mode=mode, kv_rotation="smooth",
              max_model_len=128, kv_cache_memory=1 << 20)
    assert len(calls) == passes, calls
    shift = np.stack([np.asarray(s) for s in llm.engine.runner.cache["kv"].k_shift])
    monkeypatch.undo()
    ids = [qwen2.tokenizer.encode(BUILTIN_TEXT)]
    page = llm.cache_info()["page_size"]
    want = engine_calibrate.measure_amax(qwen2.config, qwen2.params, ids, page_size=page,
                                         kv_rotation="smooth").k_mean
    assert np.abs(want).max() > 0.1  # qwen2's K biases: a real shift
    np.testing.assert_array_equal(shift, want)
    assert llm.kv_scales_source is None if passes == 1 else llm.kv_scales_source is not None
