"""python -m bench.serving against the real server: token accounting and the JSON record."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from bench.serving import matrix

from .conftest import REPO_ROOT, metric_values, wait_idle

TRANSPORTS = [pytest.param(t, marks=pytest.mark.skipif(
    importlib.util.find_spec(t) is None, reason=f"{t} is not installed")) for t in ("aiohttp", "httpx")]


def _bench(server, out_file, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "bench.serving", "--base-url", server.url, "--disable-tqdm",
           "--output-file", str(out_file), "--token-id-range", "100", "20000", *flags]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    return json.loads(out_file.read_text().splitlines()[-1])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fixed_lengths_exact_token_counts(server, tmp_path, transport):
    before = metric_values(server.url)["jfp8kv_prompt_tokens_total"]
    rec = _bench(server, tmp_path / "out.jsonl", "--num-prompts", "8", "--random-input-len", "12",
                 "--random-output-len", "6", "--max-concurrency", "4", "--ignore-eos",
                 "--warmup-requests", "1", "--transport", transport)
    assert rec["backend"] == f"openai-completions ({transport})"
    assert rec["completed"] == 8 and rec["failed"] == 0
    assert rec["total_input_tokens"] == 8 * 12 and rec["total_output_tokens"] == 8 * 6
    assert rec["prompt_len_mismatches"] == 0 and rec["output_len_mismatches"] == 0
    # the server saw exactly the warm-up plus the timed prompts, token for token
    assert metric_values(server.url)["jfp8kv_prompt_tokens_total"] - before == 9 * 12
    for key in ("median_ttft_ms", "mean_itl_ms", "p99_tpot_ms", "std_e2e_latency_ms"):
        assert rec[key] > 0, key
    assert rec["mean_e2e_latency_ms"] >= rec["mean_ttft_ms"]
    assert rec["output_throughput"] == rec["total_output_tokens"] / rec["duration"]
    assert rec["request_throughput"] > 0 and rec["total_token_throughput"] == rec["total_throughput"]
    assert rec["model"] == "tiny" and "--random-input-len 12" in rec["command"]
    assert rec["request_rate"] == "inf"


def test_ranged_lengths_and_poisson_rate(server, tmp_path):
    out = tmp_path / "out.jsonl"
    rec = _bench(server, out, "--num-prompts", "6", "--random-input-len", "14",
                 "--random-output-len", "4", "--random-range-ratio", "0.5", "--request-rate", "50",
                 "--ignore-eos", "--warmup-requests", "0", "--seed", "3")
    assert rec["completed"] == 6 and rec["prompt_len_mismatches"] == 0
    assert all(7 <= n <= 14 for n in rec["input_lens"]) and len(set(rec["input_lens"])) > 1
    assert all(2 <= n <= 4 for n in rec["output_lens"])
    assert rec["total_input_tokens"] == sum(rec["input_lens"])
    assert rec["total_output_tokens"] == sum(rec["output_lens"])
    assert len(out.read_text().splitlines()) == 1


def test_shared_prefix_workload_reports_cache_hits(server, tmp_path):
    # 2 groups x 3 requests sharing a 32-token prefix (2 pages), 8-token questions; one at a
    # time, so every request but the first of each group finds its group's prefix cached.
    before = metric_values(server.url)
    rec = _bench(server, tmp_path / "out.jsonl", "--num-prompts", "6",
                 "--shared-prefix-groups", "2", "--shared-prefix-len", "32",
                 "--random-input-len", "8", "--random-output-len", "3", "--max-concurrency", "1",
                 "--ignore-eos", "--warmup-requests", "1", "--seed", "5")
    after = wait_idle(server.url)
    assert rec["dataset_name"] == "shared-prefix" and rec["shared_prefix_len"] == 32
    assert rec["completed"] == 6 and rec["prompt_len_mismatches"] == 0
    assert rec["input_lens"] == [40] * 6 and rec["total_input_tokens"] == 240
    # one cold request per group; the other four reuse the 2 prefix pages
    assert sorted(rec["cached_tokens"]) == [0, 0, 32, 32, 32, 32]
    assert rec["total_cached_tokens"] == 128 and rec["num_cache_hit_requests"] == 4
    assert rec["prefix_cache_hit_rate"] == 128 / 240
    assert rec["median_ttft_hit_ms"] > 0 and rec["median_ttft_cold_ms"] > 0
    hits = "jfp8kv_prefix_cache_hits_total"
    assert after[hits] - before[hits] == 128  # the warm-up request has a prefix of its own


def test_matrix_shared_prefix_workloads_and_caching_axis():
    a, b = matrix.parse_workloads("4096x32+256:256:64:512:64:16,512:128:1:4")
    assert (a["input_len"], a["shared_prefix_len"], a["shared_prefix_groups"]) == (4352, 4096, 32)
    assert (a["num_prompts"], a["warm_n"], a["warm_out"]) == (512, 64, 16)
    assert (b["input_len"], b["shared_prefix_groups"], b["shared_prefix_len"]) == (512, 0, 0)
    for bad in ("4096x0+256:16:1:4", "4096x2:16:1:4", "4096x2+256:16:1"):
        with pytest.raises(ValueError, match="LxG\\+Q"):
            matrix.parse_workloads(bad)
    assert matrix.parse_caching("on,off") == [True, False] and matrix.parse_caching(None) == [None]
    with pytest.raises(ValueError, match="on, off"):
        matrix.parse_caching("yes")
