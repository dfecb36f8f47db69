"""bench.offline's ideal model for DeepSeek-V4's sparse attention (issue 57): the terms of
flash-4l's pools against hand-computed numbers, ``ideal_time`` of a decode and a prefill
record against a hand computation (contexts past the window and the top-k, and one
below), and a CPU run of the tiny preset whose record carries them."""

from __future__ import annotations

import json
import math

import pytest

from bench import offline
from jfp8kv.engine.stats import StepRecord
from jfp8kv.models.v4_presets import v4_config

# flash-4l: layers 0-1 window-only, 2 CSA (m = 4, top-512, indexer 64 x 128), 3 HCA
# (m = 128); 64 heads x 512, window 128. fp8 rows: 512 e4m3 + 16 fp16 scales = 544 bytes.
# Compressor state per slot, float32: CSA main 4 x (4 * 512 + 2 * 512), its indexer
# 4 x (4 * 128 + 2 * 128), HCA 2 * 128 * 512: 146,432 values, read and written.
FLASH_4L = dict(window=128, layers=4, topk=512, csa_ratios=[4], hca_ratios=[128],
                row_flops=4 * 64 * 512, index_flops=2 * 64 * 128, index_bytes=256,
                state_rw_bytes=2 * 4 * 146_432)


@pytest.mark.parametrize("kv, row_bytes", [("fp8_e4m3", 544), ("bfloat16", 1024),
                                           ("float8_e4m3fn", 544)])
def test_v4_sparse_terms_of_flash_4l(kv, row_bytes):
    cfg = v4_config("deepseek-v4-flash-4l")
    assert offline.v4_sparse_terms(cfg, kv) == dict(FLASH_4L, row_bytes=row_bytes)
    terms = offline.model_terms(cfg, "bfloat16", kv)
    assert terms["v4_sparse"]["row_bytes"] == row_bytes and terms["attn_flops_per_pair"] == 0
    assert terms["state_rw_bytes"] == FLASH_4L["state_rw_bytes"]


def test_v4_ideal_time_matches_a_hand_computation():
    cfg = v4_config("deepseek-v4-flash-4l")
    terms = offline.model_terms(cfg, "bfloat16", "fp8_e4m3")
    # 32 rows at 65,536 tokens, 8 decode iterations; one 2,048-token prefill chunk after
    # 8,192 cached tokens; one decode row at context 10 (inside the window and the top-k).
    q, it = 32 * 8, 8
    c = 32 * sum(65_536 + i + 1 for i in range(8))
    dec = StepRecord(decode_rows=32, decode_tokens=q, decode_iterations=it, decode_kv_tokens=c)
    n, start = 2048, 8192
    pre = StepRecord(prefill_chunks=1, prefill_tokens=n,
                     prefill_pairs=n * start + n * (n + 1) // 2)
    short = StepRecord(decode_rows=1, decode_tokens=1, decode_iterations=1, decode_kv_tokens=10)
    got = offline.ideal_time([pre, dec, short], terms, 999, 700.0, 3.0)
    # decode: every layer its 128 window rows, CSA 512 entries and c / 4 indexer keys, HCA
    # c / 128 entries; the short row: 10 window rows per layer, 10 / 4 entries and keys, 0
    # whole HCA entries (10 / 128 of one)
    rows = 4 * 128 * q + 512 * q + c / 128
    keys = c / 4
    rows_s, keys_s = 4 * 10 + 10 / 4 + 10 / 128, 10 / 4
    w = offline.weight_bytes(terms, 32)
    want_bytes = (it * w + rows * 544 + keys * 256 + q * FLASH_4L["state_rw_bytes"]
                  + offline.weight_bytes(terms, 1) + rows_s * 544 + keys_s * 256
                  + FLASH_4L["state_rw_bytes"])
    assert math.isclose(got["decode_bytes"], want_bytes, rel_tol=1e-12)
    pairs = pre.prefill_pairs
    pre_rows = 4 * 128 * n + 512 * n + pairs / 128
    want_flops = (2 * terms["matmul_params"] * n + 2 * terms["logits_params"]
                  + pre_rows * 4 * 64 * 512 + pairs / 4 * 2 * 64 * 128)
    assert math.isclose(got["prefill_flops"], want_flops, rel_tol=1e-12)
    # the best-schedule ideal charges the same attention per live row
    best = offline.ideal_schedule([4], [3], 1, terms, 999, 700.0, 3.0)
    rows_4 = [4 * min(128, p) + min(512, p / 4) + p / 128 for p in (5, 6)]
    kv = sum(r * 544 + p / 4 * 256 for r, p in zip(rows_4, (5, 6)))
    want = 2 * (offline.weight_bytes(terms, 1) + FLASH_4L["state_rw_bytes"]) + kv
    assert math.isclose(best["decode_s"], want / 3e12, rel_tol=1e-12)


@pytest.mark.timeout(900)
def test_offline_v4_tiny_record(tmp_path):
    out = tmp_path / "offline.json"
    assert offline.main(["--model", "random:deepseek-v4-tiny", "--num-prompts", "2",
                         "--input-len", "40", "--output-len", "4", "--kv-cache-dtype",
                         "fp8_e4m3", "--warmup", "off", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "v4_sparse_cost" in doc["ideal_model"]
    (r,) = doc["runs"]
    assert r["model_terms"]["v4_sparse"] == offline.v4_sparse_terms(
        v4_config("deepseek-v4-tiny"), "fp8_e4m3")
    assert r["total_output_tokens"] == 8 and 0 < r["ideal"]["ideal_s"]
    assert r["ideal"]["ideal_s"] <= r["ideal"]["ideal_roofline_s"] * (1 + 1e-9)
