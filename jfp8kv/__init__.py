"""jfp8kv: a JAX LLM inference engine whose paged KV cache can be stored in FP8.

The public names are loaded on first use (PEP 562), so importing a plain-Python part such
as ``jfp8kv.kvcache.allocator`` or ``jfp8kv.engine.scheduler`` does not import JAX.
"""

import importlib as _importlib
import logging as _logging


class _NoTorchNotice(_logging.Filter):
    """Drops transformers' "PyTorch was not found. Models won't be available ..." notice,
    logged at its import when torch is absent: jfp8kv uses transformers for tokenizers and
    configs only, so the notice is true of every jfp8kv run and says nothing to act on. Only
    that record is dropped; transformers' other warnings pass."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found.")


# On the library logger transformers logs that notice to (its own root, "transformers");
# installed here because every jfp8kv path that imports transformers imports jfp8kv first.
_logging.getLogger("transformers").addFilter(_NoTorchNotice())

# public name -> module that defines it
_EXPORTS = {
    "LLM": "jfp8kv.engine.llm",
    "generate": "jfp8kv.engine.llm",
    "RequestOutput": "jfp8kv.engine.types",
    "SamplingParams": "jfp8kv.engine.types",
    "CacheOptions": "jfp8kv.config",
    "EngineConfig": "jfp8kv.config",
    "LoadConfig": "jfp8kv.config",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jfp8kv' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
