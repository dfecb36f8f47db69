"""jfp8kv: a JAX LLM inference engine whose paged KV cache can be stored in FP8.

The public names are loaded on first use (PEP 562), so importing a plain-Python part such
as ``jfp8kv.kvcache.allocator`` or ``jfp8kv.engine.scheduler`` does not import JAX.
"""

import importlib as _importlib

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
