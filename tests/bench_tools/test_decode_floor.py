"""bench.decode_floor --samplers: each sampler variant timed on the engine's own decode
dispatch (log-probs through the switched or the per-mix executable), one record each;
DeepSeek-V4 (issue 57) with lists of contexts and max_model_lens on one engine each, its
rows in state slots, its floor from its sparse attention's bytes (plumbing: no timing is
asserted)."""

import json

import pytest

from bench import decode_floor


def test_samplers_are_timed_side_by_side(tmp_path):
    out = tmp_path / "floor.json"
    assert decode_floor.main(["--model", "random:qwen3-tiny", "--batch", "3", "--context", "40",
                              "--steps", "2", "--reps", "1", "--configs", "fp8_e4m3:token",
                              "--samplers", "plain,logprobs:switched,logprobs:per-mix",
                              "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["floor"]
    assert [r["sampler"] for r in rows] == ["plain", "logprobs:switched", "logprobs:per-mix"]
    for r in rows:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0 and len(r["step_ms_all"]) == 1


def test_unknown_sampler_is_refused(capsys):
    with pytest.raises(SystemExit):
        decode_floor.main(["--samplers", "plain,topk"])
    assert "unknown ['topk']" in capsys.readouterr().err


def test_command_line_names_the_xla_flags_it_ran_under(monkeypatch):
    """A result's command is what reproduces it: XLA_FLAGS change what XLA compiles."""
    from bench.common import command_line

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert command_line("bench.offline", ["--logprobs", "1"]) == \
        "python -m bench.offline --logprobs 1"
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE")
    assert command_line("bench.offline", ["--logprobs", "1"]) == (
        "XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE "
        "python -m bench.offline --logprobs 1")
    monkeypatch.setenv("XLA_FLAGS", "--a=1 --b=2")  # quoted as one shell word
    assert command_line("bench.x", []) == "'XLA_FLAGS=--a=1 --b=2' python -m bench.x"


def test_v4_contexts_and_max_model_lens(tmp_path):
    from bench import offline
    from jfp8kv.models.v4_presets import v4_config

    out = tmp_path / "floor.json"
    assert decode_floor.main(["--model", "random:deepseek-v4-tiny", "--batch", "2",
                              "--context", "24,40", "--max-model-len", "64,1024", "--steps",
                              "2", "--reps", "1", "--configs", "fp8_e4m3:block",
                              "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["floor"]
    assert [(r["context"], r["max_model_len"]) for r in rows] == [
        (24, 64), (40, 64), (24, 1024), (40, 1024)]
    terms = offline.model_terms(v4_config("deepseek-v4-tiny"), "bfloat16", "fp8_e4m3")
    for r in rows:
        assert r["step_ms"] > 0 and r["page_size"] == 16 and r["bytes_per_token"] == 0
        sparse = offline.v4_sparse_cost(terms["v4_sparse"], 2, 2 * (r["context"] + 2))[1]
        assert r["kv_bytes"] == int(sparse + 2 * terms["state_rw_bytes"])
        assert r["ideal_weight_bytes"] < r["weight_bytes"]  # 2 rows touch some experts
    assert set(doc["summary"]) == {"fp8_e4m3:block/context/24->40",
                                   "fp8_e4m3:block/max_model_len/64->1024"}
    assert decode_floor.main(["--model", "random:deepseek-v4-tiny", "--time-limit", "0",
                              "--out", str(out)]) == 0
    assert json.loads(out.read_text())["floor"] == []
