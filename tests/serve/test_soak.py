"""The soak's CI variant (issue 39): ``bench.soak`` against a tiny-model server of its own,
started as an operator facing a network would (API key from JFP8KV_API_KEY, a short queue,
a request deadline): ~10 s of warm-up then 30 s of mixed traffic (streams dropped mid-way,
malformed requests, wrong keys, bursts 4x above what the server admits), and every end check
must hold: no 5xx for a client mistake and none but 503, every KV page back in the pool,
greedy probe answers unchanged, server RSS flat after the warm-up; the key is in no log."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest

from bench import soak

from .conftest import SERVER_FLAGS, ServerProcess

KEY = "sk-soak-" + "5be1" * 6
MAX_NUM_SEQS, MAX_QUEUED = 8, 4


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir, tmp_path_factory, request):
    """Warm-up on: every shape compiles before /health (from the persistent cache after the
    first run), so the soak's RSS and latencies are not those of compiling."""
    jax_cache = (os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or request.config.cache.mkdir("jfp8kv-jax-compilation-cache"))
    flags = [f for f in SERVER_FLAGS]
    flags[flags.index("--max-queue-len") + 1] = str(MAX_QUEUED)
    log = tmp_path_factory.mktemp("soak-server") / "server.log"
    with mock.patch.dict(os.environ, {"JFP8KV_API_KEY": KEY}):
        srv = ServerProcess(tiny_model_dir, log, jax_cache, *flags, "--request-timeout", "60",
                            "--log-level", "info", "--warmup", "on")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_soak_short(soak_server, tmp_path):
    out = tmp_path / "soak.json"
    burst = 4 * (MAX_NUM_SEQS + MAX_QUEUED)
    doc = soak.main(["--url", soak_server.url, "--server-pid", str(soak_server.proc.pid),
                     "--api-key", KEY, "--warmup", "10", "--duration", "30", "--clients", "3",
                     "--burst-every", "8", "--burst-size", str(burst), "--max-tokens", "16",
                     "--max-prompt-words", "10", "--unloaded-requests", "4",
                     "--request-timeout", "120", "--out", str(out)])
    text = out.read_text()
    assert KEY not in text and json.loads(text)["checks"] == doc["checks"]
    assert doc["checks"] == {k: True for k in doc["checks"]}, json.dumps(doc, indent=1)
    kinds, statuses = doc["by_kind"], doc["by_status"]
    assert doc["requests_served"] >= 10 and kinds.get("malformed", 0) >= 1, kinds
    assert doc["overload"]["bursts"] >= 2 and doc["overload"]["burst_rejected_503"] >= 1, doc
    assert set(statuses) <= {"200", "400", "401", "404", "503"}, statuses
    soak_server.stop()
    log = soak_server.log_path.read_text()
    assert "POST /v1/completions" in log and KEY not in log  # access log on, key absent
