"""Exceptions the engine raises to its callers (the server maps them to HTTP codes)."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 503)."""
