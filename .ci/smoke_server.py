"""CI smoke test of the README's first command, run with a venv that has no extras installed.

Starts ``python -m jfp8kv.serve --kv-cache-dtype fp8_e4m3 --max-model-len 4096`` exactly as
the README does (its defaults: 127.0.0.1, port 8000, the embedded default model), waits for
/health, sends one chat completion and one streaming completion, checks that both answers are
well-formed and non-empty, and stops the server with SIGTERM (then SIGKILL). Every wait is
bounded; only loopback is contacted. Exit status 0 when every step passed; otherwise 1, with
the server log's tail printed. Standard library only: the venv has no test extras.

Usage: .venv-without-extras/bin/python .ci/smoke_server.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from urllib.error import HTTPError
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["-m", "jfp8kv.serve", "--kv-cache-dtype", "fp8_e4m3", "--max-model-len", "4096"]
BASE = "http://127.0.0.1:8000"
HEALTH_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0  # the first answer pays compilation: 266 s on a loaded 2-core CPU
STOP_TIMEOUT_S = 60.0
MAX_TOKENS = 8
# Loopback only, whatever http_proxy says.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class SmokeFailure(Exception):
    pass


def say(msg: str) -> None:
    print(f"[smoke] {msg}", flush=True)


def http(path: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S):
    """GET (no body) or POST JSON; returns the open response (the caller reads it)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data,
                                 headers={"Content-Type": "application/json"})
    return OPENER.open(req, timeout=timeout)


def port_in_use() -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", 8000)) == 0


def wait_healthy(proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SmokeFailure(f"server exited with status {proc.returncode} before /health")
        try:
            with http("/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SmokeFailure(f"/health did not answer 200 within {HEALTH_TIMEOUT_S:.0f} s")


def check_chat(model: str) -> str:
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with http("/v1/chat/completions", body) as r:
        answer = json.load(r)
    choice = answer["choices"][0]
    text = choice["message"]["content"]
    if answer.get("object") != "chat.completion" or choice["message"].get("role") != "assistant":
        raise SmokeFailure(f"malformed chat completion: {answer}")
    if not isinstance(text, str) or not text.strip():
        raise SmokeFailure(f"empty chat answer: {answer}")
    if choice.get("finish_reason") not in ("stop", "length") or \
            not 1 <= answer["usage"]["completion_tokens"] <= MAX_TOKENS:
        raise SmokeFailure(f"chat finish_reason/usage wrong: {answer}")
    return text


def check_stream(model: str) -> str:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    pieces, finish, done = [], None, False
    with http("/v1/completions", body) as r:
        if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            raise SmokeFailure(f"stream answered {r.headers.get('Content-Type')!r}")
        for raw in r:
            line = raw.decode("utf-8").strip()
            if not line:
                continue
            if not line.startswith("data: "):
                raise SmokeFailure(f"not a server-sent event line: {line!r}")
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: "):])
            if chunk.get("object") != "text_completion":
                raise SmokeFailure(f"malformed stream chunk: {chunk}")
            pieces.append(chunk["choices"][0]["text"])
            finish = chunk["choices"][0].get("finish_reason") or finish
    text = "".join(pieces)
    if not done or finish not in ("stop", "length") or not text.strip():
        raise SmokeFailure(f"stream incomplete: done={done} finish={finish} text={text!r}")
    return text


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; returns the exit status."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        raise SmokeFailure(f"server ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s; killed")


def run(log_path: Path) -> None:
    if port_in_use():
        raise SmokeFailure("127.0.0.1:8000 is already in use; the README's command needs it")
    cmd = [sys.executable, *COMMAND]
    say(f"starting: {' '.join(cmd)} (log: {log_path})")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_healthy(proc)
        t_health = time.monotonic()
        say(f"/health answered 200 after {t_health - t0:.1f} s")
        with http("/v1/models", timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
        text = check_chat(model)
        t_chat = time.monotonic()
        say(f"chat answer after {t_chat - t_health:.1f} s more: {text!r}")
        text = check_stream(model)
        say(f"streamed completion after {time.monotonic() - t_chat:.1f} s more: {text!r}")
    except BaseException:
        try:
            stop(proc)
        except SmokeFailure as e:
            say(str(e))
        raise
    status = stop(proc)
    if status != 0:
        raise SmokeFailure(f"server exited with status {status} after SIGTERM")
    say(f"server stopped cleanly; all steps passed in {time.monotonic() - t0:.1f} s")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="jfp8kv-smoke-") as tmp:
        log_path = Path(tmp) / "server.log"
        try:
            run(log_path)
            return 0
        except (SmokeFailure, OSError, KeyError, IndexError, ValueError) as e:
            body = e.read().decode(errors="replace") if isinstance(e, HTTPError) else ""
            say(f"FAILED: {type(e).__name__}: {e} {body}")
            if log_path.exists():
                tail = log_path.read_text(errors="replace").splitlines()[-60:]
                say("server log tail:\n" + "\n".join(tail))
            return 1


if __name__ == "__main__":
    sys.exit(main())
