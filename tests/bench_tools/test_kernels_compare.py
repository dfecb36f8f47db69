"""bench.kernels --compare prologue: the engine's fused store timed per fp8 mode beside bf16,
side by side in one interleaved timing (interpret mode here: a plumbing test, no timing is
asserted)."""

import json

from bench import kernels


def test_compare_prologue_rows(tmp_path):
    out = tmp_path / "k.json"
    kernels.main(["--smoke", "--compare", "prologue", "--out", str(out)])
    rows = json.loads(out.read_text())["compare"]
    assert [r["op"] for r in rows] == ["prologue_store"] * 5
    assert [r["kv_scale_mode"] for r in rows] == [None, "token", "tensor", "block", "channel"]
    assert all("error" not in r and r["ms"] > 0 for r in rows)
    assert all("ratio_vs_bf16" in r for r in rows[1:])
    # queries in and out and the rotary tables count in the bytes moved
    assert rows[0]["bytes"] > 2 * 40 * 2 * 64 * 4
