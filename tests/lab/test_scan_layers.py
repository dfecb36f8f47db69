"""lab.scan_layers computes transformer.forward's function with the layers under lax.scan:
hidden states, every pool and the statistics agree on fresh random weights and inputs
(float32; a prefill chunk across page boundaries and a decode-like step). Seconds, not minutes:
not behind the ``lab`` marker."""

from lab import scan_layers


def test_scan_equals_the_unrolled_forward():
    for rows, tokens in ((2, 40), (5, 1)):
        out = scan_layers.compare("qwen3-tiny", 3, rows, tokens, "float32", check=True)
        assert out["max_abs_hidden"] < 1e-4, out
        assert out["pools_max_abs"] < 1e-4, out
        assert out["stats_max_abs"] < 1e-4, out
