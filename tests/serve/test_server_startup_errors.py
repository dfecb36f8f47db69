"""Start-up errors an operator can cause, through ``python -m jfp8kv.serve`` as a process: a
port in use, a missing model, a corrupt checkpoint file. Each is one line on stderr naming
the problem, exit code 2, no traceback. (A pool larger than free GPU memory:
``test_network_limits.py`` fakes the device's memory counts.)"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

from .conftest import REPO_ROOT, SERVER_FLAGS

PROG = "python -m jfp8kv.serve"


def _serve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jfp8kv.serve", "--dtype", "float32",
                           "--warmup", "off", *SERVER_FLAGS, *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(PROG + ": error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_port_in_use(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _one_line(_serve("--model", str(tiny_model_dir), "--host", "127.0.0.1",
                                "--port", str(port)))
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line


def test_missing_and_corrupt_model(tiny_model_dir, tmp_path):
    missing = tmp_path / "no-such-model"
    line = _one_line(_serve("--model", str(missing)))
    assert "cannot resolve model" in line and str(missing) in line
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, corrupt)
    weights = next(corrupt.glob("*.safetensors"))
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + b"\0" * 64)
    line = _one_line(_serve("--model", str(corrupt)))
    assert str(corrupt) in line or "safetensors" in line.lower(), line
