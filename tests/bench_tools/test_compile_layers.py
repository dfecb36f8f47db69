"""bench.compile_layers on a tiny preset: one fresh process per layer count, the warm-up's
profile per row, and a line fitted through them."""

import json

from bench import compile_layers


def test_rows_and_fit(tmp_path):
    out = tmp_path / "layers.json"
    compile_layers.main(["--preset", "qwen3-tiny", "--layers", "1,2", "--max-model-len", "256",
                         "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["layers"] for r in doc["rows"]] == [1, 2]
    assert all(r["executables"] > 0 and r["compile_s"] > 0 for r in doc["rows"])
    a, b = doc["rows"]
    slope = doc["fit"]["compile_s"]["per_layer_s"]
    assert abs(slope - (b["compile_s"] - a["compile_s"])) < 1e-2  # two points: their line
    assert "bench.compile_layers" in doc["command"] and doc["machine"]
