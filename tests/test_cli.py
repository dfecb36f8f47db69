"""Command-line flags come from the option dataclasses; user errors at start-up are one line
with exit code 2."""

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from jfp8kv.cli import add_engine_args, configs_from_args, flag_name, llm_kwargs
from jfp8kv.config import OPTION_CLASSES, CacheOptions, EngineConfig, LoadConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
# Flags of the first release: they keep their names.
RELEASED_FLAGS = ("--model", "--dtype", "--kv-cache-dtype", "--kv-scale-mode", "--kv-scales",
                  "--max-model-len", "--kv-cache-memory", "--page-size", "--max-num-seqs",
                  "--max-num-batched-tokens", "--attention-backend", "--seed")


def _parse(argv, defaults=None):
    return add_engine_args(argparse.ArgumentParser(), defaults).parse_args(argv)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_every_option_field_is_a_flag_with_help():
    p = add_engine_args(argparse.ArgumentParser())
    by_flag = {s: a for a in p._actions for s in a.option_strings}
    for cls in OPTION_CLASSES:
        for f in dataclasses.fields(cls):
            action = by_flag[flag_name(f)]
            assert action.dest == f.name and action.help, f.name
    assert set(RELEASED_FLAGS) <= set(by_flag)


def test_no_flags_give_the_config_defaults_and_flags_reach_the_configs():
    assert configs_from_args(_parse([])) == (LoadConfig(), CacheOptions(), EngineConfig())
    load, cache, engine = configs_from_args(_parse(
        ["--model", "m.gguf", "--dtype", "float32", "--kv-cache-dtype", "fp8",
         "--kv-scale-mode", "tensor", "--kv-scales", "0.25", "--page-size", "32",
         "--decode-buckets", "32,8", "--decode-steps", "4", "--min-prefill-chunk", "64",
         "--max-queue-len", "7"]))
    assert load == LoadConfig("m.gguf", "float32")
    assert cache == CacheOptions("fp8", "tensor", 0.25)
    assert engine == EngineConfig(page_size=32, decode_buckets=(8, 32), decode_steps=4,
                                  min_prefill_chunk=64, max_queue_len=7)
    assert configs_from_args(_parse(["--kv-scales", "s.json"]))[1].kv_scales == "s.json"
    assert llm_kwargs(_parse(["--seed", "3"]))["seed"] == 3
    assert _parse([], defaults={"max_model_len": 2048}).max_model_len == 2048


def test_server_and_generate_share_the_engine_flags():
    from jfp8kv.entrypoints.generate import parse_args as generate_args
    from jfp8kv.serve.__main__ import parse_args as serve_args

    assert generate_args(["hi"]).max_model_len == 2048 and serve_args([]).max_model_len is None
    flags = ["--max-queue-len", "5", "--decode-steps", "2", "--max-model-len", "64"]
    serve = serve_args([*flags, "--port", "1"])
    gen = generate_args(["hi", *flags])
    assert configs_from_args(serve) == configs_from_args(gen)
    assert configs_from_args(serve)[2].max_queue_len == 5 and serve.port == 1


