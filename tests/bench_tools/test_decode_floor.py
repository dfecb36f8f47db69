"""bench.decode_floor --samplers: each sampler variant timed on the engine's own decode
dispatch (log-probs through the switched or the per-mix executable), one record each."""

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
