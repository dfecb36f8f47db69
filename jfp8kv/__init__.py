"""jfp8kv: a JAX LLM inference engine whose paged KV cache can be stored in FP8."""

from jfp8kv.engine.types import RequestOutput, SamplingParams

__all__ = ["RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
