"""lab.scan_layers computes transformer.forward's function with the layers under lax.scan
over one pool of every layer's pages (page tables and slots moved to each layer's pages):
hidden states, every pool and the statistics agree on fresh random weights and inputs
(float32; a prefill chunk across page boundaries and a decode-like step), through the
reference kernels and the Pallas kernels in interpret mode, which are not changed for it.
Seconds, not minutes: not behind the ``lab`` marker."""

import pytest

from lab import scan_layers


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_scan_equals_the_unrolled_forward(backend):
    for rows, tokens in ((2, 40), (5, 1)):
        out = scan_layers.compare("qwen3-tiny", 3, rows, tokens, "float32", check=True,
                                  backend=backend)
        assert out["max_abs_hidden"] < 1e-4, out
        assert out["pools_max_abs"] < 1e-4, out
        assert out["stats_max_abs"] < 1e-4, out


def test_timed_rows_have_run_seconds():
    out = scan_layers.compare("qwen3-tiny", 2, 2, 16, "float8_e4m3fn", check=False, repeats=2)
    assert "run_s" in out["unrolled"] and "run_s" in out["scan"]
