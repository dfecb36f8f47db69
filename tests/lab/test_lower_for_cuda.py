"""lab.lower_for_cuda lowers a forward for CUDA on a machine without a GPU, with the kernels
routed as on a Hopper card: the prefill through the Mosaic GPU kernel, the decode step
through the Triton one. Seconds: not behind the ``lab`` marker."""

import jfp8kv.kernels as kernels
from lab import lower_for_cuda


def test_prefill_lowers_through_mosaic_and_decode_through_triton(monkeypatch):
    monkeypatch.setattr(kernels, "is_hopper", lambda: True)  # what as_hopper() does
    prefill = lower_for_cuda.lower_once("qwen3-0.6b", 2, 1, 256, "float8_e4m3fn", profile=5)
    assert prefill["mosaic_gpu"] and prefill["lower_s"] > 0
    assert len(prefill["profile"]) == 5
    decode = lower_for_cuda.lower_once("qwen3-0.6b", 2, 8, 1, "float8_e4m3fn")
    assert decode["triton"] and not decode["mosaic_gpu"]
