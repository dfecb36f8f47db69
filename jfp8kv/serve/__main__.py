"""``python -m jfp8kv.serve``: run the OpenAI-compatible server (flag names follow vLLM's).

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and vLLM's
/tokenize, /detokenize, /tokenizer_info. /tokenize answers {"count", "max_model_len",
"tokens", "token_strs"}; "token_strs" (each token's string) is null unless the request sends
"return_token_strs": true, as in vLLM.

Network-facing limits (docs/guide/serving.md): ``--api-key`` (or JFP8KV_API_KEY) guards every
route but /health and /metrics; ``--max-queued-requests`` bounds the waiting requests (503
with Retry-After past it); ``--max-request-body-bytes`` (413) and ``--request-timeout``
(408, the request aborted and its pages freed). Start-up errors an operator causes (a bad
flag value, a port in use, a missing or unreadable model, a pool larger than free GPU memory)
end the process with one line on stderr and exit code 2; flags and the port are checked
before the model loads.

Shutdown: the first SIGTERM/SIGINT starts a drain: new requests get 503 (with Retry-After),
requests in flight run to completion (at most ``--drain-timeout`` seconds), then uvicorn
shuts down and the engine thread stops. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import time

import uvicorn

from jfp8kv.cli import (ArgumentParser, add_engine_args, build_llm, check_port, fail,
                        setup_logging)
from jfp8kv.serve.app import build_app
from jfp8kv.serve.async_engine import AsyncEngine
from jfp8kv.serve.limits import DEFAULT_MAX_BODY_BYTES, ServerLimits

logger = logging.getLogger("jfp8kv.serve")
PROG = "python -m jfp8kv.serve"


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, defaults={"max_queue_len": None})
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in 'model' (default: the engine's model name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 0-65535 (default: 8000)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to wait for in-flight requests on SIGTERM")
    p.add_argument("--log-level", default="info")
    p.add_argument("--warmup", default="auto", choices=("auto", "on", "off"),
                   help="on (auto is the same): compile every batch/chunk/page-width bucket "
                        "before /health says ready, behind a progress bar, so no request "
                        "waits for a compile (the persistent compilation cache makes later "
                        "starts fast); off: compile each shape on first use")
    net = p.add_argument_group("network limits")
    net.add_argument("--api-key", default=os.environ.get("JFP8KV_API_KEY"),
                     help="clients must send 'Authorization: Bearer <key>' on every route "
                          "but /health and /metrics (default: $JFP8KV_API_KEY; unset: none); "
                          "prefer the variable, a flag shows in the process list")
    net.add_argument("--max-queued-requests", dest="max_queue_len", type=int,
                     help="same as --max-queue-len: requests waiting for the engine beyond "
                          "this get 503 + Retry-After at once (default: --max-num-seqs, one "
                          "decode batch waiting behind the running one)")
    net.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help="larger request bodies get 413 (default: %(default)s)")
    net.add_argument("--request-timeout", type=float, default=None,
                     help="seconds from arrival after which a request is aborted, its KV "
                          "pages freed, and answered 408 (default: no deadline)")
    net.add_argument("--timeout-keep-alive", type=float, default=75.0,
                     help="seconds an idle HTTP connection stays open; keep it above the "
                          "idle expiry of the clients' and proxies' pools (httpx 5, aiohttp "
                          "15, nginx and cloud load balancers 60), or a request sent just "
                          "as the server closes the connection fails with a reset "
                          "(default: %(default)s)")
    args = p.parse_args(argv)
    check_port(p, args.port)
    if not args.timeout_keep_alive > 0:
        p.error(f"--timeout-keep-alive must be > 0 seconds, got {args.timeout_keep_alive}")
    if args.max_queue_len is None:
        args.max_queue_len = args.max_num_seqs
    return args


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a busy port fails in seconds,
    not after loading and compiling (uvicorn serves on it: no window for another process to
    take it; until uvicorn listens, a client's connection is refused)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        fail(PROG, f"cannot listen on {host}:{port}: {e.strerror or e} (is another server "
                   "running there? pick another --port)")
    sock.set_inheritable(True)
    return sock


def load_llm(args, prog: str):
    """``build_llm``, with any other start-up failure (a corrupt checkpoint file, say) shown
    as one line too; ``--log-level debug`` logs the traceback."""
    try:
        return build_llm(args, prog)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - one line for the operator, traceback at debug
        logger.debug("start-up failed", exc_info=True)
        fail(prog, f"cannot load the model {args.model or '(default)'}: "
                   f"{type(e).__name__}: {e}".splitlines()[0])


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains in-flight requests before stopping."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain_timeout_s: float):
        super().__init__(config)
        self._async_engine = async_engine
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:  # runs in the signal handler
        if self._async_engine.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self._async_engine.draining
            return
        self._async_engine.draining = True
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        n = self._async_engine.num_inflight
        logger.info("signal received: draining %d in-flight request(s) (new ones get 503)", n)
        deadline = time.monotonic() + self._drain_timeout_s
        while self._async_engine.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._async_engine.num_inflight:
            logger.warning("drain timeout: %d request(s) still running are aborted",
                           self._async_engine.num_inflight)
        self.should_exit = True


def uvicorn_config(app, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings from the parsed flags. The keep-alive outlasts the clients' pools:
    at uvicorn's 5 s (httpx's expiry too) a pooled connection reused just as the server's
    timer closes it ends in a reset: the likely cause of the H100 soak's ReadErrors
    (docs/lab/serving-notes.md)."""
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_keep_alive=args.timeout_keep_alive)


def check_chat_template(chat_prompt) -> None:
    """Render a probe conversation once at start-up. A missing template dependency stops the
    server with the import error (it names the package); a model without a usable chat
    template keeps serving /v1/completions, and /v1/chat/completions answers 400."""
    try:
        chat_prompt([{"role": "user", "content": "ping"}])
    except ImportError as e:
        raise SystemExit(f"cannot render chat templates: {e}") from None
    except Exception as e:  # noqa: BLE001 - a template problem, reported per request too
        logger.warning("chat template unusable (%s): /v1/chat/completions will answer 400", e)


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        limits = ServerLimits(api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                              request_timeout_s=args.request_timeout)
    except ValueError as e:
        fail(PROG, str(e))
    sock = bind_socket(args.host, args.port)  # before loading and the warm-up's compiling
    llm = load_llm(args, PROG)  # logs the one KV-cache summary line
    limits = dataclasses.replace(limits, pool_tokens=llm.cache_plan.max_tokens)
    check_chat_template(llm.chat_prompt)
    if args.warmup in ("on", "auto"):
        llm.warmup()
    engine = llm.engine
    logger.info("model %s", engine.model_name)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, served_model_name=args.served_model_name or engine.model_name,
                    tokenizer=llm.tokenizer, chat_prompt=llm.chat_prompt,
                    max_model_len=engine.max_model_len,
                    vocab_size=llm.config.vocab_size, limits=limits)
    server = DrainingServer(uvicorn_config(app, args), async_engine, args.drain_timeout)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
