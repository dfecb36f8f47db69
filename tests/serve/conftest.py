"""Real server processes (``python -m jfp8kv.serve``) on 127.0.0.1 with a tiny random Llama.

One session-scoped server serves every test but the SIGTERM one, which gets a spare server
launched at the same time (so its start-up overlaps the main one's). The KV pool is small
(``SERVER_FLAGS``: 12 pages of 16 tokens, max_model_len 128): one request never lacks pages,
but four of 64 tokens must preempt each other (the server runs greedy admission for that:
the default, reserve, would start them as their pages allow and not preempt). Server processes share a persistent JAX
compilation cache under pytest's cache dir, so the spare server and later runs skip most
compiles. Tests send temperature 0 unless sampling is the point, which keeps the set of
compiled shapes small.

The checkpoint is a 2-layer Llama written by the shared builder (tests/tiny_checkpoints.py)
next to the SmolLM2 tokenizer (built from the packaged GGUF's metadata), so the server runs
the real loader, engine and tokenizer on CPU. Weights use a larger init scale than HF's
default so that greedy argmaxes are not near-ties.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.tiny_checkpoints import build_tiny_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240.0
# float32 K/V of the tiny model: 2 layers x 2 (K, V) x 2 heads x 16 dims x 4 B = 512 B/token,
# 8 KiB per 16-token page: 12 usable pages (the reserved sink page is not counted).
POOL_PAGES = 12
MAX_MODEL_LEN = 128
SERVER_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                "--max-num-batched-tokens", "512", "--kv-cache-memory", str(POOL_PAGES * 8192),
                "--max-queue-len", "40", "--admission", "greedy")


def build_server_checkpoint(path: Path, tokenizer_dir: Path) -> Path:
    """The served tiny Llama: HF's init at range 0.2 (seed 1234), the SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return build_tiny_checkpoint(
        path, "llama", tokenizer_dir=tokenizer_dir, init_seed=1234, vocab_size=len(tokenizer),
        intermediate_size=128, head_dim=16, rms_norm_eps=1e-6, initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``python -m jfp8kv.serve`` child; ``url`` is its base URL."""

    def __init__(self, model_dir: Path, log_path: Path, jax_cache: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "jfp8kv.serve", "--model", str(model_dir),
               "--dtype", "float32", "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "tiny", "--log-level", "warning", *extra]
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                   JAX_COMPILATION_CACHE_DIR=str(jax_cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2")
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self) -> "ServerProcess":
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    return build_server_checkpoint(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


@pytest.fixture(scope="session")
def _servers(tiny_model_dir, tmp_path_factory, request):
    """Launch the main and the spare server together; stop both at session end."""
    jax_cache = (os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or request.config.cache.mkdir("jfp8kv-jax-compilation-cache"))
    logs = tmp_path_factory.mktemp("server-logs")
    started = [ServerProcess(tiny_model_dir, logs / f"{name}.log", jax_cache, *SERVER_FLAGS)
               for name in ("main", "spare")]
    try:
        yield started
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="session")
def server(_servers) -> ServerProcess:
    return _servers[0].wait_ready()


@pytest.fixture(scope="session")
def spare_server(_servers) -> ServerProcess:
    """A second server with the same flags, for a test that ends it (SIGTERM)."""
    return _servers[1].wait_ready()


def metric_values(url: str) -> dict[str, float]:
    """/metrics parsed with prometheus_client's parser: {sample name{labels}: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(url: str, limit_s: float = 60.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV page is held."""
    deadline = time.monotonic() + limit_s
    m = {}
    while time.monotonic() < deadline:
        m = metric_values(url)
        if (m["jfp8kv_kv_cache_pages_used"] == 0 and m["jfp8kv_num_requests_running"] == 0
                and m["jfp8kv_queue_length"] == 0):
            return m
        time.sleep(0.1)
    raise AssertionError(f"server not idle after {limit_s} s: {m}")
