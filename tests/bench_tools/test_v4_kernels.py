"""bench.v4_kernels --paged --smoke: the issue-57 comparison (today's gather +
sparse_decode vs the in-place kernels) runs end to end on deepseek-v4-tiny in interpret
mode and writes its records and summary (a plumbing test: no timing is asserted)."""

import json

from bench import v4_kernels


def test_paged_smoke(tmp_path):
    out = tmp_path / "p.json"
    v4_kernels.main(["--paged", "--smoke", "--storages", "float8_e4m3fn", "--contexts",
                     "32", "--widths", "32,128", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert "python -m bench.v4_kernels --paged --smoke" in doc["command"]
    assert doc["machine"]["versions"]["jax"]
    recs = doc["records"]
    assert [(r["path"], r["table_tokens"]) for r in recs] == [
        ("in_place", 32), ("gather", 32), ("in_place", 32), ("gather", 32),
        ("in_place", 128), ("gather", 128)]
    for r in recs:
        assert "error" not in r, r.get("error")
        assert set(r["ms"]) >= {"window", "csa", "hca", "step"}
        assert r["bytes"]["step"] > 0
    for r in recs[::2]:  # in place: equal to the twins, top-k sets equal
        assert max(r["max_abs_err"].values()) < 1e-4
        assert r["csa_topk_rows_equal"] == 1.0
        assert r["ms"]["csa_index_list"] > 0
    assert doc["summary"]["in_place/float8_e4m3fn/step_width_128_over_32"] > 0
    launches = doc["launches"]  # the other launch settings, at the last context
    assert len(launches) == 4 and all("error" not in r and r["ms"]["step"] > 0
                                      for r in launches)
    assert {r["launch"]["num_warps"] for r in launches} == {4, 8}


def test_paged_time_limit(tmp_path):
    """Past --time-limit no case starts; each is recorded as skipped and the JSON kept."""
    out = tmp_path / "p.json"
    v4_kernels.main(["--paged", "--smoke", "--storages", "bfloat16", "--contexts", "32",
                     "--widths", "32,64", "--time-limit", "0", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["skipped"] for r in doc["records"]] == ["--time-limit 0.0 s"] * 3
    assert doc["summary"]["in_place/bfloat16/step_width_64_over_32"] is None
