"""What the server refuses before a request reaches the engine: a missing or wrong API key
(401), a body larger than the limit (413), and the bounds a request's own work must respect
(stop strings, log-prob entries, the KV pool), plus the per-request deadline.

``Guard`` is a plain ASGI middleware, outermost in the app, so a refused request costs no
JSON parsing and no engine time:

- API key (as vLLM's ``--api-key``): every route but ``OPEN_PATHS`` needs
  ``Authorization: Bearer <key>``; keys are compared with ``hmac.compare_digest`` (constant
  time in the key's content) and never logged. ``/health`` and ``/metrics`` stay open for
  load balancers and Prometheus; they show no request content.
- Body size: a ``Content-Length`` above the limit is refused before reading; a chunked body
  is counted while read and refused once it passes the limit. The app sees the buffered body.
"""

from __future__ import annotations

import dataclasses
import hmac
import json

from jfp8kv.serve import protocol as P

OPEN_PATHS = frozenset({"/health", "/metrics"})
DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt as token ids fits (~1 MiB)
# Log-prob entries one request may ask for: choices x scored tokens x (top + 1). 2**20
# entries are ~64 MiB of JSON (one 32k-token choice with 20 alternatives fits); past
# that the formatting, not the model, is the work.
MAX_LOGPROB_ENTRIES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """The operator's bounds (``python -m jfp8kv.serve`` flags); None: no bound.

    ``api_key``: the bearer token every non-open route needs. ``max_body_bytes``: request
    body size (413 past it). ``request_timeout_s``: per-request deadline from arrival; past
    it the request is aborted (its pages freed) and answered 408. ``pool_tokens``: tokens
    the KV pool holds; a request whose choices cannot all fit at once is a 400.
    """

    api_key: str | None = None
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float | None = None
    pool_tokens: int | None = None

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string (or unset for no key)")
        for name in ("max_body_bytes", "request_timeout_s", "pool_tokens"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be positive (or unset for no bound), got {v!r}")

    def __repr__(self) -> str:  # never print the key
        key = None if self.api_key is None else "<set>"
        return (f"ServerLimits(api_key={key}, max_body_bytes={self.max_body_bytes}, "
                f"request_timeout_s={self.request_timeout_s}, pool_tokens={self.pool_tokens})")


async def _send_error(send, status: int, message: str, code: str, headers=()) -> None:
    body = json.dumps(P.error_body(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


class Guard:
    """ASGI middleware: the API key, then the body size (see the module docstring)."""

    def __init__(self, app, limits: ServerLimits):
        self.app = app
        self._key = None if limits.api_key is None else ("Bearer " + limits.api_key).encode()
        self._max_body = limits.max_body_bytes

    def _authorized(self, scope) -> bool:
        if self._key is None or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return True
        given = _header(scope, b"authorization") or b""
        return hmac.compare_digest(given, self._key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await _send_error(
                send, 401, "missing or incorrect API key: send 'Authorization: Bearer <key>' "
                "with the key the server was started with (--api-key / JFP8KV_API_KEY)",
                "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        if self._max_body is None or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, send) -> None:
        await _send_error(send, 413, f"request body is larger than {self._max_body} bytes "
                          "(the server's --max-request-body-bytes)", "request_too_large")


def _replay(body: bytes, receive):
    """A ``receive`` that yields the buffered body once, then the real channel (the app
    still hears ``http.disconnect``)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def work_problem(num_seqs: int, num_prompt: int, max_tokens: int, num_top: int | None,
                 num_scored: int, pool_tokens: int | None,
                 check_pool: bool) -> tuple[str, str] | None:
    """(param, message) when one request asks for more than the server bounds, else None.

    ``num_seqs`` engine requests (n or best_of) of ``num_prompt + max_tokens`` tokens each
    must fit in the KV pool together (``check_pool``: only when the client set max_tokens;
    a defaulted one is the context's remainder, which the request rarely uses): choices that
    cannot all be resident would preempt each other, recomputing without end. Log-prob
    entries (``num_top`` alternatives plus the chosen token, for every generated token and
    the ``num_scored`` prompt tokens of an echo) are bounded by ``MAX_LOGPROB_ENTRIES``.
    """
    need = num_seqs * (num_prompt + max_tokens)
    if check_pool and pool_tokens is not None and need > pool_tokens:
        return "max_tokens", (
            f"{num_seqs} choice(s) x ({num_prompt} prompt + {max_tokens} max_tokens) = {need} "
            f"tokens exceed the KV cache's {pool_tokens} tokens (the server's "
            f"--kv-cache-memory); lower n, best_of or max_tokens")
    if num_top is not None or num_scored:
        entries = num_seqs * (max_tokens + num_scored) * ((num_top or 0) + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            return "logprobs", (
                f"{num_seqs} choice(s) x {max_tokens + num_scored} tokens x "
                f"{(num_top or 0) + 1} log-probs = {entries} entries exceed the server's "
                f"bound of {MAX_LOGPROB_ENTRIES}; lower n, max_tokens or the top log-probs")
    return None