def test_missing_model_is_one_line_and_exit_2_without_jax_noise(tmp_path):
    missing = str(tmp_path / "no-such-model")
    proc = subprocess.run([sys.executable, "-m", "jfp8kv", "generate", "--model", missing, "hi"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no traceback, no backend-probe line
    assert lines[0].startswith("python -m jfp8kv generate: error: cannot resolve model")
    assert missing in lines[0]


@pytest.mark.parametrize("command", ["serve", "calibrate"])
def test_missing_model_in_serve_and_calibrate(command, tmp_path, capsys):
    from jfp8kv.__main__ import main

    argv = [command, "--model", str(tmp_path / "nope")]
    if command == "calibrate":
        argv += ["--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "s.json")]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"error: cannot resolve model {str(tmp_path / 'nope')!r}: pass a "
                            "Hugging Face checkpoint directory (with config.json and "
                            "*.safetensors), a path to a .gguf file, or the name "
                            "'smollm2-135m-instruct' (the embedded default)")


def test_option_that_does_not_fit_is_one_line_and_exit_2(capsys):
    from jfp8kv.entrypoints.generate import main

    with pytest.raises(SystemExit) as exc:
        main(["hi", "--page-size", "12"])
    assert exc.value.code == 2
    assert "error: page_size must be a power of two in [8, 128], got 12" in capsys.readouterr().err


def test_serve_help_lists_every_flag(capsys):
    """``python -m jfp8kv.serve --help`` formats (a literal % in a field's help broke it)."""
    from jfp8kv.serve.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--decode-gemm-autotune" in out and "~4% faster" in out and "--warmup" in out
    # /tokenize's token strings are opt-in, as in vLLM: the help says so
    assert '"token_strs" (each token\'s string) is null unless the request sends' in out
    assert '"return_token_strs": true' in out


@pytest.mark.parametrize("command,argv,choice", [
    ("serve", ["--kv-cache-dtype", "fp9"], "'fp8_e4m3'"),
    ("generate", ["hi", "--kv-cache-dtype", "fp9"], "'fp8_e4m3'"),
    ("calibrate", ["--text", "t", "--out", "o", "--kv-rotation", "fp9"], "'smooth'"),
])
def test_a_bad_flag_is_one_line_not_the_whole_usage(command, argv, choice, capsys):
    """argparse prints its usage (dozens of lines for the engine's flags) before the error;
    the commands print the error alone, naming the choices."""
    from jfp8kv.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main([command, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "usage:" not in err[0], err
    assert err[0].startswith(f"python -m jfp8kv{'.' if command != 'generate' else ' '}"
                             f"{command}: error: ")
    assert "invalid choice: 'fp9'" in err[0] and choice in err[0] and "--help" in err[0]


def test_port_out_of_range_fails_before_the_model_loads(tmp_path, capsys):
    """``--port 99999`` used to load the model, then die in ``bind`` with a traceback: now
    the flags are checked first (the missing model is never looked at)."""
    from jfp8kv.serve.__main__ import main

    for port in ("99999", "-1"):
        with pytest.raises(SystemExit) as exc:
            main(["--model", str(tmp_path / "no-such-model"), "--port", port])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"python -m jfp8kv.serve: error: argument --port: {port} is not a TCP "
                       "port (0-65535) (--help lists the flags)"]


def test_busy_port_fails_before_the_model_loads(tmp_path, capsys):
    """The socket is bound before loading: a busy port fails in a second, not after the
    model's load (the missing model is never looked at)."""
    import socket

    from jfp8kv.serve.__main__ import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            main(["--model", str(tmp_path / "no-such-model"), "--port", str(port)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0], err


def test_unknown_random_preset_lists_every_preset(capsys):
    """The list names the DeepSeek-V4 presets too (they are resolved apart from the others),
    and every name in it loads."""
    from jfp8kv.entrypoints.generate import main
    from jfp8kv.models.presets import PRESETS
    from jfp8kv.models.v4_presets import v4_config

    with pytest.raises(SystemExit) as exc:
        main(["hi", "--model", "random:nosuchpreset"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    head = "python -m jfp8kv generate: error: unknown random preset 'nosuchpreset'; choose one of "
    assert err[0].startswith(head)
    names = [n.split(" (")[0] for n in err[0][len(head):].split(", ")]
    assert all(n.startswith("random:") for n in names), names
    names = [n[len("random:"):] for n in names]
    assert set(PRESETS) < set(names)
    v4 = set(names) - set(PRESETS)
    assert v4 == {"deepseek-v4-flash", "deepseek-v4-flash-<N>l", "deepseek-v4-tiny"}
    for name in v4:
        assert v4_config(name.replace("<N>", "2")).name == "random:" + name.replace("<N>", "2")


def test_help_states_each_commands_max_model_len_default(capsys):
    """``generate`` keeps a short default (2048); the server and ``LLM`` use the model's
    context length. Each ``--help`` says which."""
    from jfp8kv.entrypoints.generate import parse_args as generate_args
    from jfp8kv.serve.__main__ import parse_args as serve_args

    outs = {}
    for name, parse in (("generate", generate_args), ("serve", serve_args)):
        with pytest.raises(SystemExit):
            parse(["--help"])
        outs[name] = " ".join(capsys.readouterr().out.split())
    assert ("tokens per sequence, prompt plus output (default: 2048; this command's own, a "
            "short pool for a few prompts; the server and jfp8kv.LLM default to the model's "
            "context length)") in outs["generate"]
    assert ("tokens per sequence, prompt plus output (default: the model's context length)"
            in outs["serve"])
