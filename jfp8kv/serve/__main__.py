"""``python -m jfp8kv.serve``: run the OpenAI-compatible server (flag names follow vLLM's).

Shutdown: the first SIGTERM/SIGINT starts a drain: new requests get 503 (with Retry-After),
requests in flight run to completion (at most ``--drain-timeout`` seconds), then uvicorn
shuts down and the engine thread stops. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import uvicorn

from jfp8kv.cli import add_engine_args, build_llm, setup_logging
from jfp8kv.serve.app import build_app
from jfp8kv.serve.async_engine import AsyncEngine

logger = logging.getLogger("jfp8kv.serve")
PROG = "python -m jfp8kv.serve"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in 'model' (default: the engine's model name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to wait for in-flight requests on SIGTERM")
    p.add_argument("--log-level", default="info")
    p.add_argument("--warmup", default="auto", choices=("auto", "on", "off"),
                   help="on (auto is the same): compile every batch/chunk/page-width bucket "
                        "before /health says ready, behind a progress bar, so no request "
                        "waits for a compile (the persistent compilation cache makes later "
                        "starts fast); off: compile each shape on first use")
    return p.parse_args(argv)


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
    llm = build_llm(args, PROG)  # logs the one KV-cache summary line
    check_chat_template(llm.chat_prompt)
    if args.warmup in ("on", "auto"):
        llm.warmup()
    engine = llm.engine
    logger.info("model %s", engine.model_name)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, served_model_name=args.served_model_name or engine.model_name,
                    tokenizer=llm.tokenizer, chat_prompt=llm.chat_prompt,
                    max_model_len=engine.max_model_len,
                    vocab_size=llm.config.vocab_size)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_keep_alive=5)
    server = DrainingServer(config, async_engine, args.drain_timeout)
    server.run()


if __name__ == "__main__":
    main()
