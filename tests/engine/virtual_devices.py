"""Running a test file again in a child pytest whose JAX has several CPU devices (tensor
parallelism on this machine: the device count is fixed once JAX starts, so the parent
process cannot have them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_child(test_file: str, devices: int, *args: str) -> str:
    """``test_file`` in a child pytest with ``devices`` CPU devices (``args`` added); its
    stdout. The child inherits this process's XLA_FLAGS (tests/conftest.py's compile
    settings) with the device count appended; a failing child fails the caller with its
    output."""
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args,
           str(Path(test_file).resolve().relative_to(REPO_ROOT))]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, \
        f"child pytest failed:\n{proc.stdout[-12000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout
